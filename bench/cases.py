"""The measured workloads. Each function runs inside a fresh child process (see run.py)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from bench.memory import MIB, PeakRSS
from trainctl.service.cluster import free_port
from trainctl.workers.ops import logprob as lp_ops
from trainctl.workers.ops.logprob import vocab_parallel_logprob


class _ListCatLogprob(torch.autograd.Function):
    """The upstream shape this project avoids: chunked, but backward lists chunks and cats."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, chunk: int) -> torch.Tensor:
        local, outside = lp_ops._local_target(target, 0, logits.shape[-1])
        out = torch.cat(
            [
                lp_ops._pick(
                    lp_ops._log_softmax(logits[a : a + chunk].float(), None),
                    local[a : a + chunk],
                    outside[a : a + chunk],
                )
                for a in range(0, logits.shape[0], chunk)
            ]
        )
        ctx.save_for_backward(logits, local, outside)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, local, outside = ctx.saved_tensors
        parts = []
        for a in range(0, logits.shape[0], ctx.chunk):
            b = a + ctx.chunk
            p = lp_ops._log_softmax(logits[a:b].float(), None).exp_()
            parts.append(lp_ops._grad_rows(p, g[a:b], local[a:b], outside[a:b]))
        return torch.cat(parts), None, None


def logprob_case(variant: str, n: int, v: int, chunks: int, repeats: int) -> dict[str, float]:
    """Peak RSS of forward+backward above the inputs, in units of G = n * v * 4 bytes."""
    torch.manual_seed(0)
    logits = torch.randn(n, v)
    target = torch.randint(0, v, (n,))
    seed = torch.rand(n)
    cs = -(-n // chunks)

    def run() -> None:
        x = logits.requires_grad_()
        if variant == "streamed":
            lp = vocab_parallel_logprob(x, target, chunk_size=cs)
        elif variant == "list_cat":
            lp = _ListCatLogprob.apply(x, target, cs)
        else:
            lp = vocab_parallel_logprob(x, target, chunk_size=0)
        lp.backward(seed)
        x.grad = None

    run()  # warm-up: allocator and autograd structures
    with PeakRSS() as m:
        run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    g_bytes = n * v * 4
    return {
        "peak_over_G": m.peak_above_start / g_bytes,
        "G_MiB": g_bytes / MIB,
        "time_s": statistics.median(times),
    }


def fused_head_case(variant: str, n: int, h: int, v: int, chunk: int) -> dict[str, float]:
    """Peak RSS above the inputs of the LM head + log-prob, forward + backward: ``fused``
    (logits one chunk at a time) or ``unfused`` (all logits, then the streamed kernel). Both
    include the fp32 gradient buffers of the hidden states ``[n, h]`` and the weight
    ``[v, h]``, the same for both."""
    from trainctl.workers.ops.fused_head import fused_head_logprob, head_logits

    torch.manual_seed(0)
    hidden = torch.randn(n, h).requires_grad_()
    weight = (torch.randn(v, h) * 0.05).requires_grad_()
    target = torch.randint(0, v, (n,))
    seed = torch.rand(n)
    rows = torch.arange(n)

    def run() -> None:
        if variant == "fused":
            lp = fused_head_logprob(hidden, weight, target, rows=rows, chunk_size=chunk)
        else:
            lp = vocab_parallel_logprob(head_logits(hidden, weight, rows), target, chunk_size=chunk)
        lp.backward(seed)
        hidden.grad = weight.grad = None

    with PeakRSS() as m:
        t0 = time.perf_counter()
        run()
        elapsed = time.perf_counter() - t0
    grads = (n * h + v * h) * 4
    return {"peak_MiB": m.peak_above_start / MIB, "grads_MiB": grads / MIB, "time_s": elapsed}


# -- CP-local loss vs gather-then-loss ------------------------------------------------------


def _cp_rank(rank: int, world: int, port: int, variant: str, t: int, v: int, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(rank)
    t_loc = t // world
    local = torch.randn(t_loc, v, requires_grad=True)
    labels = torch.randint(0, v, (t_loc,))
    scale = torch.full((t_loc,), 1.0 / t, dtype=torch.float64)
    sent = 0
    with PeakRSS() as m:
        if variant == "cp_local":
            lp = vocab_parallel_logprob(local, labels, chunk_size=1024)
            loss = -(lp * scale).sum()
            loss.backward()
            report = loss.detach().clone()
            dist.all_reduce(report)  # the only communication: one scalar for the report
            sent += report.numel() * report.element_size()
        else:  # gather logits (and labels), compute the loss on the whole sequence
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local.detach())
            sent += local.numel() * local.element_size() * (world - 1)
            full = torch.cat(parts).requires_grad_()
            all_labels = [torch.empty_like(labels) for _ in range(world)]
            dist.all_gather(all_labels, labels)
            sent += labels.numel() * labels.element_size() * (world - 1)
            lp = vocab_parallel_logprob(full, torch.cat(all_labels), chunk_size=1024)
            (-(lp.double() / t).sum()).backward()
            grad = full.grad[rank * t_loc : (rank + 1) * t_loc].clone()  # own rows back
            del full, parts, lp
            local.backward(grad)
    out.put((rank, m.peak_above_start, sent))
    dist.destroy_process_group()


def cp_loss_case(variant: str, cp: int, t: int, v: int) -> dict[str, float]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_cp_rank, args=(r, cp, port, variant, t, v, out)) for r in range(cp)
    ]
    for p in procs:
        p.start()
    res = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    peak = max(r[1] for r in res)
    sent = max(r[2] for r in res)
    return {"peak_MiB": peak / MIB, "bytes_sent": float(sent), "full_logits_MiB": t * v * 4 / MIB}


