"""A Hugging Face checkpoint read a shard at a time (``workers/engine/hf_read.py``): every TP
rank's shard of every tensor, of every family, equals the shard of the tensor converted whole
(``hf.from_hf`` over safetensors' own ``load_file``), and the ranks together read each split
tensor once: a rank reads its rows or columns, not the tensor. No Ray, no megatron."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.bench_scripts import load
from tests.helpers.hf_models import FAMILIES, tiny_model
from trainctl.workers.engine import hf
from trainctl.workers.engine.config import ConfigError, ModelConfig
from trainctl.workers.engine.hf_read import CheckpointReader
from trainctl.workers.engine.weights import shard_rule

bench = load("hf_read")


def _whole(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    m = hf.model_config_from_hf(hf.read_config(directory), ModelConfig())
    loaded = {}
    for f in sorted(directory.glob("*.safetensors")):
        loaded |= {k: v.float() for k, v in load_file(str(f)).items()}
    return m, hf.from_hf(loaded, m)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_rank_reads_its_shard_and_together_each_split_tensor_once(
    family: str, tmp_path: Path
) -> None:
    tiny_model(family, tmp_path)
    m, canonical = _whole(tmp_path)
    tp = 2
    read = []
    for rank in range(tp):
        with CheckpointReader(tmp_path, m) as reader:
            for name, full in canonical.items():
                got = reader.shard(name, tuple(full.shape), rank, tp)
                want = shard_rule(name).shard(full, rank, tp)
                assert torch.equal(got, want), (name, rank)
            read.append(reader.elements_read)
    split = sum(t.numel() for n, t in canonical.items() if shard_rule(n).kind != "replicated")
    replicated = sum(t.numel() for t in canonical.values()) - split
    assert split > 0 and replicated > 0
    assert sum(read) == split + tp * replicated, (read, split, replicated)


def test_one_rank_reads_only_what_it_asks_for(tmp_path: Path) -> None:
    """A pipeline stage asks for its own layers only: nothing else is read."""
    tiny_model("llama", tmp_path)
    m, canonical = _whole(tmp_path)
    first_layer = {n: t for n, t in canonical.items() if n.startswith("decoder.layers.0.")}
    with CheckpointReader(tmp_path, m) as reader:
        for name, full in first_layer.items():
            reader.shard(name, tuple(full.shape), 0, 1)
        assert reader.elements_read == sum(t.numel() for t in first_layer.values())
        assert reader.elements() == sum(t.numel() for t in canonical.values())
        assert reader.elements() > 2 * reader.elements_read


def test_a_tensor_of_another_shape_is_refused_by_name(tmp_path: Path) -> None:
    tiny_model("qwen3", tmp_path)
    m, canonical = _whole(tmp_path)
    (f,) = tmp_path.glob("*.safetensors")
    tensors = load_file(str(f))
    bad = "model.layers.1.self_attn.k_proj.weight"
    tensors[bad] = tensors[bad][:-1].clone()
    save_file(tensors, str(f), metadata={"format": "pt"})
    qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
    with (
        CheckpointReader(tmp_path, m) as reader,
        pytest.raises(ConfigError, match=f"{bad}: the checkpoint has shape"),
    ):
        reader.shard(qkv, tuple(canonical[qkv].shape), 0, 2)
    del tensors[bad]
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"no tensor '{bad}'"):
        CheckpointReader(tmp_path, m)


def test_the_benchmark_measures_both_ways_alike(tmp_path: Path) -> None:
    """``bench/hf_read.py``'s measure (in this process: the script runs each in a fresh one):
    the whole load and the shard read keep the same elements, and at tp 2 the shard read
    reads a fraction of what the whole load reads."""
    tiny_model("qwen3", tmp_path)
    got = {how: bench.measure(str(tmp_path), how, 2, 1) for how in ("whole", "shard")}
    assert got["shard"]["kept_m"] == got["whole"]["kept_m"] > 0, got
    assert got["shard"]["read_m"] < 0.75 * got["whole"]["read_m"], got
