"""An adapter in PEFT's format, and an adapter folded into the base (``merged``).

PEFT names one ``lora_A``/``lora_B`` pair per Hugging Face linear. Ours are per fused linear,
so the export splits them the way ``hf.py`` splits the weights:

* ``linear_qkv``: ``B``'s rows follow megatron's group-major q/k/v layout and are split into
  ``q_proj``, ``k_proj`` and ``v_proj``; the three share ``A`` (the fused input is the same);
* ``linear_fc1``: ``B``'s gate and up halves go to ``gate_proj`` and ``up_proj``, sharing ``A``;
* ``linear_proj``, ``linear_fc2``, ``output_layer``: one pair each (``o_proj``, ``down_proj``,
  ``lm_head``);
* an MoE expert's ``linear_fc1`` and ``linear_fc2``: per expert, as the checkpoint names it
  (``mlp.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``: vLLM's per-expert LoRA
  layout).

The factors are cut from the service's maximal rank down to the adapter's own ``r``. PEFT's
``delta = (alpha / r) B A`` is then exactly ours.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from torch import Tensor

from trainctl.workers.engine import hf
from trainctl.workers.engine.boundary import AdapterSpec
from trainctl.workers.engine.config import ModelConfig
from trainctl.workers.engine.families import OUTPUT, Fuse
from trainctl.workers.engine.lora import is_lora
from trainctl.workers.engine.weights import EMBEDDING

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_SITE_GROUP = {
    "linear_qkv": "attn",
    "linear_proj": "attn",
    "linear_fc1": "mlp",
    "linear_fc2": "mlp",
    "output_layer": "unembed",
}


def _sites(m: ModelConfig) -> list[tuple[str, tuple[str, ...], Fuse]]:
    """(our site prefix, the family's module names, how they fuse) for every adaptable linear."""
    out = {}
    # An untied model's rows hold the output layer already; a tied one's do not.
    for ours, theirs, fuse in (*hf.rows(m), (OUTPUT.ours, OUTPUT.theirs, OUTPUT.fuse)):
        site = ours.removesuffix(".weight")
        if site.rsplit(".", 1)[-1] in _SITE_GROUP:
            out[site] = (site, tuple(t.removesuffix(".weight") for t in theirs), fuse)
    return list(out.values())


def _factors(canonical: dict[str, Tensor], site: str, rank: int) -> tuple[Tensor, Tensor]:
    return canonical[f"{site}.lora_a"][:rank], canonical[f"{site}.lora_b"][:, :rank]


def to_peft(
    canonical: dict[str, Tensor], m: ModelConfig, spec: AdapterSpec
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Full canonical LoRA factors -> PEFT's ``adapter_config.json`` and its tensors."""
    tensors: dict[str, Tensor] = {}
    modules: set[str] = set()
    for site, theirs, fuse in _sites(m):
        if _SITE_GROUP[site.rsplit(".", 1)[-1]] not in spec.targets:
            continue
        a, b = _factors(canonical, site, spec.rank)
        for name, b_part in zip(theirs, hf.split(b, fuse, m), strict=True):
            tensors[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = a.float().clone()
            tensors[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = b_part.float().contiguous()
            modules.add(name.rsplit(".", 1)[-1])
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "base_model_name_or_path": None,
    }
    return config, tensors


def save_peft(
    directory: Path, canonical: dict[str, Tensor], m: ModelConfig, spec: AdapterSpec
) -> list[Path]:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``directory``."""
    from safetensors.torch import save_file

    config, tensors = to_peft(canonical, m, spec)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return [directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS]


def merged(canonical: dict[str, Tensor], m: ModelConfig, spec: AdapterSpec) -> dict[str, Tensor]:
    """The base's canonical weights with the adapter folded in (``W + (alpha / r) B A``) and
    without the LoRA factors: a plain model of the family. A tied model adapted on its LM head
    gets an output layer of its own (the input embedding stays the base's)."""
    out = {k: v for k, v in canonical.items() if not is_lora(k)}
    scaling = spec.alpha / spec.rank
    for site, _, _ in _sites(m):
        if _SITE_GROUP[site.rsplit(".", 1)[-1]] not in spec.targets:
            continue
        a, b = _factors(canonical, site, spec.rank)
        weight = out.get(f"{site}.weight", out[EMBEDDING])
        out[f"{site}.weight"] = weight + scaling * (b.float() @ a.float()).to(weight.dtype)
    return out


def untie_if_head_adapted(m: ModelConfig, spec: AdapterSpec) -> ModelConfig:
    """The model config a merged export is written with: an adapted LM head unties it."""
    if m.tie_embeddings and "unembed" in spec.targets:
        return dataclasses.replace(m, tie_embeddings=False)
    return m