# -- train-step throughput of the embedded model ---------------------------------------------


def _step_rank(
    rank: int,
    world: int,
    port: int,
    layout: dict[str, int],
    n_seqs: int,
    seq_len: int,
    steps: int,
    out: Any,
) -> None:
    import numpy as np

    from trainctl.api import TokenSequence
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import EngineConfig, ParallelLayout
    from trainctl.workers.engine.shard import EngineShard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    eng = EngineShard(EngineConfig(layout=ParallelLayout(**layout)))
    rng = np.random.default_rng(0)
    seqs = [
        TokenSequence(
            tokens=rng.integers(0, 512, seq_len).astype(np.int64),
            loss_mask=np.ones(seq_len, np.float32),
        )
        for _ in range(n_seqs)
    ]
    plan = plan_step(seqs, eng.cfg)
    mbs = plan.microbatches[eng.coords.dp]
    eng.train_batch(mbs, plan.loss)  # warm-up
    rows = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        fwd = eng.eval_batch(mbs, plan.loss).timings["forward_s"]
        dist.barrier()
        t1 = time.perf_counter()
        rep = eng.train_batch(mbs, plan.loss)
        dist.barrier()
        rows.append(
            {
                "step_s": time.perf_counter() - t1,
                "forward_s": fwd,
                **rep.timings,
                "eval_wall_s": t1 - t0,
            }
        )
    out.put((rank, rows))
    dist.destroy_process_group()


def activation_case(recompute: str, tokens: int) -> dict[str, float]:
    """Peak RSS above the start of one forward/backward of a single ``tokens``-long sequence
    (4 layers, hidden 256, 4 heads), after a warm-up step: the activations kept for
    backward and what backward recomputes and frees."""
    from trainctl.workers.engine.config import EngineConfig, ModelConfig
    from trainctl.workers.engine.shard import EngineShard

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    model = ModelConfig(
        num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=4,
        ffn_hidden_size=1024, max_seq_len=tokens,
    )  # fmt: skip
    cfg = EngineConfig(model=model, recompute=recompute, max_tokens_per_microbatch=tokens)  # type: ignore[arg-type]
    r = one_sequence_peak(EngineShard(cfg), tokens)
    dist.destroy_process_group()
    return r


def one_sequence_peak(eng: Any, tokens: int) -> dict[str, float]:
    """Peak RSS above the start (MiB), seconds and loss of one forward/backward of one random
    ``tokens``-long sequence on ``eng``, after a warm-up pass (every rank of its group)."""
    import numpy as np

    from trainctl.api import TokenSequence
    from trainctl.workers.control.plan import plan_step

    seq = TokenSequence(
        tokens=np.random.default_rng(0).integers(0, 512, tokens).astype(np.int64),
        loss_mask=np.ones(tokens, np.float32),
    )
    plan = plan_step([seq], eng.cfg)
    mbs = plan.microbatches[eng.coords.dp]
    eng.train_pass(mbs, plan.loss)  # warm-up
    eng.optim.zero_grad()
    dist.barrier()
    with PeakRSS() as m:
        t0 = time.perf_counter()
        loss = eng.train_pass(mbs, plan.loss).loss
        elapsed = time.perf_counter() - t0
    return {"peak_MiB": m.peak_above_start / MIB, "time_s": elapsed, "loss": loss}


