"""Generate ``clients/async_.py`` from ``clients/sync.py`` (the async client is a mirror).

The sync client is the one source: every method is written once, there. This script rewrites
it token by token into the async client (``await`` on sends and sleeps, ``async def`` on
methods, ``httpx.AsyncClient``, async context manager). ``tests/unit/test_client.py`` fails
if the committed async file is stale.

    python scripts/unasync.py          # rewrite clients/async_.py
    python scripts/unasync.py --check  # exit 1 if it is stale
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE, TARGET = ROOT / "clients/sync.py", ROOT / "clients/async_.py"

RULES: list[tuple[str, str]] = [
    (
        r'^"""The synchronous Python client\.',
        '"""The asynchronous Python client (``httpx.AsyncClient``), generated from\n'
        "``clients/sync.py`` by ``scripts/unasync.py``: edit that file, not this one.",
    ),
    (
        r"^from trainctl\.clients import TrainctlClient",
        "from trainctl.clients import AsyncTrainctlClient",
    ),
    (r"^with TrainctlClient\(", "async with AsyncTrainctlClient("),
    (r"^    result = tc\.", "    result = await tc."),
    (r"^import time$", "import asyncio\nimport time"),
    (r"\bTrainctlClient\b", "AsyncTrainctlClient"),
    (
        r"Blocking client of one trainctl service\. "
        r"Use as a context manager, or call ``close\(\)``",
        "Async client of one trainctl service. Use as an async context manager, or ``aclose()``",
    ),
    (r"httpx\.Client\b", "httpx.AsyncClient"),
    (r"def __enter__\(", "async def __aenter__("),
    (r"def __exit__\(", "async def __aexit__("),
    (r"self\.close\(\)", "await self.aclose()"),
    (r"def close\(", "async def aclose("),
    (r"self\._http\.close\(\)", "await self._http.aclose()"),
    (r"= self\._http\.request\(", "= await self._http.request("),
    (r"time\.sleep\(", "await asyncio.sleep("),
    (r"\bself\._send\(", "await self._send("),
    (r"\bself\.operation\(", "await self.operation("),
    (r"\bself\.is_ready\(\)", "await self.is_ready()"),
    (r"^    def (?!__init__)", "    async def "),
]


def generate() -> str:
    """The async client's source, formatted by ruff like every other file."""
    text = SOURCE.read_text()
    for pattern, repl in RULES:
        text = re.sub(pattern, repl, text, flags=re.MULTILINE)
    ruff = [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(TARGET), "-"]
    return subprocess.run(ruff, input=text, capture_output=True, text=True, check=True).stdout


def main() -> int:
    out = generate()
    if "--check" in sys.argv:
        if TARGET.read_text() != out:
            print(f"{TARGET} is stale: run python scripts/unasync.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
