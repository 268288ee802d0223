"""The single-process reference the service tiers compare a running service against:
``reference.py`` run in a fresh interpreter (one rank, no Ray), and the tolerance they use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REFERENCE = Path(__file__).with_name("reference.py")
RTOL = 1e-5
_ANSWERS: dict[str, Any] = {}
"""``reference.py``'s answers in this test process, by their input: a pure function of it (the
layout and multinode tests ask the same questions on every layout)."""


def close(a: float, b: float, rtol: float = RTOL) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def single_process(mode: str, batch: list[dict[str, Any]]) -> Any:
    """``reference.py``'s answer for ``batch`` on the service's default model at one rank:
    ``eval`` gives ``{"loss"}``, ``step`` one step's losses and grad norm, ``logprobs`` the
    per-token log-probs."""
    from trainctl.service.launch import engine_config
    from trainctl.service.settings import Settings

    engine = engine_config(Settings(dp=1, cp=1, tp=1, pp=1)).to_dict()
    question = json.dumps({"mode": mode, "sequences": batch, "engine": engine})
    if question not in _ANSWERS:
        ref = subprocess.run(
            [sys.executable, str(REFERENCE)],
            input=question,
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        _ANSWERS[question] = ref.stdout.strip().splitlines()[-1]
    return json.loads(_ANSWERS[question])  # a fresh copy: callers may change it