def step_case(layout: dict[str, int], n_seqs: int, seq_len: int, steps: int) -> dict[str, float]:
    """Median step time split into forward, backward, gradient sync and optimizer."""
    import multiprocessing as mp

    world = 1
    for axis in ("dp", "cp", "tp", "pp"):
        world *= layout.get(axis, 1)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_step_rank, args=(r, world, port, layout, n_seqs, seq_len, steps, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    res = dict(out.get(timeout=1200) for _ in procs)
    for p in procs:
        p.join()

    def med(key: str) -> float:  # the slowest rank sets the pace of each step
        return statistics.median(max(res[r][i][key] for r in res) for i in range(steps))

    step, fb, fwd = med("step_s"), med("forward_backward_s"), med("forward_s")
    return {
        "tokens_per_s": n_seqs * seq_len / step,
        "step_s": step,
        "forward_s": fwd,
        "backward_s": fb - fwd - med("grad_sync_s"),
        "grad_sync_s": med("grad_sync_s"),
        "optimizer_s": med("optimizer_s"),
    }


# -- training state per parameter: precision x ZeRO x dp --------------------------------------


def _state_rank(
    rank: int, dp: int, port: int, precision: str, zero: str, model: dict[str, int], out: Any
) -> None:
    import numpy as np

    from bench.memory import _status
    from trainctl.api import TokenSequence
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import EngineConfig, ModelConfig, ParallelLayout
    from trainctl.workers.engine.shard import EngineShard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=dp)
    cfg = EngineConfig(
        model=ModelConfig(**model),
        layout=ParallelLayout(dp=dp),
        precision=precision,  # type: ignore[arg-type]
        distributed_optimizer=zero,  # type: ignore[arg-type]
        max_tokens_per_microbatch=model["max_seq_len"],
    )
    seqs = [
        TokenSequence(
            tokens=np.random.default_rng(i).integers(0, 512, 64).astype(np.int64),
            loss_mask=np.ones(64, np.float32),
        )
        for i in range(dp)
    ]
    start = _status("VmRSS")
    eng = EngineShard(cfg)
    plan = plan_step(seqs, eng.cfg)
    eng.train_batch(plan.microbatches[eng.coords.dp], plan.loss)  # Adam's moments now exist
    rss = _status("VmRSS") - start

    # The same state, read off the live tensors (each storage once: views share one).
    seen: dict[int, int] = {}

    def add(t: torch.Tensor) -> int:
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            return 0
        seen[s.data_ptr()] = s.nbytes()
        return s.nbytes()

    params = sum(add(p) for c in eng.chunks for p in c.module.parameters())
    grads = sum(add(p.main_grad) for c in eng.chunks for p in c.module.parameters())
    masters = sum(add(p) for g in eng.optim.optimizer.param_groups for p in g["params"])
    adam = sum(
        add(t)
        for o in getattr(eng.optim.optimizer, "chained_optimizers", [eng.optim.optimizer])
        for st in o.optimizer.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    n = eng.num_parameters()
    out.put((rank, {"n": n, "rss": rss, "params": params, "grads": grads, "masters": masters,
                    "adam": adam}))  # fmt: skip
    dist.destroy_process_group()


def state_bytes_case(dp: int, precision: str, zero: str) -> dict[str, float]:
    """Bytes per parameter a rank holds for training (after one step): resident-set growth
    from before the engine was built, and the same read off its tensors by kind."""
    import multiprocessing as mp

    model = {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
             "num_query_groups": 8, "ffn_hidden_size": 2048, "vocab_size": 8192,
             "max_seq_len": 128}  # fmt: skip
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_state_rank, args=(r, dp, port, precision, zero, model, out))
        for r in range(dp)
    ]
    for p in procs:
        p.start()
    res = [r for _, r in sorted(out.get(timeout=900) for _ in procs)]
    for p in procs:
        p.join()
    worst = max(res, key=lambda r: r["rss"])  # ranks' shards differ by a bucket's padding
    n = worst["n"]
    return {
        "parameters": float(n),
        "rss_per_param": worst["rss"] / n,
        **{
            f"{k}_per_param": max(r[k] for r in res) / n
            for k in ("params", "grads", "masters", "adam")
        },
    }
