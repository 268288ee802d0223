"""Weights streamed from their owners (``workers/engine/hf_stream.py``, ``workers/sampler/
stream.py``, ``workers/sampler/buckets.py``): every family's model cut into the shards each
TP rank (and each expert owner) holds, each owner's pieces planned, packed and assembled on
the receiving side, gives exactly what the rank-0 merge gives (``hf.to_hf`` of the whole
model), at tp 1 and 2 and with experts over two EP ranks, in buckets small enough that most
tensors travel alone. No Ray, no megatron: the shards are made by the same ``shard_rule`` the
engine's are."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers.hf_models import FAMILIES, tiny_model
from trainctl.workers.engine import hf, hf_read
from trainctl.workers.engine.config import ModelConfig
from trainctl.workers.engine.hf_stream import owned_pieces
from trainctl.workers.engine.weights import shard_rule
from trainctl.workers.rank.stream import as_piece
from trainctl.workers.sampler.buckets import Assembler, pack
from trainctl.workers.sampler.stream import Piece, StreamPlan


def _model(family: str, directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    tiny_model(family, directory)
    m = hf.model_config_from_hf(hf.read_config(directory), ModelConfig())
    return m, hf_read.load(directory, m)


def _owners(
    canonical: dict[str, torch.Tensor], m: ModelConfig, tp: int, ep: int
) -> dict[int, list[tuple[str, torch.Tensor]]]:
    """What each rank of a tp x ep layout owns (rank = ep_rank * tp + tp_rank): its TP shard
    of every dense tensor, and its experts whole on TP rank ``e % tp`` of EP rank
    ``e // (E / ep)`` (an expert lives on one rank only)."""
    per_ep = max(m.num_experts // ep, 1)
    out: dict[int, list[tuple[str, torch.Tensor]]] = {r: [] for r in range(tp * ep)}
    for name, full in canonical.items():
        if ".local_experts." in name:
            e = int(name.split(".local_experts.")[1].split(".")[0])
            out[(e // per_ep) * tp + e % tp].append((name, full))
            continue
        for t in range(tp):
            out[t].append((name, shard_rule(name).shard(full, t, tp).contiguous()))
    return out


def _stream(
    canonical: dict[str, torch.Tensor], m: ModelConfig, tp: int, ep: int, bucket_bytes: int
) -> tuple[StreamPlan, dict[str, torch.Tensor]]:
    owned = {
        rank: list(owned_pieces(iter(named), m, tp_rank=rank % tp, tp=tp))
        for rank, named in _owners(canonical, m, tp, ep).items()
    }
    plan = StreamPlan.of({r: [as_piece(h) for h in hs] for r, hs in owned.items()}, bucket_bytes)
    values = {r: {as_piece(h).key: h for h in hs} for r, hs in owned.items()}
    assembler = Assembler(plan)
    for index, bucket in enumerate(plan.buckets):
        messages = pack(bucket, lambda p, b=bucket: values[b.owner][p.key].tensor())
        assembler.fill(index, messages)
    return plan, assembler.tensors()


LAYOUTS = [(f, tp, 1) for f in sorted(FAMILIES) for tp in (1, 2)] + [
    (f, 2, 2) for f in ("qwen3_moe", "qwen3_5_moe")
]


@pytest.mark.parametrize(("family", "tp", "ep"), LAYOUTS)
def test_streamed_pieces_assemble_to_the_rank0_merge(
    family: str, tp: int, ep: int, tmp_path: Path
) -> None:
    m, canonical = _model(family, tmp_path)
    want = hf.to_hf(canonical, m)
    plan, got = _stream(canonical, m, tp, ep, bucket_bytes=1 << 14)
    assert len(plan.buckets) > 3 and len(plan.owners) == len({b.owner for b in plan.buckets})
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    if tp > 1:  # a split tensor really arrives in pieces from more than one owner
        split = [b for b in plan.buckets for p in b.pieces if not p.whole]
        assert {b.owner for b in split} == set(range(tp)) or ep > 1


def test_a_tp4_shard_of_gated_deltanet_lands_in_several_runs(tmp_path: Path) -> None:
    """Qwen3.5's input projection is grouped by key head in our layout and q/k/v-major in
    Hugging Face's: a TP rank's rows land in ``in_proj_qkv`` as three runs (its q, k and v),
    each a piece of its own, gathered (not a view)."""
    m, canonical = _model("qwen3_5", tmp_path)
    m = dataclasses.replace(m)
    name = next(n for n in canonical if n.endswith("self_attention.in_proj.weight"))
    shard = shard_rule(name).shard(canonical[name], 1, 2).contiguous()
    pieces = [as_piece(h) for h in owned_pieces(iter([(name, shard)]), m, tp_rank=1, tp=2)]
    qkv = [p for p in pieces if p.name.endswith("in_proj_qkv.weight")]
    assert len(qkv) == 3 and len({p.start for p in qkv}) == 3, qkv
    _, got = _stream(canonical, m, 2, 1, bucket_bytes=1 << 20)
    want = hf.to_hf(canonical, m)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_plan_whose_pieces_do_not_tile_a_tensor_is_refused() -> None:
    full = (8, 4)
    halves = [Piece("w", 0, 0, (4, 4), "float32", full), Piece("w", 0, 4, (4, 4), "float32", full)]
    StreamPlan.of({0: halves[:1], 1: halves[1:]}, 1 << 10).check()
    gap = [halves[0], Piece("w", 0, 5, (3, 4), "float32", full)]
    with pytest.raises(ValueError, match="hold 28 elements of 32"):
        StreamPlan.of({0: gap}, 1 << 10)
    overlap = [
        halves[0],
        Piece("w", 0, 3, (2, 4), "float32", full),
        Piece("w", 0, 6, (2, 4), "float32", full),
    ]
    with pytest.raises(ValueError, match="overlap"):
        StreamPlan.of({0: overlap}, 1 << 10)
    with pytest.raises(ValueError, match="outside"):
        StreamPlan.of(
            {
                0: [
                    Piece("w", 0, 4, (8, 2), "float32", full),
                    Piece("w", 0, 0, (4, 4), "float32", full),
                ]
            },
            1 << 10,
        )


def test_an_assembler_refuses_a_missing_bucket_and_a_wrong_message() -> None:
    schema = {"a": ((4, 4), "float32"), "b": ((300_000,), "float32")}
    plan = StreamPlan.whole(schema, 1 << 16)
    assert any(p.direct for b in plan.buckets for p in b.pieces)
    assembler = Assembler(plan)
    with pytest.raises(ValueError, match="bytes"):
        assembler.fill(0, [torch.zeros(3, dtype=torch.uint8)] * len(plan.buckets[0].messages()))
    with pytest.raises(RuntimeError, match="never arrived"):
        assembler.tensors()


def test_streamed_object_store_messages_are_read_only_numpy_safely() -> None:
    """The object store hands an engine read-only arrays: assembling copies out of them."""
    import numpy as np

    schema = {"a": ((2, 3), "float32")}
    plan = StreamPlan.whole(schema, 1 << 10)
    src = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    arrays = [m.numpy().copy() for m in pack(plan.buckets[0], lambda p: src)]
    for a in arrays:
        a.setflags(write=False)
    assembler = Assembler(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assembler.fill(0, [torch.from_numpy(np.asarray(a)) for a in arrays])
    assert torch.equal(assembler.tensors()["a"], src)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_piece_said_to_be_a_view_is_one_and_the_rest_are_copies(
    family: str, tmp_path: Path
) -> None:
    """What travels without a copy (``view``) is told from shapes alone, before any byte is
    touched: it must be exactly the pieces whose values share the parameter's memory."""
    m, canonical = _model(family, tmp_path)
    pieces = list(owned_pieces(iter(canonical.items()), m, tp_rank=0, tp=1))
    storage = {t.untyped_storage().data_ptr() for t in canonical.values()}
    shares = [h.tensor().untyped_storage().data_ptr() in storage for h in pieces]
    assert [h.view for h in pieces] == shares
    assert any(shares) and not all(shares)  # q/k/v regrouped: copies
