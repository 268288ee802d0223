"""One sampler engine: vLLM hosted in this process, fed weights as Hugging Face-named tensors.

The engine is built from the model's ``config.json`` alone, with placeholder weights
(``load_format="dummy"``); its real weights arrive through ``load_weights``, from memory,
through vLLM's own loading path (its worker's ``reload_weights``, reached with
``collective_rpc``): each tensor goes through the model's ``load_weights`` and whatever
processing the platform applies after loading. No file of weights is written or read.

LoRA adapters (a service with ``--max-adapters``) are served with vLLM's LoRA support: the
engine is built with ``enable_lora``, and ``load_adapter`` hands vLLM one version of an
adapter in PEFT's format, as its own vLLM adapter (``name@step``), and drops the versions of
that adapter the pool's window no longer keeps (``adapter_slots.py``, which also keeps each
adapter's newest slot for in-flight updates).

The engine holds one version of the base. A sample names the version it wants (a
``Shipment`` of the pool's window); one that the engine does not hold is loaded first, in the
sample's own call (a swap), and so is a version of an adapter it does not hold.

``VllmEngine`` is vLLM's ``LLM`` (its ``LLMEngine`` runs in this process); ``sampler.py``'s
``VllmSampler`` calls it from a thread of its own: ``admit`` adds a request's prompts,
``advance`` takes one engine step of every request in it, ``cancel`` drops prompts. Requests
of one version of the base share the engine, and so do adapter requests (each with its own
adapter version); a weight load runs when none is in it, so a result is produced by one step's
weights, and says which. Base and adapter requests never share an engine batch. On a CPU
engine with LoRA enabled, base requests go through ``lora_guard``: vLLM's CPU LoRA ops would
otherwise give them the last adapter's.

An error inside a call fails that call and nothing after it: what the call left in the engine
is aborted before it answers (a request that raised in vLLM's step otherwise stayed scheduled,
and every later call waited on it for good). An engine that cannot be cleared, or whose weight
load failed half-way, answers ``EngineBrokenError``, and the pool recreates it. A weight load is
checked against the last one's names, shapes and dtypes before any tensor is copied.

Weights arrive as a ``Shipment``; vLLM's model worker opens it itself (``reload.py``), so no
tensor travels as an argument of ``collective_rpc``.

One concern, at its length: vLLM in one process, and every way a call on it can end. LoRA,
swaps and the guard are states of that same engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainctl.api import (
    InternalError,
    InvalidRequestError,
    NotReadyError,
    SampleRequest,
    SampleResult,
)
from trainctl.api.errors import field_error
from trainctl.workers.sampler.backend import EngineBrokenError, Loaded
from trainctl.workers.sampler.spec import PeftAdapter, SamplerSpec
from trainctl.workers.sampler.transport import (
    Schema,
    Shipment,
    open_shipment,
    schema_mismatch,
)
from trainctl.workers.sampler.vllm_backend import gloo_engine, nccl_engine
from trainctl.workers.sampler.vllm_backend.adapter_slots import AdapterSlots
from trainctl.workers.sampler.vllm_backend.folders import (
    CONFIG_DIR_PREFIX,
    sweep_left_behind,
)
from trainctl.workers.sampler.vllm_backend.outputs import prompt_samples, version_label
from trainctl.workers.sampler.vllm_backend.reload import reload, reload_kept
from trainctl.workers.sampler.vllm_backend.rules import vllm_max_lora_rank
from trainctl.workers.sampler.wires import NcclWire, wire_of


class VllmEngine:
    """vLLM's ``LLM`` in this process, with the adapters and weights it serves. Every
    method runs on the one thread ``VllmSampler`` gives it. Owns the ``LLM``, its adapters'
    directory and ids, and the step and schema of the weights it holds."""

    def __init__(self, index: int, spec: SamplerSpec) -> None:
        import torch

        self.index = index
        cuda = torch.cuda.is_available()
        if not cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.kv_cache_gib))
        sweep_left_behind()
        self._dir = tempfile.TemporaryDirectory(prefix=f"{CONFIG_DIR_PREFIX}{os.getpid()}-")
        config = {**spec.hf_config, "torch_dtype": spec.dtype, "dtype": spec.dtype}
        Path(self._dir.name, "config.json").write_text(json.dumps(config))

        from vllm import LLM

        t0 = time.perf_counter()
        kwargs: dict[str, Any] = {}
        if cuda:
            kwargs["gpu_memory_utilization"] = spec.gpu_memory_utilization
        if spec.max_adapters:
            if not cuda:
                from trainctl.workers.sampler.vllm_backend import lora_guard

                lora_guard.install()
            kwargs |= {
                "enable_lora": True,
                # The adapters' requests share the engine's batches (sampler.py's lanes): a
                # step can hold each adapter once.
                "max_loras": spec.max_adapters,
                # Each version its own, and with in-flight updates each adapter's newest slot.
                "max_cpu_loras": spec.max_adapters * (spec.versions + int(spec.in_flight)),
                "max_lora_rank": vllm_max_lora_rank(spec.max_lora_rank),
            }
        if spec.weight_transfer == gloo_engine.BACKEND:
            gloo_engine.register()
            kwargs["weight_transfer_config"] = {"backend": gloo_engine.BACKEND}
        elif spec.weight_transfer == NcclWire.name:  # vLLM's own, keeping what it received
            nccl_engine.register()
            kwargs["weight_transfer_config"] = {"backend": nccl_engine.BACKEND}
        if spec.return_routes:  # vLLM keeps the routes with its prefix cache's blocks
            kwargs |= {"enable_return_routed_experts": True, "enable_prefix_caching": True}
        self.adapters_enabled = bool(spec.max_adapters)
        self.weight_transfer = spec.weight_transfer
        self.llm = LLM(
            model=self._dir.name,
            load_format="dummy",  # the weights come from the trainer, never from disk
            # The model's tokenizer where the --init-hf directory has one (string stops);
            # else token ids alone.
            tokenizer=spec.tokenizer,
            skip_tokenizer_init=spec.tokenizer is None,
            dtype=spec.dtype,
            enforce_eager=True,
            max_model_len=spec.max_model_len,
            max_num_seqs=spec.max_num_seqs,
            seed=spec.seed,
            **kwargs,
        )
        self.adapters = AdapterSlots(self.llm, index, spec.in_flight)
        """The adapters' versions held, and their newest slots (``adapter_slots.py``)."""
        self._warm_up()
        self.build_s = time.perf_counter() - t0
        self.step: int | None = None
        """The optimizer step of the weights loaded (None: placeholders only)."""
        self.shipment: str | None = None
        """The id of the shipment they were loaded from."""
        self.schema: Schema | None = None
        """The names, shapes and dtypes of the weights loaded (what the next load must have)."""
        self._generation: tuple[int, str] | None = None
        """The collective group this engine's workers joined: its generation and store
        prefix (None: none)."""

    def _warm_up(self) -> None:
        """One short generation, so that the first request does not pay for the engine's
        first-call set-up (seconds on a CPU)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=2, logprobs=0, prompt_logprobs=0, detokenize=False)
        self.llm.generate([TokensPrompt(prompt_token_ids=[0, 1])], params, use_tqdm=False)

    def load_weights(
        self,
        shipment: Shipment,
        member: tuple[dict[str, Any], int] | None = None,
        keep: Sequence[str] = (),
    ) -> Loaded:
        """Load a step's weights: every tensor of the model, under its HF name. A set whose
        names, shapes or dtypes differ from the last one loaded is refused before anything is
        copied (the engine keeps serving what it has); a load that fails half-way leaves the
        engine broken (``EngineBrokenError``: the pool recreates it). A collective shipment is
        received over the group ``member`` names (``_receive``), and a copy kept in host
        memory; ``keep``: the shipment ids whose copies to keep (the pool's window)."""
        if shipment.transport == "collective":
            if member is None:
                raise InternalError(
                    f"sampler {self.index}: step {shipment.version}'s weights arrive by "
                    "broadcast, and this engine is not a member of the group"
                )
            return self._receive(shipment, *member, keep)
        t0 = time.perf_counter()
        step = shipment.version
        try:
            per_worker = self.llm.collective_rpc(reload, args=(shipment, self.schema))
        except Exception as e:
            raise self._broken(step, e) from None
        if problem := next((r.problem for r in per_worker if r.problem), None):
            raise self._refused(step, problem)
        empty = [n for r in per_worker for n in r.empty]
        if empty:
            raise EngineBrokenError(
                f"sampler {self.index} loaded step {step}'s weights with {len(empty)} "
                f"parameter(s) left empty ({', '.join(empty[:3])}); it is being recreated"
            )
        loaded = self._loaded(step, per_worker[0].schema, shipment.id, t0)
        return dataclasses.replace(loaded, transfer_s=per_worker[0].opened_s)

    def _receive(
        self, shipment: Shipment, rendezvous: dict[str, Any], rank: int, keep: Sequence[str]
    ) -> Loaded:
        """Receive a step's weights over the collective through vLLM's own weight-sync
        sequence, in the wire the rendezvous names (``workers/sampler/wires.py``), while the
        sender sends them: the group is joined once per generation, and a set whose schema
        differs from the one served is refused before any byte moves (the sender then waits
        out the group's timeout, and the next sync forms a new group). Over ``gloo`` every
        bucket arrives before the model is touched, so a receive that broke leaves the old
        weights serving; a load that broke (or, over ``nccl``, a receive: vLLM loads as
        buffers arrive) leaves the engine broken (``EngineBrokenError``). Either way the engine
        keeps what it received for the window (``keep``)."""
        t0 = time.perf_counter()
        step, plan = shipment.version, shipment.handle
        schema: Schema = plan.schema
        if self.schema is not None and (problem := schema_mismatch(schema, self.schema)):
            raise self._refused(step, problem)
        wire = wire_of(rendezvous)
        if wire.name != self.weight_transfer:
            raise InternalError(
                f"sampler {self.index} was built for the {self.weight_transfer} wire, and "
                f"step {step}'s weights come over {wire.name}"
            )
        rpc = self.llm.collective_rpc
        group = (rendezvous["generation"], rendezvous["prefix"])  # a new store: a new group
        if self._generation != group:
            rpc("init_weight_transfer_engine", args=(wire.init_payload(rendezvous, rank),))
            self._generation = group
        update = wire.update_payload(plan, shipment.id, list(keep))
        try:
            rpc("start_weight_update")
            rpc("update_weights", args=(update,))
            received_s = time.perf_counter() - t0
        except Exception as e:
            self._generation = None  # the group is broken: the next sync forms a new one
            if not wire.whole_first:
                raise self._broken(step, e) from None
            raise InternalError(
                f"sampler {self.index} did not receive step {step}'s weights "
                f"({type(e).__name__}: {e}); it serves step {self.step} still"
            ) from None
        try:
            rpc("finish_weight_update")
        except Exception as e:
            raise self._broken(step, e) from None
        return dataclasses.replace(
            self._loaded(step, schema, shipment.id, t0), transfer_s=received_s
        )

    def _reload_kept(self, version: Shipment) -> Loaded:
        """A swap back to a version received over the collective: a broadcast cannot be
        replayed, so the engine reloads the copy it kept in host memory."""
        t0 = time.perf_counter()
        try:
            kept = self.llm.collective_rpc(reload_kept, args=(version.id,))
        except Exception as e:
            raise self._broken(version.version, e) from None
        if not all(kept):
            raise InternalError(
                f"sampler {self.index} keeps no copy of step {version.version}'s weights (it "
                "keeps those of the samplers' window it received); sample a newer step"
            )
        assert self.schema is not None
        return self._loaded(version.version, self.schema, version.id, t0)

    def _refused(self, step: int, problem: str) -> InternalError:
        """A weight set refused before anything was copied: the engine serves what it had."""
        return InternalError(
            f"sampler {self.index} refused step {step}'s weights, which do not match the "
            f"ones it serves (step {self.step}): {problem}"
        )

    def _broken(self, step: int, e: Exception) -> EngineBrokenError:
        """A load that failed half-way: the pool recreates the engine."""
        return EngineBrokenError(
            f"sampler {self.index} failed loading step {step}'s weights half-way "
            f"({type(e).__name__}: {e}); it is being recreated"
        )

    def _loaded(self, step: int, schema: Schema, shipment: str, t0: float) -> Loaded:
        self.step, self.schema, self.shipment = step, schema, shipment
        self._label()
        self._forget_cached_prefixes()
        return Loaded(step=step, seconds=time.perf_counter() - t0)

    def _label(self) -> None:
        """vLLM labels every engine step from now on with the versions this engine serves:
        the base's step and each adapter's newest slot's. A completion's ``weight_versions``
        spans give each token's step (``outputs.token_steps``)."""
        self.llm.llm_engine.set_weight_version(version_label(self.step, self.adapters.steps()))

    def _forget_cached_prefixes(self) -> None:
        """Drop vLLM's prefix cache after a load: its blocks hold keys and values computed with
        the weights before, and a prompt that shares them would read them (measured: an RL
        loop's prompt sampled again after a sync got log-probs 1.3 nats off the trainer's).
        A load beside running requests (an in-flight update) preempts them: vLLM recomputes
        each one's prompt and the tokens it generated so far with the new weights, then goes
        on (without it, the tokens after the load were neither step's)."""
        running = self.llm.llm_engine.has_unfinished_requests()
        if not self.llm.llm_engine.reset_prefix_cache(reset_running_requests=running):
            raise EngineBrokenError(
                f"sampler {self.index} could not clear its prefix cache after a weight load; "
                "it is being recreated"
            )

    def _recover(self) -> None:
        """After a call raised inside vLLM: abort every request it left in the engine, so the
        next call starts clean; ``EngineBrokenError`` if some remain."""
        engine = self.llm.llm_engine
        left = list(engine.output_processor.request_states)
        if left:
            engine.abort_request(left, internal=True)
        if engine.has_unfinished_requests():
            raise EngineBrokenError(
                f"sampler {self.index} still holds requests after aborting them; it is being "
                "recreated"
            )

    def _generate(self, prompts: list[Any], params: Any, lora: Any) -> list[Any]:
        """``llm.generate``; an error inside it fails this call alone (the engine is cleared
        first) with a 500 that names it."""
        try:
            return self.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        except Exception as e:
            raise self._cleared(e) from None

    def _cleared(self, e: Exception) -> InternalError:
        """After ``e`` inside vLLM: the engine cleared of what it holds (``_recover``), and the
        500 for the requests that were in it."""
        self._recover()
        return InternalError(
            f"sampler {self.index} failed this request ({type(e).__name__}: {e}); it serves "
            "the next one"
        )

    def load_adapter(
        self, shipment: Shipment, keep: Sequence[int] = (), newest: bool = False
    ) -> Loaded:
        """Load the shipment's version of its adapter (replacing one of the same step in
        place), then drop that adapter's versions whose steps are not in ``keep``.
        ``newest``: a sync's (the adapter's newest version): with in-flight updates it also
        replaces the adapter's newest slot, and the requests running on it go on with it."""
        t0 = time.perf_counter()
        assert shipment.adapter is not None
        adapter: PeftAdapter = open_shipment(shipment)
        if self.adapters.load(shipment, adapter, keep, newest):
            self._forget_cached_prefixes()  # the same id with other factors: stale blocks
        self._label()
        return Loaded(step=shipment.version, seconds=time.perf_counter() - t0)

    def remove_adapter(self, name: str) -> None:
        """Drop every version of ``name``, and its newest slot."""
        self.adapters.remove(name)
        self._label()

    def _generate_then_score(self, prompts: list[Any], params: Any, lora: Any) -> list[Any]:
        """Prompt log-probs on an engine with LoRA enabled, one prompt per engine step.

        vLLM 0.32 with ``enable_lora`` fails computing prompt log-probs for several requests
        in one step (its LoRA LM head indexes adapters per request, not per prompt token:
        "einsum(): subscript b has size 2 ... size 7"); with one request it is exact. So the
        completions are generated as usual and each prompt is then scored alone."""
        from vllm import SamplingParams

        outs = self._generate(prompts, params, lora)
        score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        for prompt, out in zip(prompts, outs, strict=True):
            scored = self._generate([prompt], score, lora)
            out.prompt_logprobs = scored[0].prompt_logprobs
        return outs

    def _hold(self, version: Shipment) -> Any:
        """Make ``version`` (of the base, or of an adapter) the one this call samples, loading
        it if this engine holds another: vLLM's LoRA request for it (None: the base)."""
        self._require_weights()
        if version.adapter is None:
            if self.shipment != version.id:  # a swap: another version of the window
                if version.transport == "collective":
                    self._reload_kept(version)
                else:
                    self.load_weights(version)
            return None
        served = self.adapters.held(version)
        if served is None:
            self._load_beside_held(version)
            served = self.adapters.versions[(version.adapter, version.version)]
        return served.request(version.adapter)

    def _newest_slot(self, version: Shipment) -> tuple[Any, int]:
        """vLLM's LoRA request for ``version``'s adapter's newest slot (in-flight updates), and
        the step it holds: ``version``'s, or a newer one already synced; loaded first if the
        slot is missing or older."""
        self._require_weights()
        name = version.adapter
        assert name is not None
        slot = self.adapters.newest.get(name)
        if slot is None or slot.step < version.version:
            self._load_beside_held(version, newest=True)
            slot = self.adapters.newest[name]
        return slot.request(name), slot.step

    def _require_weights(self) -> None:
        if self.step is None:
            raise NotReadyError("the sampler has no weights yet: they arrive with the first sync")

    def _load_beside_held(self, version: Shipment, newest: bool = False) -> None:
        """Load an adapter's ``version`` in a sample's turn, keeping every version of it held
        (the pool's next sync says which to drop)."""
        assert version.adapter is not None
        held = [v.step for v in self.adapters.versions_of(version.adapter)]
        self.load_adapter(version, keep=held, newest=newest)

    def _params(self, req: SampleRequest) -> Any:
        """vLLM's sampling parameters for ``req`` (its own checks: a 422)."""
        from vllm import SamplingParams

        try:
            return SamplingParams(
                n=req.n,
                max_tokens=req.max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                seed=req.seed,
                stop_token_ids=list(req.stop_token_ids),
                stop=list(req.stop) or None,
                logprobs=0 if req.logprobs else None,
                detokenize=bool(req.stop),  # text only where a string stop must be found
            )
        except (ValueError, TypeError) as e:  # vLLM's own checks: a 422 naming the field
            raise field_error(getattr(e, "parameter", None) or "sampling_params", str(e)) from None

    def runs_alone(self, req: SampleRequest) -> bool:
        """Whether ``req`` must have the engine to itself: prompt log-probs on an engine with
        LoRA enabled (see ``_generate_then_score``)."""
        return bool(req.prompt_logprobs) and self.adapters_enabled

    def sample(self, req: SampleRequest, version: Shipment) -> SampleResult:
        """Generate from every prompt with ``version``'s weights (the base's, or those of
        ``req.adapter``): the pool's choice, which checked ``step`` and ``expected_step``. The
        whole request in one call, with the engine to itself."""
        lora = self._hold(version)
        params = self._params(req)
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req.prompts]
        t0 = time.perf_counter()
        if not req.prompt_logprobs:
            outs = self._generate(prompts, params, lora)
        elif not self.adapters_enabled or (len(prompts) == 1 and req.n == 1):
            params.prompt_logprobs = 0
            outs = self._generate(prompts, params, lora)
        else:
            outs = self._generate_then_score(prompts, params, lora)
        return self.result(req, outs, version.version, time.perf_counter() - t0)

    def admit(
        self, request_id: str, req: SampleRequest, version: Shipment, newest: bool = False
    ) -> tuple[list[str], int]:
        """Add ``req``'s prompts to the engine, beside the requests it runs (of the same lane:
        the caller's ``Turns`` says so), without running them: ``advance`` does. Returns
        their ids in vLLM, one per prompt, in order, and the step they start with.
        ``newest``: a request for the newest weights beside others (in-flight updates): of
        the base, it joins them with the weights they run, which an in-flight load may have
        made newer than ``version``; of an adapter, it runs on the adapter's newest slot."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if newest and version.adapter is not None and self.adapters.in_flight:
            lora, step = self._newest_slot(version)
        else:
            joins = (
                newest and self.step is not None and self.llm.llm_engine.has_unfinished_requests()
            )
            lora = None if joins else self._hold(version)
            step = self.step if joins and self.step is not None else version.version
        params = self._params(req)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # an output when a prompt is done
        if req.prompt_logprobs:
            params.prompt_logprobs = 0
        ids: list[str] = []
        try:
            for i, p in enumerate(req.prompts):
                ids.append(f"{request_id}/{i}")
                self.llm.llm_engine.add_request(
                    ids[-1], TokensPrompt(prompt_token_ids=list(p)), params, lora_request=lora
                )
        except (ValueError, TypeError) as e:  # vLLM's checks of a prompt (its length, ...)
            self.cancel(ids)
            raise InvalidRequestError(f"prompts: {e}") from None
        except Exception as e:
            self.cancel(ids)
            raise InternalError(
                f"sampler {self.index} could not add this request ({type(e).__name__}: {e})"
            ) from None
        return ids, step

    def advance(self) -> list[Any]:
        """One engine step of every request in the engine: the outputs of the prompts it
        finished. An error inside vLLM fails the requests running (all of them are aborted, so
        the next step starts clean) with a 500 that names it."""
        try:
            return self.llm.llm_engine.step()
        except Exception as e:
            raise self._cleared(e) from None

    def cancel(self, ids: Sequence[str]) -> None:
        """Drop these prompts from the engine, whether they wait or run."""
        if ids:
            self.llm.llm_engine.abort_request(list(ids))

    def result(
        self,
        req: SampleRequest,
        outs: list[Any],
        step: int,
        seconds: float,
        newest_slot: bool = False,
    ) -> SampleResult:
        """``req``'s answer from vLLM's outputs, one per prompt in order. Each token's step is
        read from the engine's labels for a base request and one on an adapter's newest slot
        (``newest_slot``), whose version may change while it runs."""
        labelled = req.adapter is None or newest_slot
        return SampleResult(
            samples=[prompt_samples(o, req, step, labelled) for o in outs],
            step=step,
            adapter=req.adapter,
            sampler=self.index,
            seconds=seconds,
        )
