"""``trainctl``: the command line. ``serve`` starts the service; the rest talk to one.

    trainctl info
    trainctl train-batch batch.jsonl [--loss-kind ppo ...] [--expected-step N] [--packing tree]
    trainctl eval-batch batch.jsonl
    trainctl logprobs batch.jsonl [--entropy] [-o out.jsonl]
    trainctl memory-profile start|stop|list
    trainctl memory-profile download PROFILE_ID [-o DIR]   (files go to DIR/PROFILE_ID/)
    trainctl checkpoint save|list|load [CHECKPOINT_ID] [--owner O] [--adapter A]
    trainctl export-hf [--name NAME]

A batch file has one JSON sequence per line (``{"tokens": [...], "loss_mask": [...], ...}``).
Long calls run as operations with a progress line on stderr. ``--url`` / ``TRAINCTL_URL`` and
``--token`` / ``TRAINCTL_API_TOKEN`` say where and as whom. Only the SDK's dependencies are
needed, except for ``serve``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
import typing
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainctl.api import LossConfig, Operation, OperationKind, SamplingParams
from trainctl.api.errors import TrainctlError, validation_problem
from trainctl.clients.sync import TrainctlClient

_SPINNER = "|/-\\"


def read_batch(path: str) -> list[dict[str, Any]]:
    """One sequence per line of ``path`` (``-``: standard input); blank lines skipped."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"trainctl: {path}:{n}: not JSON: {e}") from None
    if not out:
        raise SystemExit(f"trainctl: {path}: no sequences")
    return out


class Progress:
    """One status line on stderr, redrawn in place on a terminal, every 10 s otherwise."""

    def __init__(self, stream: Any = sys.stderr) -> None:
        self.stream, self.t0, self.n, self.last = stream, time.monotonic(), 0, 0.0
        self.tty = stream.isatty()

    def __call__(self, op: Operation) -> None:
        elapsed = time.monotonic() - self.t0
        state = op.phase or op.status.value
        if op.queue_position:
            state = f"queued ({op.queue_position} ahead)"
        line = f"{_SPINNER[self.n % 4]} {op.kind} {op.id}: {state}  {elapsed:5.1f}s"
        self.n += 1
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if op.finished:
                self.stream.write("\n")
        elif op.finished or elapsed - self.last >= 10:
            self.stream.write(line + "\n")
            self.last = elapsed
        self.stream.flush()


def _print(model: Any) -> None:
    print(model.model_dump_json(indent=2))


def _run_operation(c: TrainctlClient, kind: OperationKind, batch: list[Any], **kwargs: Any) -> Any:
    progress = Progress()
    op = c.submit(kind, batch, **kwargs)
    progress(op)
    return c.wait(op, on_update=progress)


def _loss(args: argparse.Namespace) -> LossConfig:
    return LossConfig(**{name: getattr(args, f"loss_{name}") for name in LossConfig.model_fields})


def _add_packing_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--packing",
        choices=["flat", "tree"],
        default=None,
        help="tree: compute prefixes shared by several sequences once (default: the server's)",
    )


def _client_commands(args: argparse.Namespace, c: TrainctlClient) -> int:
    if args.command == "info":
        _print(c.info())
    elif args.command == "train-batch":
        batch = read_batch(args.file)
        kw = {"loss": _loss(args), "expected_step": args.expected_step, "packing": args.packing}
        _print(_run_operation(c, OperationKind.TRAIN_BATCH, batch, **kw))
    elif args.command == "eval-batch":
        batch = read_batch(args.file)
        kw = {"loss": _loss(args), "packing": args.packing}
        _print(_run_operation(c, OperationKind.EVAL_BATCH, batch, **kw))
    elif args.command == "logprobs":
        result = _run_operation(
            c,
            OperationKind.LOGPROBS,
            read_batch(args.file),
            entropy=args.entropy,
            packing=args.packing,
        )
        out = open(args.output, "w") if args.output != "-" else sys.stdout  # noqa: SIM115
        try:
            for i, lp in enumerate(result.logprobs):
                row: dict[str, Any] = {"logprobs": lp}
                if result.entropy is not None:
                    row["entropy"] = result.entropy[i]
                out.write(json.dumps(row) + "\n")
        finally:
            if out is not sys.stdout:
                out.close()
    elif args.command == "memory-profile":
        return _memory_profile(args, c)
    elif args.command == "checkpoint":
        if args.action == "save":  # CHECKPOINT_ID: its name (default: step-NNNNNN)
            _print(c.save_checkpoint(args.checkpoint_id, adapter=args.adapter, owner=args.owner))
        elif args.action == "list":
            for ck in c.list_checkpoints(owner=args.owner).checkpoints:
                alone = f"  adapter {ck.adapter}" if ck.adapter else ""
                where = " x ".join(f"{k}{v}" for k, v in ck.layout.items() if v > 1) or "dp1"
                print(
                    f"{ck.checkpoint_id}  step {ck.step}  {ck.size_bytes / 2**20:.1f} MiB  "
                    f"{ck.format} from {where}{alone}"
                )
        else:
            if not args.checkpoint_id:
                raise SystemExit("trainctl: checkpoint load needs a CHECKPOINT_ID")
            _print(c.load_checkpoint(args.checkpoint_id, adapter=args.adapter, owner=args.owner))
    elif args.command == "export-hf":
        _print(c.export_hf(args.name))
    elif args.command == "sample":
        return _sample(args, c)
    elif args.command == "sync-weights":
        _print(c.sync_weights())
    elif args.command == "timeline":
        trace = c.timeline(since=args.since, until=args.until)
        Path(args.output).write_text(json.dumps(trace))
        shown = trace.get("otherData", {})
        print(f"{args.output}: {shown.get('spans', 0)} spans ({shown.get('dropped', 0)} dropped "
              "from full rings); open it in https://ui.perfetto.dev")  # fmt: skip
    elif args.command == "ready":
        ok = c.is_ready(instance=args.instance)
        print("ready" if ok else f"not ready: {args.url} does not answer as a ready trainctl")
        return 0 if ok else 1
    return 0


