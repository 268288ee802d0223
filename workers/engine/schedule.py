"""One pass of megatron's forward(/backward) schedule over this rank's micro-batches.

The model ends at its final norm (``workers/engine/model.py``): the loss function megatron
calls per micro-batch gets this rank's hidden states ``[1, t, H]`` (its CP shard) and applies
the output layer's vocabulary slice ``[V / tp, H]`` itself, fused with the vocab-parallel
log-prob kernel so logits exist one chunk of tokens at a time (``workers/ops/fused_head.py``;
``fused_lm_head=False``: all logits, then the streamed kernel, the same values). Logits are
never gathered over TP or CP. From the per-token log-probs it computes the loss terms and this
micro-batch's loss share
``sum(term * loss_scale)`` (docs/algorithms.md §1.5). Asked for them, it also returns the
per-token log-probs (and entropy), gathered over CP only as per-token values, through its
output, so one pass can give both the loss and the log-probs.

The shares of every micro-batch and every DP x CP rank add up to the global loss:
``ops.aggregate.aggregate_loss``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from torch import Tensor

from trainctl.api.models import LossConfig
from trainctl.workers import spans
from trainctl.workers.engine import megatron_cpu
from trainctl.workers.engine.attention import rope_tables
from trainctl.workers.engine.boundary import PackedMicroBatch
from trainctl.workers.engine.inputs import RankMicroBatch, StageInputs
from trainctl.workers.engine.loss_inputs import LossInputs, sequence_metric_keys
from trainctl.workers.engine.model import lm_head_weight
from trainctl.workers.engine.parallel import ParallelDims
from trainctl.workers.engine.replay import RouteReplay, given_routes, router_rows
from trainctl.workers.engine.routing import RoutingStats
from trainctl.workers.ops.aggregate import aggregate_loss
from trainctl.workers.ops.cp import gather_from_cp, gather_targets_from_cp
from trainctl.workers.ops.fused_head import (
    fused_head_entropy,
    fused_head_logprob,
    fused_head_loss,
    head_logits,
)
from trainctl.workers.ops.logprob import vocab_parallel_entropy, vocab_parallel_logprob
from trainctl.workers.ops.loss import connected_zero, local_loss, per_token_terms
from trainctl.workers.ops.metrics import Reduction, StatsTracker
from trainctl.workers.ops.rl_metrics import policy_metric_keys, record_policy_metrics

PER_TOKEN_OUTPUTS = ("logprobs", "entropy", "token_loss")
"""``token_loss``: each target's loss term times its scale, its share of the pass's loss."""


def gradient_in_forward(loss: LossConfig) -> bool:
    """Whether the LM head may take ``loss``'s gradient in its forward pass
    (``workers/ops/fused_head.py``, ``fused_head_loss``): only when a token's term reads that
    token's log-prob alone, not a whole sequence's (``LossSpec.sequence_ratio``)."""
    return not loss.spec.sequence_ratio


@dataclass(frozen=True)
class PassResult:
    loss: float
    """The global loss (summed over DP x CP); 0.0 off the last pipeline stage."""
    outputs: list[dict[str, Tensor]]
    """Last stage only, per micro-batch: the per-token outputs asked for, in global packed
    order ``[T]`` (position ``t`` predicts token ``t + 1``)."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """Last stage only: the RL metrics of a pass whose batch carries ``old_logprobs``
    (``workers/ops/rl_metrics.py``), reduced over DP x CP."""
    routes: dict[int, dict[int, Tensor]] = dataclasses.field(default_factory=dict)
    """Asked for routes (MoE): per micro-batch, the experts this rank's routers chose
    (``[tokens, top_k]`` by global layer index), for the rows ``router_rows`` names."""
    router_rows: list[Tensor] = dataclasses.field(default_factory=list)


@dataclass
class _Pass:
    """One pass's own state, handed to megatron's step functions (never kept on the
    ``Schedule``, which outlives its passes)."""

    loss: LossConfig
    outputs: tuple[str, ...]
    backward: bool = False
    """The pass runs backward: a separable loss may take the head's gradient in its forward."""
    stats: StatsTracker = dataclasses.field(default_factory=StatsTracker)
    policy_keys: list[tuple[str, Reduction]] = dataclasses.field(default_factory=list)
    given_routes: list[Tensor | None] = dataclasses.field(default_factory=list)
    """Per micro-batch: the routes its routers replay (``[rows here, layers, top_k]``)."""
    chosen: dict[int, dict[int, Tensor]] | None = None
    """Recording routes: per micro-batch, each local router's choice."""
    forwards: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    """Each micro-batch's forward (to its loss, on the last stage), in wall-clock seconds."""
    forward_start: float = 0.0


