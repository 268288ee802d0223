"""LoRA against PEFT: a tiny Llama and a tiny (tied) Qwen3 from transformers as the frozen
base, an adapter on attention, MLP and the LM head trained one step by trainctl and exported in
PEFT's format. Loaded by ``peft.PeftModel`` on the transformers model, it gives trainctl's
per-token log-probs, loss and adapter gradients (fp32, 1e-5): the export's names, the q/k/v
and gate/up splits, the scaling and the rank cut are all PEFT's."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.hf_models import tiny_model
from helpers.rankpool import RankPool
from hf_cases import lora_from_hf

peft = pytest.importorskip("peft", reason="peft is in the dev extra")

ADAPTER = {"name": "a", "rank": 4, "alpha": 16.0, "targets": ["attn", "mlp", "unembed"], "seed": 3}
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "fc1", "up_proj": "fc1"}


def _peft_reference(base: Path, adapter: Path | None, batch: list[list[int]]) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)
    model.eval()
    lps, total, count = [], torch.zeros((), dtype=torch.float64), 0
    for tokens in batch:
        ids = torch.tensor([tokens])
        logits = model(input_ids=ids).logits[0, :-1]
        lp = torch.log_softmax(logits.double(), -1).gather(1, ids[0, 1:, None])[:, 0]
        lps.append(lp.detach().numpy())
        total = total - lp.sum()
        count += len(tokens) - 1
    if adapter is not None:
        (total / count).backward()
    grads = {n: p.grad.double().numpy() for n, p in model.named_parameters() if p.grad is not None}
    return {"logprobs": lps, "loss": float(total / count), "grads": grads}


def _fold(grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """PEFT's per-module ``lora_A`` gradients summed over the modules that share our fused
    ``A`` (q/k/v, gate/up); ``lora_B`` gradients as they are."""
    out: dict[str, np.ndarray] = {}
    for name, g in grads.items():
        m = re.search(r"layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])", name)
        if m and m.group(3) == "A" and m.group(2) in _FUSED:
            key = f"{m.group(1)}.{_FUSED[m.group(2)]}.A"
            out[key] = out.get(key, 0) + g
        else:
            out[name] = g
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_adapter_equals_peft(pools: Callable[[int], RankPool], tmp_path: Path, family: str) -> None:
    tiny_model(family, tmp_path / "base")
    rng = np.random.default_rng(2)
    warm = [rng.integers(0, 256, n).tolist() for n in (30, 11)]
    batch = [rng.integers(0, 256, n).tolist() for n in (17, 5, 40)]
    (got,) = pools(1).run(
        lora_from_hf, str(tmp_path / "base"), ADAPTER, warm, batch, str(tmp_path / "adapter")
    )
    want = _peft_reference(tmp_path / "base", tmp_path / "adapter", batch)
    for i, lp in enumerate(want["logprobs"]):
        np.testing.assert_allclose(got["logprobs"][i][1:], lp, rtol=1e-5, atol=1e-5)
    assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"])
    # The merged export: a plain model of the family with the adapter folded in.
    merged = _peft_reference(tmp_path / "adapter" / "merged", None, batch)
    for i, lp in enumerate(merged["logprobs"]):
        np.testing.assert_allclose(got["logprobs"][i][1:], lp, rtol=1e-5, atol=1e-5)

    # Our gradients in PEFT's names through the exporter itself, then folded as PEFT's are.
    from trainctl.workers.engine import hf, hf_adapter
    from trainctl.workers.engine.boundary import AdapterSpec
    from trainctl.workers.engine.config import ModelConfig

    model = hf.model_config_from_hf(hf.read_config(tmp_path / "base"), ModelConfig())
    spec = AdapterSpec(**{**ADAPTER, "targets": tuple(ADAPTER["targets"])})
    ours = {k: torch.from_numpy(v) for k, v in got["grads"].items()}
    _, as_peft = hf_adapter.to_peft(ours, model, spec)
    # An A shared by q/k/v appears once per module in the export: count it once.
    mine = {}
    for name, g in as_peft.items():
        m = re.search(r"layers\.(\d+)\.\w+\.(\w+)\.lora_A", name)
        key = f"{m.group(1)}.{_FUSED[m.group(2)]}.A" if m and m.group(2) in _FUSED else name
        mine[key] = g.double().numpy()
    theirs = {k.replace(".default", ""): v for k, v in _fold(want["grads"]).items()}
    assert mine.keys() == theirs.keys()
    assert any("lm_head" in k for k in mine)
    for name, g in theirs.items():
        atol = 1e-5 * float(np.abs(g).max())
        np.testing.assert_allclose(mine[name], g, rtol=1e-5, atol=atol, err_msg=name)
    # The padding beyond the adapter's rank never got a gradient.
    pad = [k for k, v in got["grads"].items() if k.endswith(".lora_a") and np.any(v[4:])]
    assert pad == []


def test_moe_adapter_on_experts_merges_into_a_transformers_model(
    pools: Callable[[int], RankPool], tmp_path: Path
) -> None:
    """A tiny Qwen3-MoE: an adapter on attention, every expert and the LM head, trained one
    step. Its merged export, loaded by transformers, gives trainctl's log-probs (1e-5): the
    experts' factors fold into the right experts. (PEFT itself cannot load per-expert
    adapters onto transformers' fused expert tensors; the PEFT export names each expert as
    the checkpoint does, vLLM's per-expert LoRA layout.)"""
    tiny_model("qwen3_moe", tmp_path / "base")
    rng = np.random.default_rng(3)
    warm = [rng.integers(0, 256, n).tolist() for n in (30, 11)]
    batch = [rng.integers(0, 256, n).tolist() for n in (17, 5, 40)]
    (got,) = pools(1).run(
        lora_from_hf, str(tmp_path / "base"), ADAPTER, warm, batch, str(tmp_path / "adapter")
    )
    base = _peft_reference(tmp_path / "base", None, batch)
    merged = _peft_reference(tmp_path / "adapter" / "merged", None, batch)
    for i, lp in enumerate(merged["logprobs"]):
        np.testing.assert_allclose(got["logprobs"][i][1:], lp, rtol=1e-5, atol=1e-5)
    pairs = zip(merged["logprobs"], base["logprobs"], strict=True)
    moved = max(np.abs(m - b).max() for m, b in pairs)
    assert moved > 1e-3, "the adapter changed nothing"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        names = set(f.keys())
    for e in range(4):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"base_model.model.model.layers.1.mlp.experts.{e}.{proj}.lora_B.weight" in names
