"""What the timeline's spans cost a training step: tracing off, the ring alone, the ring and
the OTLP exporter.

    python bench/tracing_overhead.py               # 12 rounds of 10 steps per service
    python bench/tracing_overhead.py --rounds 4 --steps 5

Starts three services of the embedded default (dp=2) side by side: `--trace-spans 0` (off),
the default ring (20,000 spans a process, no exporter), and the ring with `--otlp-endpoint`
pointed at an OTLP/HTTP receiver in this process (it reads each batch and answers 200, as a
collector does). Method: after 5 warm-up steps on each, rounds interleave the three, in a
rotating order: in each round every service trains `--steps` steps of the same batch
(`train_batch` through the SDK, 8 sequences of 64 tokens), and its round's number is the
mean seconds a step. A service's number is the median over the rounds; the ratio is that
median over the off service's. Prints a table and writes bench/results/tracing_overhead.md.
"""

from __future__ import annotations

import argparse
import http.server
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.tables.common import publish, table  # noqa: E402
from trainctl.local import LocalService  # noqa: E402

BATCH = [{"tokens": [(7 * i + j) % 500 + 1 for j in range(64)],
          "loss_mask": [0] * 8 + [1] * 56} for i in range(8)]  # fmt: skip


class Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that takes each batch of spans and answers 200."""

    batches = 0
    nbytes = 0

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Receiver.batches += 1
        Receiver.nbytes += len(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def steps(svc: LocalService, n: int) -> float:
    """Mean seconds a step over ``n`` steps."""
    with svc.client() as tc:
        t0 = time.perf_counter()
        for _ in range(n):
            tc.train_batch(BATCH)
        return (time.perf_counter() - t0) / n


def spans_per_step(svc: LocalService) -> int:
    """The spans of one step, on every process (the timeline of one more step)."""
    with svc.client() as tc:
        t0 = time.time()
        tc.train_batch(BATCH)
        trace_id = tc.last_trace_id
        found = tc.timeline(since=t0 - 0.5)
    return sum(1 for e in found["traceEvents"] if e["ph"] == "X"
               and e["args"].get("trace_id") == trace_id)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    otlp = f"http://127.0.0.1:{server.server_port}"
    configs = {"off": ("--trace-spans", "0"), "ring": (), "ring + OTLP": ("--otlp-endpoint", otlp)}
    times: dict[str, list[float]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory(prefix="trainctl-tracing-") as tmp:
        services = {
            name: LocalService(Path(tmp) / name.replace(" + ", "-"), *flags, start_timeout_s=600)
            for name, flags in configs.items()
        }
        try:
            for svc in services.values():
                svc.start()
            for svc in services.values():
                steps(svc, 5)  # warm-up
            names = list(configs)
            for r in range(args.rounds):
                order = names[r % 3 :] + names[: r % 3]
                for name in order:
                    times[name].append(steps(services[name], args.steps))
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{n} {times[n][-1] * 1e3:.1f} ms" for n in names), flush=True)  # fmt: skip
            counted = {name: spans_per_step(svc) for name, svc in services.items()}
        finally:
            for svc in services.values():
                svc.stop()
    off = statistics.median(times["off"])
    rows = []
    for name in configs:
        med = statistics.median(times[name])
        q = statistics.quantiles(times[name], n=4)
        rows.append([name, f"{med * 1e3:.1f}", f"{q[0] * 1e3:.1f} - {q[2] * 1e3:.1f}",
                     f"{med / off:.3f}", str(counted[name])])  # fmt: skip
    text = table(
        ["tracing", "step ms (median of rounds)", "IQR ms", "ratio to off", "spans a step"],
        rows,
    )
    text += (
        f"\n\n{args.rounds} interleaved rounds of {args.steps} `train_batch` steps (8 x 64 "
        "tokens, embedded default, dp=2, 2 CPU cores; the three services run side by side, "
        f"one at a time); the OTLP receiver took {Receiver.batches} batches "
        f"({Receiver.nbytes / 1e3:.0f} kB)."
    )
    publish(text, "tracing_overhead", keep=args.rounds >= 10)


if __name__ == "__main__":
    main()