class Schedule:
    """Runs passes for one engine shard: its model chunks, groups and inputs. Owns no tensors: the
    chunks, groups and inputs are the shard's, lent to it."""

    def __init__(
        self,
        *,
        chunks: list[Any],
        dims: ParallelDims,
        inputs: StageInputs,
        routing: RoutingStats,
        vocab_size: int,
        logprob_chunk_size: int,
        fused_lm_head: bool = True,
        sequence_parallel: bool = False,
        replay: RouteReplay | None = None,
    ) -> None:
        self.chunks, self.dims, self.inputs, self.routing = chunks, dims, inputs, routing
        self.replay = replay if replay is not None and replay.enabled else None
        self.sequence_parallel = sequence_parallel
        self.vocab_start = dims.vocab_start(vocab_size)
        self.vocab_size = vocab_size
        self.chunk_size = logprob_chunk_size
        self.fused = fused_lm_head
        self.finalize_started: float | None = None
        """When this pass's gradient reduction began (the shard's finalize step sets it)."""

    def run(
        self,
        mbs: Sequence[PackedMicroBatch],
        loss: LossConfig,
        *,
        forward_only: bool,
        outputs: tuple[str, ...] = (),
        routes: bool = False,
    ) -> PassResult:
        """Forward (and backward unless ``forward_only``) over ``mbs``; gradients accumulate
        in the DDP buffers and are synchronised over DP x CP by megatron's finalize step.
        ``routes``: also return what this rank's routers chose (MoE)."""
        unknown = set(outputs) - set(PER_TOKEN_OUTPUTS)
        if unknown:
            raise ValueError(f"unknown per-token outputs {sorted(unknown)}")
        tensors = [
            dataclasses.replace(self.inputs.prepare(mb), index=i) for i, mb in enumerate(mbs)
        ]
        run = _Pass(loss=loss, outputs=outputs, backward=not forward_only)
        rows = self._router_rows(mbs, run, record=routes)
        try:
            return self._run(mbs, tensors, run, forward_only=forward_only, router_rows=rows)
        finally:
            if self.replay is not None:
                self.replay.end_pass()

    def _router_rows(
        self, mbs: Sequence[PackedMicroBatch], run: _Pass, *, record: bool
    ) -> list[Tensor]:
        """Each micro-batch's rows as this rank's routers see them; the routes they replay
        (``run.given_routes``) and, if ``record``, where their choices go."""
        if self.replay is None:
            return []
        c, t = self.dims.coords, self.dims.layout
        rows = [
            router_rows(
                mb, cp=(c.cp, t.cp), tp=(c.tp, t.tp), sequence_parallel=self.sequence_parallel
            )
            for mb in mbs
        ]
        for mb, r in zip(mbs, rows, strict=True):
            given = given_routes(mb)
            run.given_routes.append(None if given is None else torch.from_numpy(given[r.numpy()]))
        if record:
            run.chosen = {}
            self.replay.start_recording()
        return rows

    def _run(
        self,
        mbs: Sequence[PackedMicroBatch],
        tensors: list[RankMicroBatch],
        run: _Pass,
        *,
        forward_only: bool,
        router_rows: list[Tensor],
    ) -> PassResult:
        outputs = run.outputs
        # RL metrics when the batch carries the behaviour policy's log-probs (the same
        # decision on every rank: the plan is global).
        if "old_logprobs" in mbs[0].loss_inputs:
            with_ref = "ref_logprobs" in mbs[0].loss_inputs
            run.policy_keys = policy_metric_keys(with_ref=with_ref, with_entropy=True)
            run.policy_keys += sequence_metric_keys(run.loss)
        iters: Any = [iter(tensors) for _ in self.chunks] if len(self.chunks) > 1 else iter(tensors)
        for c in self.chunks:
            c.train(not forward_only)
        self.finalize_started = None
        with megatron_cpu.cuda_to_cpu():
            out = get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, run),
                data_iterator=iters,
                model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                num_microbatches=len(tensors),
                # global: megatron divides by cp (and by tp under sequence parallelism)
                seq_length=max(mb.model_tokens for mb in mbs),
                micro_batch_size=1,
                forward_only=forward_only,
            )
        self._record_spans(run, self.finalize_started or spans.now())
        self.routing.counting = False
        items = list(out or [])
        chosen = run.chosen or {}
        if not self.dims.is_last_stage:
            return PassResult(loss=0.0, outputs=[], routes=chosen, router_rows=router_rows)
        total = aggregate_loss((item["loss"] for item in items), self.dims.dp_cp_group)
        kept = [{k: item[k] for k in outputs} for item in items]
        metrics = {}
        if run.policy_keys:
            # Every DP x CP rank joins every metric's reduction, one with only dummies too.
            run.stats.ensure(run.policy_keys)
            metrics = run.stats.export(group=self.dims.dp_cp_group)
        return PassResult(
            loss=float(total),
            outputs=kept,
            metrics=metrics,
            routes=chosen,
            router_rows=router_rows,
        )

    def _record_spans(self, run: _Pass, end: float) -> None:
        """The pass's micro-batches on this rank's row of the timeline: each one's forward
        and, without pipeline stages (where megatron runs each micro-batch's backward right
        after its forward), its backward: until the next forward starts, or the gradients'
        reduction (``finalize_started``) or the pass's end."""
        for i, (start, stop) in enumerate(run.forwards):
            spans.record("forward", start, stop, microbatch=i)
        if run.backward and self.dims.layout.pp == 1 and len(self.chunks) == 1:
            until = [start for start, _ in run.forwards[1:]] + [end]
            for i, ((_, stop), nxt) in enumerate(zip(run.forwards, until, strict=True)):
                spans.record("backward", stop, nxt, microbatch=i)

    def _forward_step(
        self, run: _Pass, data: Iterator[RankMicroBatch], model: Any
    ) -> tuple[Tensor, Any]:
        run.forward_start = spans.now()
        mb = next(data)
        self.routing.counting = not mb.is_dummy
        gpt = model.module
        positions = mb.batch.position_ids
        assert positions is not None, "every stage gets the position ids"
        dtype = torch.bfloat16 if gpt.config.bf16 else torch.float32
        rope = rope_tables(gpt.rotary_pos_emb, positions[0], dtype)
        packed = dataclasses.replace(mb.packed, rope=rope)
        replay = self.replay
        if replay is not None:
            replay.before_forward(model, run.given_routes[mb.index])
        hidden = model(mb.batch.tokens, positions, attention_mask=None, packed_seq_params=packed)
        if replay is not None:
            if run.chosen is not None:
                run.chosen.setdefault(mb.index, {}).update(replay.take())
            hidden = replay.after_forward(model, hidden, run.given_routes[mb.index] is not None)
        # Only the last stage has an output layer (megatron calls the loss function there alone).
        weight = lm_head_weight(gpt) if gpt.post_process else None
        if not gpt.post_process:  # its forward ends here (the last stage's, in its loss)
            run.forwards.append((run.forward_start, spans.now()))
        return hidden, partial(self._loss_func, run, mb, weight)

    def _head(
        self, hidden: Tensor, weight: Tensor, labels: Tensor, rows: Tensor | None
    ) -> tuple[Tensor, Any]:
        """Per-token log-probs of ``labels`` under the output layer applied to ``hidden[rows]``
        (``hidden [t, H]``; ``rows`` maps each loss position to the hidden row predicting it,
        all rows in order when None), and a function giving the per-token entropy.

        Under sequence parallelism ``hidden`` is this TP rank's slice of the tokens: it is
        all-gathered over TP first (as megatron's output layer does), and that gather's
        backward reduce-scatters the hidden states' gradient, summing each rank's vocabulary
        slice's share, so the head itself must not sum it again."""
        group = self.dims.tp_group
        hidden = self._head_input(hidden)
        if rows is None:
            rows = torch.arange(hidden.shape[0], device=hidden.device)
        kw: dict[str, Any] = {"tp_group": group, "chunk_size": self.chunk_size}
        if self.fused:
            lp = fused_head_logprob(
                hidden,
                weight,
                labels,
                rows=rows,
                vocab_start=self.vocab_start,
                reduce_hidden_grad=not self.sequence_parallel,
                **kw,
            )
            return lp, lambda: fused_head_entropy(hidden.detach(), weight.detach(), rows=rows, **kw)
        # Unfused: the column-parallel output layer (the hidden states' gradient summed over
        # TP, here or by the gather above), all logits, then the streamed log-prob kernel.
        x = (
            hidden
            if self.sequence_parallel
            else copy_to_tensor_model_parallel_region(hidden, group=group)
        )
        logits = head_logits(x, weight, rows)
        lp = vocab_parallel_logprob(logits, labels, vocab_start=self.vocab_start, **kw)
        return lp, lambda: vocab_parallel_entropy(logits.detach(), **kw)

    def _head_input(self, hidden: Tensor) -> Tensor:
        """``hidden`` as the head reads it: under sequence parallelism all-gathered over TP
        (see ``_head``)."""
        if self.sequence_parallel:
            gathered: Tensor = gather_from_sequence_parallel_region(
                hidden, group=self.dims.tp_group
            )
            return gathered
        return hidden

    def _loss_in_forward(
        self, hidden: Tensor, weight: Tensor, mb: RankMicroBatch, run: _Pass, inputs: LossInputs
    ) -> tuple[Tensor, Tensor, Any]:
        """``(loss share, log-probs, entropy function)`` with the head's gradient taken in the
        forward pass (``fused_head_loss``): a flat micro-batch of a training pass whose loss is
        token-separable. The share is the sum of each chunk's ``sum(term * scale)``."""
        b, loss = mb.batch, run.loss
        assert b.labels is not None and b.loss_mask is not None
        per_token: dict[str, Any] = {**inputs.per_token, **inputs.before_head()}
        scale, mask, options = inputs.scale, b.loss_mask[0], loss.options()

        def share_of(lp: Tensor, a: int, c: int) -> Tensor:
            inputs = {k: v[a:c] for k, v in per_token.items()}
            terms = per_token_terms(lp, **options, loss_mask=mask[a:c], **inputs)
            return local_loss(terms, scale[a:c])

        x = self._head_input(hidden)
        kw: dict[str, Any] = {"tp_group": self.dims.tp_group, "chunk_size": self.chunk_size}
        share, lp = fused_head_loss(
            x, weight, b.labels[0], share_of, vocab_start=self.vocab_start,
            reduce_hidden_grad=not self.sequence_parallel, **kw,
        )  # fmt: skip
        return share, lp, lambda: fused_head_entropy(x.detach(), weight.detach(), **kw)

    def _tree_head(
        self, hidden: Tensor, weight: Tensor, labels: Tensor, rows: Tensor
    ) -> tuple[Tensor, Any]:
        """``_head`` for prefix tries: the sequences through a shared token all read its hidden
        row, and inside a shared prefix they also predict the same next token. The head runs
        once per distinct (row, label) pair - about one per trie token, not one per sequence
        and position - and each loss position takes its pair's log-prob (the gather's
        backward sums their gradients)."""
        pair, inverse = torch.unique(rows * self.vocab_size + labels, return_inverse=True)
        lp, entropy = self._head(hidden, weight, pair % self.vocab_size, pair // self.vocab_size)
        return lp[inverse], lambda: entropy()[inverse]

    def _loss_func(
        self, run: _Pass, mb: RankMicroBatch, weight: Tensor | None, hidden: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """``hidden [1, t, H]`` -> (this micro-batch's loss share, its local target count, what
        the pass returns) for megatron's schedule."""
        b, loss, outputs = mb.batch, run.loss, run.outputs
        assert weight is not None, "the loss function runs on the last stage"
        assert b.labels is not None and b.loss_mask is not None and b.cu_seqlens is not None
        inputs = None if mb.is_dummy else LossInputs.of(mb, loss, self.dims.cp_group)
        in_forward = (
            self.fused and run.backward and b.rows is None and inputs is not None
            and gradient_in_forward(loss)
        )  # fmt: skip
        share: Tensor | None = None
        scaled: Tensor | None = None
        if in_forward:
            assert inputs is not None
            share, lp, entropy = self._loss_in_forward(hidden[0], weight, mb, run, inputs)
        elif b.rows is None:
            lp, entropy = self._head(hidden[0], weight, b.labels[0], None)
        else:
            lp, entropy = self._tree_head(hidden[0], weight, b.labels[0], b.rows[0])
        if inputs is None:
            # A dummy: through the log-probs, the zero reaches the output layer and every
            # parameter below it.
            share, n = connected_zero(lp), torch.zeros((), dtype=torch.int, device=lp.device)
            scaled = torch.zeros_like(lp)
        else:
            per_token: dict[str, Any] = {**inputs.per_token, **inputs.after_head(lp)}
            scale = inputs.scale
            if run.policy_keys:
                with torch.no_grad():
                    record_policy_metrics(
                        run.stats, lp, loss_mask=b.loss_mask[0],
                        old_logprobs=per_token["old_logprobs"], seq_id=inputs.seqs.seq_id,
                        num_seqs=mb.num_sequences, cp_group=self.dims.cp_group,
                        clip_low=loss.clip_low, clip_high=loss.clip_high,
                        ref_logprobs=per_token.get("ref_logprobs"), entropy=entropy(),
                    )  # fmt: skip
                    if inputs.sequence is not None:
                        inputs.sequence.record(run.stats)
            # The target count stays on the device: megatron only adds it up (and the finalize
            # step ignores it: the loss is pre-normalised), so no read stalls the host here.
            n = torch.count_nonzero(b.loss_mask).int()
            if share is None:
                terms = per_token_terms(lp, **loss.options(), loss_mask=b.loss_mask[0], **per_token)
                share, scaled = local_loss(terms, scale), terms * scale
            elif "token_loss" in outputs:  # the loss is taken already: its terms, for the report
                with torch.no_grad():
                    scaled = scale * per_token_terms(
                        lp, **loss.options(), loss_mask=b.loss_mask[0], **per_token
                    )
        report = {"loss": share.detach().clone()}
        cp_group = self.dims.cp_group

        def gather(values: Tensor) -> Tensor:
            """This CP rank's per-position values -> every position's, in flat order, on
            the host (where the reports are assembled)."""
            if mb.targets is not None:  # prefix tries: by the positions each rank computed
                return gather_targets_from_cp(values, mb.targets, mb.num_targets, cp_group).cpu()
            assert b.cu_seqlens is not None
            return gather_from_cp(values, b.cu_seqlens, cp_group).cpu()

        if "logprobs" in outputs:
            report["logprobs"] = gather(lp.detach())
        if "entropy" in outputs:
            with torch.no_grad():
                report["entropy"] = gather(entropy())
        if "token_loss" in outputs:
            assert scaled is not None
            report["token_loss"] = gather(scaled.detach())
        run.forwards.append((run.forward_start, spans.now()))
        return share, n, report


def per_sequence(
    mbs: Sequence[PackedMicroBatch], values: Sequence[Tensor]
) -> dict[int, np.ndarray]:
    """Per-token values of each real sequence, by request index, aligned with its tokens:
    ``[t]`` belongs to token ``t`` (predicted from ``tokens[:t]``), ``[0]`` is 0."""
    out: dict[int, np.ndarray] = {}
    for mb, v in zip(mbs, values, strict=True):
        for b, idx in enumerate(mb.seq_index.tolist()):
            if idx < 0:
                continue
            start, n = int(mb.cu_seqlens[b]), int(mb.seq_lens[b])
            row = np.zeros(n, np.float32)
            row[1:] = v[start : start + n - 1].numpy()  # position t predicts token t + 1
            out[idx] = row
    return out
