"""MoE routing replay: route each token through given experts, and report the experts chosen.

megatron-core gives every router a ``RouterReplay`` (``moe_enable_routing_replay``). Under
``REPLAY_FORWARD`` the router takes its target top-k indices instead of its own, and its
probabilities are its own scores gathered at those experts, so the router still gets a
gradient. ``set_target_indices`` also queues the indices, and under ``REPLAY_BACKWARD`` the
router takes the oldest queued ones: what activation recomputation needs when it re-runs a
layer in backward after later micro-batches' forwards (1F1B) have set other targets.

``RouteReplay`` drives them one micro-batch at a time, as the schedule calls it:
* before a model chunk's forward, its routers get the micro-batch's routes and
  ``REPLAY_FORWARD`` (or no action: their own top-k);
* the chunk's output passes an identity whose backward switches those routers to
  ``REPLAY_BACKWARD``; megatron's schedule runs one forward or backward step at a time, so the
  switch holds until the next forward sets ``REPLAY_FORWARD`` again;
* the pass's end clears every target and queue.

Asked to, it records each router's choice (``[tokens, top_k]``, highest probability first)
for the micro-batch being run: the replayed experts under replay.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from trainctl.workers.engine.boundary import PackedMicroBatch, RouteShard
from trainctl.workers.engine.routing import moe_routers
from trainctl.workers.ops.autograd import apply
from trainctl.workers.ops.cp import zigzag_positions


class _SwitchToBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, routers: list[Any]) -> Tensor:
        ctx.routers = routers
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for r in ctx.routers:
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return grad, None


class RouteReplay:
    """Routing replay on one shard. Owns the routers it drives and the routes recorded in a
    forward, replayed in its backward."""

    def __init__(self, chunks: list[Any]) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.routers: dict[int, list[Any]] = {id(c): moe_routers(c) for c in chunks}
        # megatron also lists every instance in a class-level list, for its static helpers;
        # this class never uses them, and the list would keep every engine built in a process.
        RouterReplay.global_router_replay_instances.clear()
        self.recorded: dict[int, Tensor] | None = None
        for routers in self.routers.values():
            for r in routers:
                r.register_forward_hook(self._record)

    @property
    def enabled(self) -> bool:
        return any(self.routers.values())

    def before_forward(self, chunk: Any, routes: Tensor | None) -> None:
        """Route the next forward of ``chunk`` by ``routes`` (``[tokens, layers, top_k]``,
        the tokens as its routers see them), or by the routers' own top-k if None."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for r in self.routers[id(chunk)]:
            if routes is None:
                r.router_replay.clear_router_replay_action()
                continue
            r.router_replay.set_target_indices(routes[:, r.layer_number - 1, :])
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self, chunk: Any, output: Tensor, replaying: bool) -> Tensor:
        """``output`` of ``chunk``, marked so that its backward replays the queued routes."""
        if replaying and output.requires_grad:
            return apply(_SwitchToBackward, output, self.routers[id(chunk)])
        return output

    def end_pass(self) -> None:
        for routers in self.routers.values():
            for r in routers:
                r.router_replay.clear_indices()
                r.router_replay.clear_router_replay_action()
        self.recorded = None

    def start_recording(self) -> None:
        self.recorded = {}

    def take(self) -> dict[int, Tensor]:
        """The experts each router of the last forward chose, by global layer index."""
        out, self.recorded = self.recorded or {}, {}
        return out

    def _record(self, module: nn.Module, _inputs: Any, outputs: Any) -> None:
        if self.recorded is None:
            return
        probs, routing_map = outputs
        k = module.topk
        chosen = probs.detach().masked_fill(~routing_map, float("-inf"))
        layer = int(getattr(module, "layer_number")) - 1
        self.recorded[layer] = chosen.topk(k, dim=1).indices.to(torch.int16).cpu()


def router_rows(
    mb: PackedMicroBatch, *, cp: tuple[int, int], tp: tuple[int, int], sequence_parallel: bool
) -> Tensor:
    """The micro-batch's model rows (flat tokens, or trie rows) that this rank's routers see,
    in their order: its CP shard (zigzag), and its TP slice of that under sequence
    parallelism. ``cp`` and ``tp``: (rank, size)."""
    tree = mb.tree
    rows = torch.arange(mb.model_tokens)
    if cp[1] > 1:
        cu = torch.from_numpy(np.array(tree.cu_seqlens if tree is not None else mb.cu_seqlens))
        rows = rows[zigzag_positions(cu, cp[1], cp[0])]
    if sequence_parallel and tp[1] > 1:
        n = rows.shape[0] // tp[1]
        rows = rows[tp[0] * n : (tp[0] + 1) * n]
    return rows


def given_routes(mb: PackedMicroBatch) -> np.ndarray | None:
    """``[model rows, layers, top_k]``: the routes the micro-batch replays, if any."""
    if mb.tree is not None:
        return mb.tree.routes
    return mb.per_token.get("routed_experts")


def route_shards(
    mbs: list[PackedMicroBatch], rows: list[Tensor], chosen: dict[int, dict[int, Tensor]]
) -> dict[int, RouteShard]:
    """What this rank's routers chose, as pieces of each real sequence's ``[tokens, layers,
    top_k]`` (the controller puts every rank's pieces together). ``rows[i]``: the model rows
    micro-batch ``i`` routed here; ``chosen[i]``: its experts by global layer index."""
    out: dict[int, RouteShard] = {}
    for i, mb in enumerate(mbs):
        if mb.is_dummy or not chosen.get(i):
            continue
        layers = sorted(chosen[i])
        experts = torch.stack([chosen[i][layer] for layer in layers], dim=1).numpy()
        where = np.full(mb.model_tokens, -1, np.int64)  # model row -> its index here
        where[rows[i].numpy()] = np.arange(rows[i].shape[0])
        model_row = mb.tree.rows if mb.tree is not None else np.arange(mb.num_tokens)
        for b, seq in enumerate(mb.seq_index.tolist()):
            if seq < 0:
                continue
            start, n = int(mb.cu_seqlens[b]), int(mb.seq_lens[b])
            local = where[model_row[start : start + n]]
            positions = np.flatnonzero(local >= 0)
            if positions.size:
                out[seq] = RouteShard(
                    positions=positions,
                    layers=np.asarray(layers, np.int64),
                    experts=experts[local[positions]],
                )
    return out