def _memory_profile(args: argparse.Namespace, c: TrainctlClient) -> int:
    if args.action == "start":
        _print(c.start_memory_profile(args.max_entries))
    elif args.action == "stop":
        _print(c.stop_memory_profile())
    elif args.action == "list":
        for p in c.list_memory_profiles().profiles:
            size = sum(f.size_bytes for f in p.files)
            print(f"{p.profile_id}  {len(p.files)} rank file(s)  {size / 2**20:.1f} MiB")
    elif args.action == "download":
        if not args.profile_id:
            raise SystemExit("trainctl: memory-profile download needs a PROFILE_ID")
        profile = next(
            (p for p in c.list_memory_profiles().profiles if p.profile_id == args.profile_id),
            None,
        )
        if profile is None:
            raise SystemExit(f"trainctl: no memory profile {args.profile_id!r}")
        target = Path(args.output) / args.profile_id
        names = [n for f in profile.files for n in (f.name, f.picture) if n]
        bad = [n for n in names if not _SAFE_FILE_NAME.fullmatch(n)]
        if bad:  # the server names the files: never let it pick a path
            raise SystemExit(f"trainctl: refusing the server's file name {bad[0][:80]!r}")
        print(f"downloading {len(names)} file(s) into {target.resolve()}/", file=sys.stderr)
        target.mkdir(parents=True, exist_ok=True)
        for name in names:
            (target / name).write_bytes(c.download_profile_file(args.profile_id, name))
            print(target / name)
    return 0


_SAFE_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
"""A downloaded file's name: one plain path component, never '..', '/' or a NUL."""


def _add_loss_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ``LossConfig`` field, so a new loss option is a flag without a line here:
    ``--loss-kind``, ``--normalization``, ``--clip-low``, ``--tis-cap``, ..."""
    for name, f in LossConfig.model_fields.items():
        flag = "--loss-kind" if name == "kind" else f"--{name.replace('_', '-')}"
        kw: dict[str, Any] = {"dest": f"loss_{name}", "default": f.default, "metavar": "X"}
        args = typing.get_args(f.annotation) or (f.annotation,)
        enum = next((a for a in args if isinstance(a, type) and issubclass(a, Enum)), None)
        if enum is not None:
            kw["choices"] = [m.value for m in enum]
            kw["default"], kw["metavar"] = f.default.value, None
        elif float in args:
            kw["type"] = float
        text = f.description or ((enum.__doc__ or "").splitlines()[0] if enum else "")
        p.add_argument(flag, help=text.replace("%", "%%"), **kw)


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ``SamplingParams`` field: ``--n``, ``--max-tokens``, ``--temperature``,
    ``--stop-token-ids 2 7``, ``--prompt-logprobs``, ..."""
    for name, f in SamplingParams.model_fields.items():
        flag = f"--{name.replace('_', '-')}"
        args = typing.get_args(f.annotation) or (f.annotation,)
        text = (f.description or "").replace("%", "%%")
        if bool in args:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           help=text)  # fmt: skip
        elif f.default_factory is not None:  # a list of ints
            p.add_argument(flag, type=int, nargs="*", default=[], metavar="ID", help=text)
        else:
            kind = float if float in args else int
            p.add_argument(flag, type=kind, default=f.default, metavar="X", help=text)


