"""Without CUDA, megatron-core's fused functions are plain functions in every process that
imports the engine, and importing them never loads dynamo (workers/engine/megatron_jit.py)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import trainctl.workers.engine.shard  # what a rank imports to build its engine
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.transformer.attention import Attention
print(json.dumps({
    "fuser_is_noop": jit.jit_fuser is jit.noop_decorator,
    # torch.compile's wrapper keeps what it wraps here
    "swiglu_is_plain": not hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable"),
    "gate_is_plain": not hasattr(Attention._apply_output_gate, "_torchdynamo_orig_callable"),
    "dynamo_loaded": "torch._dynamo" in sys.modules,
}))
"""


def _probe(code: str) -> dict[str, bool]:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_cpu_engine_import_leaves_megatrons_fused_functions_eager() -> None:
    assert _probe(PROBE) == {
        "fuser_is_noop": True,
        "swiglu_is_plain": True,
        "gate_is_plain": True,
        "dynamo_loaded": False,
    }


def test_megatron_imported_first_is_compiled_as_upstream_does() -> None:
    """The hook is what changes it: megatron-core imported before trainctl's engine keeps
    torch.compile's wrappers (and has loaded dynamo)."""
    got = _probe("import megatron.core.jit\n" + PROBE)
    assert got == {
        "fuser_is_noop": False,
        "swiglu_is_plain": False,
        "gate_is_plain": False,
        "dynamo_loaded": True,
    }
