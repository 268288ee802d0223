"""One rank's engine shard: the megatron-core model, forward/backward and the optimizer step.

Assumes ``torch.distributed`` is initialised (the rank actor does that). Builds megatron's
parallel state for the configured layout, reads the process groups from it *once*, and passes
them down to the math in ``workers/ops`` explicitly.

Loss scaling (docs/algorithms.md §1.5): each micro-batch's loss on this rank is
``sum(term * loss_scale)`` over its own tokens, the scale carrying the global normaliser. megatron's
schedule leaves it alone (``calculate_per_token_loss``) and DDP sums gradients over DP x CP,
so the gradient is that of the global token mean, whatever the layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import Tensor

from trainctl.workers.control.batch import LossSpec, PackedMicroBatch
from trainctl.workers.engine import hf, megatron_cpu, weights
from trainctl.workers.engine.config import EngineConfig
from trainctl.workers.engine.inputs import RankMicroBatch, StageInputs
from trainctl.workers.engine.model import build_gpt, build_optimizer, transformer_config, wrap_ddp
from trainctl.workers.engine.profiling import MemoryProfiler, RankCoords
from trainctl.workers.engine.routing import RoutingStats
from trainctl.workers.ops.cp import gather_from_cp
from trainctl.workers.ops.logprob import vocab_parallel_entropy, vocab_parallel_logprob
from trainctl.workers.ops.loss import connected_zero, local_loss, per_token_terms
from trainctl.workers.ops.pp_broadcast import StageRole

log = logging.getLogger(__name__)

_CLIP_EPS = 1e-6  # keeps the clip coefficient finite when the gradient norm is ~0


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """What one rank reports for a step; the controller merges reports of all ranks."""

    coords: RankCoords
    is_last_stage: bool
    loss: float
    """Global token-mean loss (already reduced over DP x CP); meaningful on the last stage."""
    grad_norm: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


class EngineShard:
    """This rank's share of the model and the training step."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg.validate()
        lay = cfg.layout
        if dist.get_world_size() != lay.world_size:
            raise ValueError(
                f"layout {lay.describe()} needs {lay.world_size} ranks, "
                f"the process group has {dist.get_world_size()}"
            )
        megatron_cpu.install()
        mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=lay.tp,
            pipeline_model_parallel_size=lay.pp,
            virtual_pipeline_model_parallel_size=lay.vp if lay.vp > 1 else None,
            context_parallel_size=lay.cp,
            expert_model_parallel_size=lay.ep,
            distributed_timeout_minutes=max(1, int(cfg.collective_timeout_s // 60)),
        )
        # Process groups and coordinates, read from megatron's global state here and only here.
        self.tp_group = mpu.get_tensor_model_parallel_group()
        self.dp_cp_group = mpu.get_data_parallel_group(with_context_parallel=True)
        self.cp_group = mpu.get_context_parallel_group()
        self.pp_group = mpu.get_pipeline_model_parallel_group()
        self.mp_group = mpu.get_model_parallel_group()
        self.coords = RankCoords(
            rank=dist.get_rank(),
            dp=mpu.get_data_parallel_rank(),
            cp=mpu.get_context_parallel_rank(),
            tp=mpu.get_tensor_model_parallel_rank(),
            pp=mpu.get_pipeline_model_parallel_rank(),
            ep=mpu.get_expert_model_parallel_rank(),
        )
        self.is_last_stage = mpu.is_pipeline_last_stage(ignore_virtual=True)
        self.vocab_start = self.coords.tp * (cfg.model.vocab_size // lay.tp)

        megatron_cpu.seed_model_parallel_rng(
            cfg.model.seed,
            tp_rank=self.coords.tp,
            ep_rank=self.coords.ep,
            etp_rank=mpu.get_expert_tensor_parallel_rank(),
        )
        self.inputs = StageInputs(
            role=StageRole.of(self.coords.pp, lay.pp),
            cp_size=lay.cp,
            cp_rank=self.coords.cp,
            tp_group=self.tp_group,
            tp_src=mpu.get_tensor_model_parallel_src_rank(),
        )
        self.local_experts = cfg.model.num_experts // lay.ep
        self.expert_dp_rank = mpu.get_expert_data_parallel_rank()
        self.tc = transformer_config(cfg)
        self._grad_sync_s = 0.0
        self._pending_norm: float | None = None
        source = weights.seeded(cfg.model.seed, cfg.model.num_layers)
        if cfg.init_hf:
            source = weights.from_dict(hf.load(Path(cfg.init_hf), cfg.model))
            log.info("rank %d: starting weights from %s", self.coords.rank, cfg.init_hf)
        self.chunks = []
        for vp_stage in range(lay.vp):
            vp = vp_stage if lay.vp > 1 else None
            model = build_gpt(
                cfg,
                self.tc,
                pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                vp_stage=vp,
            )
            self._assign(model, source)
            self.chunks.append(wrap_ddp(self.tc, model))
        # Hooks into this engine go on the config only after the model is built: MoE layers
        # deep-copy the config, and must not copy the engine along with it.
        self.tc.finalize_model_grads_func = self._finalize_grads
        self.tc.no_sync_func = [c.no_sync for c in self.chunks]
        if len(self.chunks) == 1:
            self.tc.no_sync_func = self.chunks[0].no_sync
        self.optimizer = build_optimizer(cfg, self.chunks)
        self.routing = RoutingStats(
            self.chunks, num_layers=cfg.model.num_layers, num_experts=cfg.model.num_experts
        )
        self.profiler = MemoryProfiler(self.coords)
        self.step = 0
        log.info("rank %s built %s", self.coords, self.num_parameters())

    # -- helpers -------------------------------------------------------------------------

    def _finalize_grads(self, models: list[Any], num_tokens: Any, **kwargs: Any) -> None:
        # The loss is pre-normalised by the global token count: never rescale by num_tokens.
        t0 = time.perf_counter()
        with megatron_cpu.cuda_to_cpu():
            finalize_model_grads(models, None, **kwargs)
        self._grad_sync_s += time.perf_counter() - t0

    def _assign(self, module: Any, source: weights.FullTensor) -> None:
        weights.assign(
            module,
            source,
            tp_rank=self.coords.tp,
            tp=self.cfg.layout.tp,
            ep_rank=self.coords.ep,
            local_experts=self.local_experts,
        )

    def num_parameters(self) -> int:
        return sum(p.numel() for c in self.chunks for p in c.parameters())

    def _loss_func(
        self, mb: RankMicroBatch, spec: LossSpec, collect: bool, logits: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """``logits [1, t, V_t]`` (this rank's CP shard, its vocab slice) -> (loss, local token
        count, metrics) for megatron's schedule. Never gathers logits over CP or TP."""
        b = mb.batch
        if collect:
            self._collect(mb, logits)
            zero = logits.new_zeros(())
            return zero, torch.tensor(0, dtype=torch.int), {"loss": zero}
        if mb.is_dummy:
            loss = connected_zero(logits)
            n = 0
        else:
            assert b.loss_mask is not None
            lp = self._logprob(mb, logits)
            inputs = {k: v[0] for k, v in b.loss_inputs.items()}
            terms = per_token_terms(
                lp,
                **spec.options(),
                loss_mask=b.loss_mask[0],
                advantages=inputs.get("advantages"),
                old_logprobs=inputs.get("old_logprobs"),
                ref_logprobs=inputs.get("ref_logprobs"),
            )
            loss = local_loss(terms, b.loss_inputs["loss_scale"][0])
            n = int(torch.count_nonzero(b.loss_mask))
        return loss, torch.tensor(n, dtype=torch.int), {"loss": loss.detach().clone()}

    def _logprob(self, mb: RankMicroBatch, logits: Tensor) -> Tensor:
        """Per-token log p(label) of this rank's CP shard, from its vocab slice."""
        assert mb.batch.labels is not None
        return vocab_parallel_logprob(
            logits[0],
            mb.batch.labels[0],
            vocab_start=self.vocab_start,
            tp_group=self.tp_group,
            chunk_size=self.cfg.logprob_chunk_size,
        )

    def _forward_step(
        self, spec: LossSpec, collect: bool, data: Iterator[RankMicroBatch], model: Any
    ) -> tuple[Tensor, Any]:
        mb = next(data)
        self.routing.counting = not mb.is_dummy
        logits = model(
            mb.batch.tokens,
            mb.batch.position_ids,
            attention_mask=None,
            packed_seq_params=mb.packed,
        )
        return logits, partial(self._loss_func, mb, spec, collect)

    def _run_schedule(
        self,
        mbs: Sequence[PackedMicroBatch],
        spec: LossSpec,
        *,
        forward_only: bool,
        collect: bool = False,
    ) -> float:
        """megatron's forward/backward schedule over this rank's micro-batches.

        Returns the global loss, reduced over DP x CP (0.0 off the last stage).
        """
        tensors = [self.inputs.prepare(mb) for mb in mbs]
        iters: Any = [iter(tensors) for _ in self.chunks] if len(self.chunks) > 1 else iter(tensors)
        for c in self.chunks:
            c.train(not forward_only)
        with megatron_cpu.cuda_to_cpu():
            out = get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, spec, collect),
                data_iterator=iters,
                model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                num_microbatches=len(tensors),
                seq_length=max(mb.num_tokens for mb in mbs),  # global: megatron divides by cp
                micro_batch_size=1,
                forward_only=forward_only,
            )
        self.routing.counting = False
        local = torch.zeros((), dtype=torch.float64)
        for item in out or []:
            local += item["loss"].double()
        if self.is_last_stage:
            dist.all_reduce(local, group=self.dp_cp_group)
        return float(local)

    # -- the RPC surface -------------------------------------------------------------------

    def forward_backward(self, mbs: Sequence[PackedMicroBatch], spec: LossSpec) -> float:
        """Accumulate gradients of the step's loss (synchronised over DP x CP)."""
        return self._run_schedule(mbs, spec, forward_only=False)

    def optimizer_step(self, grad_norm: float | None = None) -> float:
        """Clip by global norm, apply AdamW, zero the gradients; returns the pre-clip norm
        (computed here unless given: computing it is a collective)."""
        with megatron_cpu.cuda_to_cpu():
            self.optimizer.prepare_grads()
            if grad_norm is None:
                grad_norm = self.grad_norm()
            clip = self.cfg.optimizer.clip_grad
            if clip > 0 and grad_norm > clip:
                coeff = clip / (grad_norm + _CLIP_EPS)
                for group in self.optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(coeff)
            self.optimizer.step_with_ready_grads()
        self.zero_grad()
        self.step += 1
        return grad_norm

    def grad_norm(self) -> float:
        """L2 norm of the full model's gradient: every canonical parameter counted once.

        TP-replicated parameters (norms) count on TP rank 0 only; the sum of squares is then
        all-reduced over the model-parallel group (TP x PP). DP x CP replicas already hold the
        synchronised gradient.
        """
        dense = torch.zeros((), dtype=torch.float64)
        experts = torch.zeros((), dtype=torch.float64)
        for c in self.chunks:
            for name, p in c.module.named_parameters():
                if ".local_experts." in name:
                    experts += p.main_grad.double().pow(2).sum()
                elif self.coords.tp == 0 or weights.shard_rule(name).kind != "replicated":
                    dense += p.main_grad.double().pow(2).sum()
        # Each EP rank holds different experts: their squares add up over the EP group too.
        if self.cfg.layout.ep > 1:
            dist.all_reduce(experts, group=mpu.get_expert_model_parallel_group())
        sq = dense + experts
        dist.all_reduce(sq, group=self.mp_group)
        return float(sq.sqrt())

    def zero_grad(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()

    def accumulate(self, mbs: Sequence[PackedMicroBatch], spec: LossSpec) -> StepReport:
        """Phase 1 of a step: forward/backward and the global gradient norm; nothing applied.

        Every collective of the step happens here, so phase 2 (``apply``) is local arithmetic
        that cannot leave ranks out of step. On failure the gradients are dropped.
        """
        t0 = time.perf_counter()
        self._grad_sync_s = 0.0
        try:
            loss = self.forward_backward(mbs, spec)
            with megatron_cpu.cuda_to_cpu():
                self._pending_norm = self.grad_norm()
        except BaseException:
            self.zero_grad()
            raise
        return StepReport(
            coords=self.coords,
            is_last_stage=self.is_last_stage,
            loss=loss,
            grad_norm=self._pending_norm,
            metrics=self.routing.export(),
            timings={
                "forward_backward_s": time.perf_counter() - t0,
                "grad_sync_s": self._grad_sync_s,
            },
        )

    def apply(self) -> tuple[float, float]:
        """Phase 2: the optimizer step on the accumulated gradients; ``(grad_norm, seconds)``."""
        t0 = time.perf_counter()
        grad_norm = self.optimizer_step(self._pending_norm)
        return grad_norm, time.perf_counter() - t0

    def train_batch(self, mbs: Sequence[PackedMicroBatch], spec: LossSpec) -> StepReport:
        """Both phases in one call (tests, benchmarks and the single-process reference)."""
        report = self.accumulate(mbs, spec)
        _, optimizer_s = self.apply()
        return dataclasses.replace(report, timings={**report.timings, "optimizer_s": optimizer_s})

    @torch.no_grad()
    def eval_batch(self, mbs: Sequence[PackedMicroBatch], spec: LossSpec) -> StepReport:
        t0 = time.perf_counter()
        loss = self._run_schedule(mbs, spec, forward_only=True)
        return StepReport(
            coords=self.coords,
            is_last_stage=self.is_last_stage,
            loss=loss,
            metrics=self.routing.export(),
            timings={"forward_s": time.perf_counter() - t0},
        )

    @torch.no_grad()
    def logprobs(
        self, mbs: Sequence[PackedMicroBatch], *, entropy: bool = False
    ) -> dict[int, tuple[np.ndarray, np.ndarray | None]]:
        """Per-token log-probs (and entropy) of every real sequence in ``mbs``, by request index.

        Each value is aligned with the sequence's tokens: ``[t]`` is ``log p(tokens[t] |
        tokens[:t])``, ``[0]`` is 0. Computed CP-locally like the loss; only the per-token
        results (not logits) are gathered over CP. Reported by TP rank 0, CP rank 0 of the last
        stage; every other rank returns ``{}``.
        """
        self._collected: list[tuple[Tensor, Tensor | None]] = []
        self._collect_entropy = entropy
        self._run_schedule(mbs, LossSpec(), forward_only=True, collect=True)
        collected, self._collected = self._collected, []
        if not (self.is_last_stage and self.coords.tp == 0 and self.coords.cp == 0):
            return {}
        out: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
        for mb, (lp, ent) in zip(mbs, collected, strict=True):
            for b, idx in enumerate(mb.seq_index.tolist()):
                if idx < 0:
                    continue
                start, n = int(mb.cu_seqlens[b]), int(mb.seq_lens[b])
                # Position t predicts token t + 1 (labels are rolled): shift right by one.
                seq_lp = np.zeros(n, np.float32)
                seq_lp[1:] = lp[start : start + n - 1].numpy()
                seq_ent = None
                if ent is not None:
                    seq_ent = np.zeros(n, np.float32)
                    seq_ent[1:] = ent[start : start + n - 1].numpy()
                out[idx] = (seq_lp, seq_ent)
        return out

    def _collect(self, mb: RankMicroBatch, logits: Tensor) -> None:
        """Loss-function side channel of ``logprobs``: this micro-batch's values, CP-gathered."""
        b = mb.batch
        assert b.cu_seqlens is not None
        lp = self._logprob(mb, logits)
        ent = None
        if self._collect_entropy:
            ent = vocab_parallel_entropy(
                logits[0], tp_group=self.tp_group, chunk_size=self.cfg.logprob_chunk_size
            )
            ent = gather_from_cp(ent, b.cu_seqlens, self.cp_group)
        self._collected.append((gather_from_cp(lp, b.cu_seqlens, self.cp_group), ent))

    def weights_digest(self) -> str:
        """sha256 over this rank's parameters (name order): equal digests, equal weights."""
        h = hashlib.sha256()
        for c in self.chunks:
            for name, p in c.module.named_parameters():
                h.update(name.encode())
                h.update(p.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    def canonical_shards(self, *, grads: bool = False) -> dict[str, Tensor]:
        """This rank's parameter (or gradient) shards by canonical name (``workers/weights``).

        ``weights.shard_rule(name).unshard`` of the shards of TP ranks 0..tp-1 gives the full
        tensor; across pipeline stages the names are disjoint.
        """
        out = {}
        for c in self.chunks:
            names = weights.canonical_names(
                c.module, ep_rank=self.coords.ep, local_experts=self.local_experts
            )
            for name, p in c.module.named_parameters():
                t = p.main_grad if grads else p
                out[names[name]] = t.detach().clone()
        return out

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything this rank needs to resume: weights, optimizer state, step, RNG."""
        return {
            "chunks": [c.module.state_dict() for c in self.chunks],
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "rng": torch.get_rng_state(),
            "coords": dataclasses.asdict(self.coords),
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Inverse of ``checkpoint_state`` (same layout: the coordinates must match)."""
        if state["coords"] != dataclasses.asdict(self.coords):
            raise ValueError(
                f"checkpoint shard of {state['coords']} loaded on rank {self.coords}: "
                "a checkpoint loads into the layout it was saved from"
            )
        with torch.no_grad():
            for c, sd in zip(self.chunks, state["chunks"], strict=True):
                c.module.load_state_dict(sd)
        self.optimizer.load_state_dict(state["optimizer"])
        self.zero_grad()
        torch.set_rng_state(state["rng"])
        self.step = int(state["step"])