def _sample(args: argparse.Namespace, c: TrainctlClient) -> int:
    """Prompts from a JSONL file (a list of token ids, or ``{"tokens": [...]}`` per line);
    one JSON line per prompt out, with the policy step of the weights that sampled it."""
    prompts = [p["tokens"] if isinstance(p, dict) else p for p in read_batch(args.file)]
    params = {name: getattr(args, name) for name in SamplingParams.model_fields}
    result = c.sample(prompts, expected_step=args.expected_step, **params)
    for i, s in enumerate(result.samples):
        row = {"prompt": i, "step": result.step, **s.model_dump(exclude_none=True)}
        print(json.dumps(row))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainctl", description=__doc__.split("\n")[0])
    p.add_argument("--url", default=os.environ.get("TRAINCTL_URL", "http://127.0.0.1:8000"))
    p.add_argument("--token", default=os.environ.get("TRAINCTL_API_TOKEN"), help="bearer token")
    p.add_argument("--json", action="store_true", help="send JSON instead of the binary format")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="start the service (see 'trainctl serve --help')", add_help=False)
    sub.add_parser("info", help="what is being served: model, layout, step, weights digest")
    for name, what in (("train-batch", "one optimizer step"), ("eval-batch", "the loss only")):
        q = sub.add_parser(name, help=f"{what} on a JSONL batch")
        q.add_argument("file", help="JSONL, one sequence per line ('-': stdin)")
        _add_loss_flags(q)
        _add_packing_flag(q)
        if name == "train-batch":
            q.add_argument("--expected-step", type=int, default=None)
    q = sub.add_parser("logprobs", help="per-token log-probs of a JSONL batch")
    q.add_argument("file")
    q.add_argument("--entropy", action="store_true")
    _add_packing_flag(q)
    q.add_argument("-o", "--output", default="-", help="JSONL output (default: stdout)")
    q = sub.add_parser("memory-profile", help="start, stop, list or download memory profiles")
    q.add_argument("action", choices=["start", "stop", "list", "download"])
    q.add_argument("profile_id", nargs="?")
    q.add_argument("--max-entries", type=int, default=100_000)
    q.add_argument(
        "-o",
        "--output",
        "-d",
        "--dir",
        dest="output",
        default=".",
        metavar="DIR",
        help="download: write the files into DIR/PROFILE_ID/ (default: ./PROFILE_ID/)",
    )
    q = sub.add_parser("checkpoint", help="save, list or load training checkpoints")
    q.add_argument("action", choices=["save", "list", "load"])
    q.add_argument("checkpoint_id", nargs="?", help="load: which; save: its name")
    q.add_argument("--owner", default=None, help="the names of this model or adapter")
    q.add_argument("--adapter", default=None, help="save or load this LoRA adapter alone")
    q = sub.add_parser("export-hf", help="write the model as a Hugging Face checkpoint")
    q.add_argument("--name", default=None, help="directory name under the export root")
    q = sub.add_parser("sample", help="completions of JSONL token-id prompts (--samplers)")
    q.add_argument("file", help='JSONL, one prompt per line: [ids] or {"tokens": [ids]}')
    _add_sampling_flags(q)
    q.add_argument("--expected-step", type=int, default=None,
                   help="refuse unless the samplers serve this step")  # fmt: skip
    sub.add_parser("sync-weights", help="send the current weights to the samplers now")
    q = sub.add_parser("timeline", help="recent spans of every process, as a Perfetto trace")
    q.add_argument("output", help="where to write the Chrome trace JSON")
    q.add_argument("--since", type=float, default=None, help="Unix seconds (default: until-60)")
    q.add_argument("--until", type=float, default=None, help="Unix seconds (default: now)")
    q = sub.add_parser(
        "ready",
        help="exit 0 if trainctl (not just anything) answers ready at --url: a probe",
    )
    q.add_argument("--instance", default=None, help="and it is this start of it")
    return p


def _serve(argv: list[str]) -> int:
    try:
        from trainctl.service.cli import main as serve_main
    except ImportError as e:  # a bare SDK install: no torch, Ray or FastAPI
        print(
            f"trainctl: 'trainctl serve' needs the server extra (missing: {e.name or e}); "
            "install it with: pip install 'trainctl[server]'",
            file=sys.stderr,
        )
        return 2
    return serve_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return _serve(argv)
    args = parser().parse_args(argv)
    try:
        with TrainctlClient(args.url, api_token=args.token, binary=not args.json) as c:
            rc = _client_commands(args, c)
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
        return rc
    except TrainctlError as e:
        print(f"trainctl: {e}", file=sys.stderr)
        return 1
    except ValidationError as e:  # refused here, before anything was sent
        for err in e.errors(include_url=False):
            where = ".".join(str(p) for p in err["loc"]) or "request"
            print(f"trainctl: {where}: {validation_problem(err)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader left (`trainctl info | head`): stop quietly, as a Unix tool does, and
        # keep Python from complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
