"""One rank's engine shard: the megatron-core model, forward/backward and the optimizer step.

Assumes ``torch.distributed`` is initialised (the rank actor does that). Builds megatron's
parallel state for the configured layout and reads the process groups from it *once*
(``ParallelDims``), then passes them down explicitly: to the schedule
(``workers/engine/schedule.py``) and the math in ``workers/ops``.

Loss scaling (docs/algorithms.md §1.5): each micro-batch's loss on this rank is
``sum(term * loss_scale)`` over its own tokens, the scale carrying the global normaliser. megatron's
schedule leaves it alone (``calculate_per_token_loss``) and DDP sums gradients over DP x CP,
so the gradient is that of the global token mean, whatever the layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from megatron.core.distributed import finalize_model_grads
from torch import Tensor, nn

from trainctl.api.models import LossConfig
from trainctl.workers import spans
from trainctl.workers.engine import lora, megatron_cpu, megatron_fixes, weights, zero
from trainctl.workers.engine.accumulation import Accumulation
from trainctl.workers.engine.adapter_bank import AdapterBank, ShardAdapters
from trainctl.workers.engine.adapter_store import SpillStore
from trainctl.workers.engine.boundary import (
    Applied,
    LogProbsPart,
    PackedMicroBatch,
    PartResult,
    PerSequence,
    StepReport,
)
from trainctl.workers.engine.checkpoint import ShardCheckpoint
from trainctl.workers.engine.config import EngineConfig, OptimizerConfig
from trainctl.workers.engine.hf_read import starting_weights
from trainctl.workers.engine.inputs import StageInputs
from trainctl.workers.engine.model import (
    build_gpt,
    build_optimizer,
    drop_forward_state,
    lm_head_weight,
    transformer_config,
    wrap_ddp,
)
from trainctl.workers.engine.optimizer import ShardOptimizer
from trainctl.workers.engine.parallel import ParallelDims, ShardContext
from trainctl.workers.engine.profiling import MemoryProfiler
from trainctl.workers.engine.replay import RouteReplay, route_shards
from trainctl.workers.engine.routing import RoutingStats
from trainctl.workers.engine.schedule import PassResult, Schedule, per_sequence

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")


class EngineShard:
    """Owns this rank's share of the model (its megatron-core chunks, process groups and
    inputs) and runs its passes (``train_pass``, the split step's parts, ``eval_batch``,
    ``logprobs``); its collaborators own the rest: ``optim`` the optimizer state and step,
    ``checkpoint`` the on-disk format, ``adapters`` the adapter calls, ``profiler`` memory
    profiles."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg.validate()
        lay = cfg.layout
        megatron_cpu.install()
        megatron_fixes.install()
        self.dims = ParallelDims.build(lay, timeout_s=cfg.collective_timeout_s)
        self.coords = self.dims.coords
        self.is_last_stage = self.dims.is_last_stage
        megatron_cpu.seed_model_parallel_rng(
            cfg.model.seed,
            tp_rank=self.coords.tp,
            ep_rank=self.coords.ep,
            etp_rank=self.dims.expert_tp_rank,
        )
        self.local_experts = cfg.model.num_experts // lay.ep
        self.zero = cfg.use_distributed_optimizer
        cuda = torch.cuda.is_available()
        # On CUDA this rank's GPU is the current device (Ray gives each rank actor one GPU, and
        # the in-process engine takes device 0); megatron-core builds on the CPU either way
        # and the model moves there once its weights are assigned.
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else _CPU
        bf16 = cfg.resolved_precision(cuda=cuda) == "bf16"
        self.tc = transformer_config(cfg, bf16=bf16, cuda=cuda)
        self._grad_sync_s = 0.0
        self._pending_norm: Tensor | None = None
        self.chunks = []
        sites: list[lora.Site] = []
        with starting_weights(cfg, self.coords.rank) as source:
            for vp_stage, (first, last) in enumerate(self.dims.stages):
                model = build_gpt(
                    cfg,
                    self.tc,
                    pre_process=first,
                    post_process=last,
                    vp_stage=vp_stage if lay.vp > 1 else None,
                    compiled_norms=cfg.resolved_norm_kernel(cuda=cuda) == "compiled",
                )
                if cfg.lora.enabled:
                    sites += self._attach_lora(model, last)
                self._assign(model, source)
                model.to(self.device)
                # The rotary frequencies are a plain attribute (no buffer): on the device too,
                # so each micro-batch's tables are made there with no host round trip.
                model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq.to(self.device)
                self.chunks.append(wrap_ddp(self.tc, model, distributed_optimizer=self.zero))
        # Hooks into this engine go on the config only after the model is built: MoE layers
        # deep-copy the config, and must not copy the engine along with it.
        self.tc.finalize_model_grads_func = self._finalize_grads
        self.tc.no_sync_func = [c.no_sync for c in self.chunks]
        if len(self.chunks) == 1:
            self.tc.no_sync_func = self.chunks[0].no_sync
        optimizer = build_optimizer(cfg, self.chunks, bf16=bf16)
        self.window = Accumulation(self.chunks)
        bank: AdapterBank | None = None
        if cfg.lora.enabled:
            bank = AdapterBank(
                sites=sites,
                params={n: p for n, p in self._canonical_parameters() if lora.is_lora(n)},
                optimizer=optimizer,
                zero_optimizer=self.zero,
                max_adapters=cfg.lora.max_adapters,
                max_rank=cfg.lora.max_rank,
                tp_rank=self.coords.tp,
                tp=lay.tp,
                window=self.window,
                store=SpillStore.for_rank(cfg.lora, self.coords.rank),
            )
        self.adapters = ShardAdapters(bank)
        ctx = ShardContext(cfg=self.cfg, dims=self.dims, chunks=self.chunks)
        self.optim = ShardOptimizer(
            ctx, optimizer=optimizer, window=self.window, device=self.device,
            trainable=self._trainable, adapters=bank,
        )  # fmt: skip
        self.checkpoint = ShardCheckpoint(ctx, optim=self.optim, adapters=bank)
        self.routing = RoutingStats(
            self.chunks, num_layers=cfg.model.num_layers, num_experts=cfg.model.num_experts
        )
        self.schedule = Schedule(
            chunks=self.chunks,
            dims=self.dims,
            inputs=StageInputs(self.dims, device=self.device),
            routing=self.routing,
            vocab_size=cfg.model.vocab_size,
            logprob_chunk_size=cfg.resolved_chunk_size(cuda=self.device.type == "cuda"),
            fused_lm_head=cfg.fused_lm_head,
            sequence_parallel=cfg.use_sequence_parallel,
            replay=RouteReplay(self.chunks) if cfg.model.num_experts else None,
        )
        self.profiler = MemoryProfiler(self.coords)
        log.info("rank %s built %s", self.coords, self.num_parameters())

    def close(self) -> None:
        """Drop the model and the optimizer; the shard is unusable afterwards.

        Two reference cycles run through objects held by C++, which Python's collector cannot
        see through, so a dropped shard would keep its memory and its process groups' threads
        alive until the process exits: megatron's distributed optimizer under ZeRO, and an MoE
        token dispatcher's tensors of the last forward, whose autograd graph reaches the
        parameters and DDP's gradient hooks (``drop_forward_state``). A process that builds
        shards more than once (the test rank pools) closes each one.
        """
        drop_forward_state(self.chunks)
        self.optim.optimizer = None
        self.chunks = []
        with contextlib.suppress(AttributeError):  # closed before: closing again is a no-op
            del self.schedule

    @property
    def step(self) -> int:
        """Optimizer steps applied to the base (``optim.step``)."""
        return self.optim.step

    # -- helpers -------------------------------------------------------------------------

    def _finalize_grads(self, models: list[Any], num_tokens: Any, **kwargs: Any) -> None:
        # The loss is pre-normalised by the global token count: never rescale by num_tokens.
        if self.window.deferring:
            return  # a forward_backward part: reduced once, at optim_step (accumulation.py)
        with spans.timed("grad_sync") as t, megatron_cpu.cuda_to_cpu():
            self.schedule.finalize_started = t.start_s
            finalize_model_grads(models, None, **kwargs)
        self._grad_sync_s += t.seconds

    def _attach_lora(self, model: Any, last_stage: bool) -> list[lora.Site]:
        """LoRA sites on ``model``, then the base frozen: only adapters get gradients, DDP
        buffers and optimizer state (``workers/engine/lora.py``)."""
        head = tuple(lm_head_weight(model).shape) if last_stage else None
        sites = lora.attach(
            model,
            max_rank=self.cfg.lora.max_rank,
            tp_group=self.dims.tp_group if self.cfg.layout.tp > 1 else None,
            sequence_parallel=self.cfg.use_sequence_parallel,
            head_weight_shape=head,
        )
        for name, p in model.named_parameters():
            p.requires_grad_(lora.is_lora(name))
        return sites

    def _assign(self, module: Any, source: weights.ShardOf) -> None:
        empty = weights.of_full(lambda _, shape: torch.zeros(shape))

        def base_or_zero(name: str, shape: tuple[int, ...], rank: int, size: int) -> Tensor:
            # LoRA sites start empty: an adapter's tensors come in when it is activated.
            return (empty if lora.is_lora(name) else source)(name, shape, rank, size)

        weights.assign(
            module,
            base_or_zero,
            tp_rank=self.coords.tp,
            tp=self.cfg.layout.tp,
            ep_rank=self.coords.ep,
            local_experts=self.local_experts,
        )

    def num_parameters(self) -> int:
        return sum(p.numel() for _, p in self._parameters())

    def _parameters(self) -> list[tuple[str, Any]]:
        """This rank's parameters by local name, each counted once: without the last stage's
        copy of tied embeddings (the first stage holds the same tensor)."""
        return [
            (n, p)
            for c in self.chunks
            for n, p in c.module.named_parameters()
            if not weights.is_tied_copy(p)
        ]

    def _trainable(self) -> list[tuple[str, Any]]:
        """The parameters that get gradients: all of them, or the LoRA sites' on a frozen
        base."""
        return [(n, p) for n, p in self._parameters() if p.requires_grad]

    def _canonical_parameters(self) -> list[tuple[str, Any]]:
        """Every parameter by canonical name (tied copies included, under the embedding's)."""
        out = []
        for c in self.chunks:
            names = weights.canonical_names(
                c.module, ep_rank=self.coords.ep, local_experts=self.local_experts
            )
            out += [(names[n], p) for n, p in c.module.named_parameters()]
        return out

    # -- the RPC surface -------------------------------------------------------------------

    def train_pass(self, mbs: Sequence[PackedMicroBatch], loss: LossConfig) -> PassResult:
        """Forward and backward over this rank's micro-batches: gradients accumulate and are
        synchronised over DP x CP; the pass's loss and RL metrics."""
        return self.schedule.run(mbs, loss, forward_only=False)

    # -- the split step (docs/algorithms.md §11) ----------------------------------------------

    def forward_backward(
        self, mbs: Sequence[PackedMicroBatch], loss: LossConfig, *, backward: bool = True
    ) -> PartResult:
        """One ``forward_backward``: this part's gradients added to the window's local sum
        (not reduced over DP x CP: ``finish_window`` does that once), its loss (the global
        sum of its scaled terms) and, per sequence, the per-token log-probs and loss shares
        (reporting ranks only). On failure the sum is as before the call. Without
        ``backward`` (Tinker's ``forward``) the same numbers, and the window is untouched."""
        with spans.timed("forward_backward" if backward else "forward_only") as t:
            result = self._part(mbs, loss, backward)
        per_seq: PerSequence = {}
        if self.dims.reports_logprobs():
            lps = per_sequence(mbs, [o["logprobs"] for o in result.outputs])
            losses = per_sequence(mbs, [o["token_loss"] for o in result.outputs])
            per_seq = {i: (lp, losses[i]) for i, lp in lps.items()}
        report = StepReport(
            coords=self.coords,
            is_last_stage=self.is_last_stage,
            loss=result.loss,
            metrics={**self.routing.export(), **result.metrics},
            timings={"forward_backward_s": t.seconds},  # the span's length
        )
        return PartResult(report=report, per_sequence=per_seq)

    def _part(
        self, mbs: Sequence[PackedMicroBatch], loss: LossConfig, backward: bool
    ) -> PassResult:
        outputs = ("logprobs", "token_loss")
        if not backward:
            with torch.no_grad():
                return self.schedule.run(mbs, loss, forward_only=True, outputs=outputs)
        self.adapters.check_trainable()
        self.window.begin_part()
        try:
            result = self.schedule.run(mbs, loss, forward_only=False, outputs=outputs)
        except BaseException:
            self.window.rollback()
            raise
        self.window.end_part()
        return result

    def rollback_part(self) -> None:
        """Undo the last ``forward_backward`` part (another rank failed it)."""
        self.window.rollback()

    def finish_window(self, divisor: float) -> float:
        """``optim_step``'s phase 1: the window's one DP x CP reduction, divided by its
        normaliser, then the global grad norm (what ``apply`` uses). Collectives only; on
        failure the window's gradients are dropped."""
        try:
            self.window.finish(divisor)
            with megatron_cpu.cuda_to_cpu():
                self._pending_norm = self.optim.grad_norm()
        except BaseException:
            self.optim.zero_grad()
            raise
        # The controller checks it before phase 2: the one read between the phases.
        return float(self._pending_norm)

    def accumulate(self, mbs: Sequence[PackedMicroBatch], loss: LossConfig) -> StepReport:
        """Phase 1 of a step: forward/backward and the global gradient norm; nothing applied.

        Every collective of the step happens here, so phase 2 (``apply``) is local arithmetic
        that cannot leave ranks out of step. On failure the gradients are dropped.
        """
        self._grad_sync_s = 0.0
        self.adapters.check_trainable()
        with spans.timed("forward_backward") as fb:  # its timing below is this span's length
            try:
                result = self.train_pass(mbs, loss)
                with spans.timed("grad_norm"), megatron_cpu.cuda_to_cpu():
                    self._pending_norm = self.optim.grad_norm()
            except BaseException:
                self.optim.zero_grad()
                raise
        return StepReport(
            coords=self.coords,
            is_last_stage=self.is_last_stage,
            loss=result.loss,
            # The controller checks it before phase 2: the one read between the phases.
            grad_norm=float(self._pending_norm),
            metrics={**self.routing.export(), **result.metrics},
            timings={"forward_backward_s": fb.seconds, "grad_sync_s": self._grad_sync_s},
        )

    def apply(self, hyper: OptimizerConfig | None = None) -> Applied:
        """Phase 2: the optimizer update of what this rank owns, from the accumulated gradients
        and phase 1's norm. Local: no collective. ``hyper``: this step's AdamW settings
        (``optim_step``), else the engine config's."""
        with spans.timed("optimizer") as t:  # ``seconds`` is this span's length
            grad_norm = self.optim.update_local(self._pending_norm, hyper)
        return Applied(grad_norm=grad_norm, seconds=t.seconds)

    def train_batch(self, mbs: Sequence[PackedMicroBatch], loss: LossConfig) -> StepReport:
        """Both phases in one call (tests, benchmarks and the single-process reference)."""
        report = self.accumulate(mbs, loss)
        applied = self.apply()
        self.optim.publish()
        timings = {**report.timings, "optimizer_s": applied.seconds}
        return dataclasses.replace(report, timings=timings)

    @torch.no_grad()
    def eval_batch(self, mbs: Sequence[PackedMicroBatch], loss: LossConfig) -> StepReport:
        t0 = time.perf_counter()
        result = self.schedule.run(mbs, loss, forward_only=True)
        return StepReport(
            coords=self.coords,
            is_last_stage=self.is_last_stage,
            loss=result.loss,
            metrics={**self.routing.export(), **result.metrics},
            timings={"forward_s": time.perf_counter() - t0},
        )

    @torch.no_grad()
    def logprobs(
        self, mbs: Sequence[PackedMicroBatch], *, entropy: bool = False, routes: bool = False
    ) -> LogProbsPart:
        """Per-token log-probs (and entropy) of every real sequence in ``mbs``, by request index:
        ``[t]`` is ``log p(tokens[t] | tokens[:t])``, ``[0]`` is 0. CP-local like the loss, only
        the per-token values gathered; from TP rank 0, CP rank 0 of the last stage. ``routes``
        (MoE): also the experts this rank's routers chose (``replay.route_shards``), from TP
        rank 0, or every TP rank under sequence parallelism (each routes its own tokens)."""
        outputs = ("logprobs", "entropy") if entropy else ("logprobs",)
        result = self.schedule.run(
            mbs, LossConfig(), forward_only=True, outputs=outputs, routes=routes
        )
        mine = routes and (self.coords.tp == 0 or self.cfg.use_sequence_parallel)
        shards = route_shards(list(mbs), result.router_rows, result.routes) if mine else {}
        if not self.dims.reports_logprobs():
            return LogProbsPart(per_sequence={}, routes=shards)
        lps = per_sequence(mbs, [o["logprobs"] for o in result.outputs])
        ents = per_sequence(mbs, [o["entropy"] for o in result.outputs]) if entropy else {}
        per_seq = {i: (lp, ents.get(i)) for i, lp in lps.items()}
        return LogProbsPart(per_sequence=per_seq, routes=shards)

    def weights_digest(self) -> str:
        """sha256 over this rank's parameters (name order): equal digests, equal weights. With
        adapters, the base's alone (``adapter_digest`` for an adapter's)."""
        return weights.digest(self.base_parameters())

    def base_parameters(self) -> list[tuple[str, Tensor]]:
        """The parameters ``weights_digest`` hashes, in its order (live tensors)."""
        return [(n, p) for n, p in self._parameters() if not lora.is_lora(n)]

    def canonical_shards(self, *, grads: bool = False, owned: bool = False) -> dict[str, Tensor]:
        """This rank's parameter (or gradient) shards by canonical name
        (``workers/engine/weights.py``).

        ``weights.shard_rule(name).unshard`` of the shards of TP ranks 0..tp-1 gives the full
        tensor; across pipeline stages the names are disjoint (a tied embedding comes from the
        first stage). ``owned``: only what this rank adds to one full copy of the model - dense
        tensors from DP x CP replica 0, experts from expert-data-parallel replica 0 (each EP
        rank holds other experts). Gradients under ZeRO are all-gathered first (a collective
        over DP x CP): each rank holds only its slice of them summed.
        """
        if grads and self.zero:
            with megatron_cpu.cuda_to_cpu():
                zero.gather_grads(self.chunks)
        return {
            name: (getattr(p, "main_grad") if grads else p).detach().clone()
            for name, p in self.named_canonical(owned=owned)
            if not (grads and not p.requires_grad)
        }

    def named_canonical(self, *, owned: bool = False) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters by canonical name, as they are (no copy); a tied
        embedding's copy on the last stage left out. ``owned``: only replica 0's
        (``canonical_shards``)."""
        for c in self.chunks:
            names = weights.canonical_names(
                c.module, ep_rank=self.coords.ep, local_experts=self.local_experts
            )
            for name, p in c.module.named_parameters():
                if weights.is_tied_copy(p) or (owned and not self.dims.holds_replica0(name)):
                    continue
                yield names[name], p
