"""One timeline of RL iterations on a real service with one vLLM engine (``paced``: synced on
demand): every operation once on the controller's row, each rank's nested spans and the
engine's, the trace the SDK sent on the ranks' and the engine's spans, and the results'
timings equal to the spans they were measured as."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from trainctl.api import SampleResult

from helpers.otlp import Receiver
from helpers.servicekit import Service

PROMPT = [1, 2, 3, 4]
LOSS = {"kind": "importance_sampling"}


def _rollouts(result: SampleResult) -> list:  # type: ignore[type-arg]
    completions = result.samples[0].completions
    return [c.sequence(PROMPT, advantage=(-1.0) ** i) for i, c in enumerate(completions)]


def _within(timing_s: float, span_us: float) -> bool:
    """A timing matches a span's length within 5% or 2 ms, whichever is larger."""
    span_s = span_us / 1e6
    return abs(timing_s - span_s) <= max(0.05 * span_s, 2e-3)


def test_two_rl_iterations_on_one_timeline(paced: Service) -> None:
    with paced.client() as tc:
        ranks = [f"rank {i}" for i in range(tc.info().world_size)]
        t0 = time.time()
        calls: list[dict[str, Any]] = []
        for _ in range(2):
            sampled = tc.sample([PROMPT], n=2, max_tokens=6, temperature=1.0)
            sample_trace = tc.last_trace_id
            trained = tc.train_batch(_rollouts(sampled), loss=LOSS)
            train_trace = tc.last_trace_id
            synced = tc.sync_weights()
            calls.append({"sample": sample_trace, "train": train_trace, "sync": synced,
                          "sync_trace": tc.last_trace_id, "result": trained})  # fmt: skip
        trace = tc.timeline(since=t0 - 1)
    rows = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    events = [{**e, "row": rows[e["pid"]]} for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {"gateway", "controller", "engine 0", *ranks} <= set(rows.values()), rows
    by_id = {e["args"]["span_id"]: e for e in events}

    def of(trace_id: str | None, row: str, name: str) -> list[dict[str, Any]]:
        assert trace_id is not None
        mine = [e for e in events if e["args"]["trace_id"] == trace_id]
        return [e for e in mine if e["row"] == row and e["name"] == name]

    def children(parent: dict[str, Any], name: str) -> list[dict[str, Any]]:
        return [e for e in events if e["args"].get("parent_id") == parent["args"]["span_id"]
                and e["name"] == name]  # fmt: skip

    # Every operation once on the controller's row: each of the 4 the SDK's calls made here
    # (the timeline may also hold an earlier test's, each once too).
    ops = Counter(e["args"]["op"] for e in events if e["row"] == "controller" and "op" in e["args"]
                  and e["name"] in ("train_batch", "sync_weights"))  # fmt: skip
    assert set(ops.values()) == {1}, ops
    traces = [t for c in calls for t in (c["train"], c["sync_trace"])]
    mine = {e["args"]["op"] for t in traces for name in ("train_batch", "sync_weights")
            for e in of(t, "controller", name)}  # fmt: skip
    assert len(mine) == 4, mine

    for call in calls:
        # A sample: the gateway's request, the controller's sample, the engine's with its queue
        # wait, prefill and decode, in the trace the SDK sent.
        [engine_sample] = of(call["sample"], "engine 0", "sample")
        for part in ("queue", "prefill", "decode"):
            [p] = children(engine_sample, part)
            assert p["ts"] >= engine_sample["ts"] - 1 and p["dur"] >= 0
        [controller_sample] = of(call["sample"], "controller", "sample")
        assert engine_sample["args"]["parent_id"] == controller_sample["args"]["span_id"]
        assert of(call["sample"], "gateway", "POST /v1/sample")

        # A step: each rank's call, its forward and backward per micro-batch nested in its
        # forward_backward, and the optimizer; the result's timings are those spans' lengths.
        result = call["result"]
        fb_lengths, opt_lengths = [], []
        for rank in ranks:
            [accumulate] = of(call["train"], rank, "accumulate")
            [fb] = children(accumulate, "forward_backward")
            assert children(fb, "forward") and children(fb, "backward"), rank
            fb_lengths.append(fb["dur"])
            [apply] = of(call["train"], rank, "apply")
            [opt] = children(apply, "optimizer")
            opt_lengths.append(opt["dur"])
        assert _within(result.timings["forward_backward_max_s"], max(fb_lengths)), result.timings
        assert _within(result.timings["optimizer_max_s"], max(opt_lengths)), result.timings
        [op_span] = of(call["train"], "controller", "train_batch")
        assert op_span["args"]["step"] == result.step
        [prepare] = of(call["train"], "controller", "prepare")  # at submit, before it queued
        [plan] = children(prepare, "plan")
        assert _within(result.timings["plan_s"], plan["dur"]), result.timings
        # The gateway's request: its body received, validated, the wait for the operation,
        # the answer.
        [request] = of(call["train"], "gateway", "POST /v1/train_batch")
        for part in ("receive", "validate", "wait", "answer"):
            assert children(request, part), part

        # A sync: the engine's load in the sync operation's trace, its wait for the turn, the
        # weights' transfer and their load.
        [engine_sync] = of(call["sync_trace"], "engine 0", "sync")
        assert engine_sync["args"]["step"] == call["sync"].step
        assert {c["name"] for c in events if c["args"].get("parent_id")
                == engine_sync["args"]["span_id"]} == {"wait", "transfer", "load"}  # fmt: skip
        assert of(call["sync_trace"], "rank 0", "export")  # the owner's weights, put
        [sync_op] = of(call["sync_trace"], "controller", "sync_weights")
        assert (
            by_id[engine_sync["args"]["parent_id"]]["args"]["trace_id"]
            == sync_op["args"]["trace_id"]
        )
    assert trace["otherData"]["dropped"] == 0


def test_every_process_exports_its_spans_over_otlp(paced: Service, paced_otlp: Receiver) -> None:
    """``--otlp-endpoint``: the gateway, the controller, the rank and the engine each send
    their spans to an OTLP/HTTP receiver (decoded here as the OpenTelemetry collector does),
    in the traces the SDK's calls started, under the service name ``trainctl``."""
    with paced.client() as tc:
        sampled = tc.sample([PROMPT], n=2, max_tokens=4, temperature=1.0)
        sample_trace = tc.last_trace_id
        tc.train_batch(_rollouts(sampled), loss=LOSS)
        train_trace = tc.last_trace_id
    want = {(row, sample_trace) for row in ("gateway", "controller", "engine 0")}
    want |= {(row, train_trace) for row in ("gateway", "controller", "rank 0")}
    deadline = time.monotonic() + 30  # each process's exporter sends a batch every 5 s
    while True:
        received = paced_otlp.received()
        got = {(s.row, s.trace_id) for s in received}
        if want <= got or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert want <= got, sorted(want - got)
    assert {s.service for s in received} == {"trainctl"}
    [op] = [s for s in received if s.trace_id == train_trace and s.name == "train_batch"]
    assert op.row == "controller" and str(op.attrs["op"]).startswith("op-")
