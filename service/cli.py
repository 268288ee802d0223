"""``trainctl serve``: starts the whole service (the other subcommands: ``clients/cli.py``).

``serve`` starts (or joins) a Ray cluster, creates the controller actor, which creates one rank
actor per rank and builds the megatron-core shards, then deploys the HTTP gateway on Ray Serve
and prints its URL. SIGINT or SIGTERM drains the operation in flight and shuts Serve and Ray
down (Kubernetes stops pods with SIGTERM, which ``serve run`` would not survive).

One concern, at its length: the life of ``serve``, from flags to a drained exit. Its
parts (settings, launch, cluster, the Serve deployment) are modules of their own.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any

from pydantic import ValidationError

from trainctl.api import Info
from trainctl.api.errors import validation_problem
from trainctl.service import ray_auth
from trainctl.service.cluster import HEAD_ATTEMPTS, LocalRayHead
from trainctl.service.ray_auth import StartupError
from trainctl.service.settings import Settings
from trainctl.service.tenants import read_keys
from trainctl.workers.rank import logs

log = logging.getLogger("trainctl.serve")


def _add_settings_flags(p: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and extra.get("cli") is False:
            continue
        flag = "--" + name.replace("_", "-")
        env = f"TRAINCTL_{name.upper()}"
        help_ = f"{field.description} [env {env}; default {field.default}]"
        p.add_argument(flag, dest=name, default=None, help=help_)


def _settings_from(args: argparse.Namespace) -> Settings:
    fields = Settings.model_fields
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if "api_token" in overrides:
        log.warning(
            "--api-token is visible to every local user in the process list; prefer "
            "TRAINCTL_API_TOKEN or --api-token-file"
        )
    return Settings(**overrides)


def serve_main(s: Settings) -> int:
    """Run the service until SIGINT/SIGTERM; a start-up failure is one line on stderr."""
    try:
        return _serve(s)
    except StartupError as e:
        print(f"trainctl: {e}", file=sys.stderr)
        return 2


def _reserve_port(host: str, port: int) -> socket.socket | None:
    """Bind the gateway's port now and hold it until the gateway takes it: nothing started
    in between (the Ray head's daemons) can take it. A port already in use is a one-line
    error. ``SO_REUSEADDR``: a restart on the same port is not refused for the minute the old
    connections sit in TIME-WAIT (a port someone listens on is still refused)."""
    if port == 0:
        return None
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(
            f"cannot listen on {host}:{port} ({e.strerror}); stop what holds the port "
            "or pass another --port"
        ) from None
    return sock


def _check_own_port(
    url: str, instance: str, stop: threading.Event | None = None, timeout_s: float = 30.0
) -> None:
    """The gateway's port must answer as this start of trainctl, not as anything else.

    Liveness (``/v1/health``, the gateway alone), not readiness: a trainctl that is not ready
    (a rank lost at once) is still this service. Only an answer from someone else is fatal;
    no answer is retried until ``timeout_s`` and then left to the readiness checks.
    """
    import httpx

    from trainctl.api import Health

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = httpx.get(f"{url}/v1/health", timeout=10)
        except httpx.HTTPError as e:
            if stop is not None and stop.is_set():
                return  # asked to stop: the drain follows
            if time.monotonic() > deadline:
                log.warning("%s did not answer its health check (%s); going on", url, e)
                return
            time.sleep(0.5)
            continue
        try:
            health = Health.model_validate_json(r.content)
        except ValueError:
            health = None
        if r.status_code == 200 and health is not None and health.instance == instance:
            return
        raise StartupError(
            f"{url} does not answer as this trainctl service (instance {instance}); "
            "another server may hold the port: stop it or pass another --port"
        )


def _check_reachable(address: str) -> None:
    """A ``host:port`` cluster address must accept a TCP connection: ``ray.init`` against a
    dead address retries for many minutes before it says anything."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto", "ray://..." (Ray Client) and the like: left to Ray
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as e:
        raise StartupError(
            f"cannot reach the Ray cluster at {address} ({e.strerror or e}); check "
            "--ray-address and that the cluster is running"
        ) from None


def _check_sampler_stack(s: Settings) -> None:
    """``--samplers`` on this machine's Ray needs its backend installed here: say so in one
    line at start, rather than as a sampler actor's traceback once the ranks are built."""
    from trainctl.workers.sampler import backend

    if s.samplers and not s.ray_address:
        missing = backend.load(s.sampler_backend).missing()
        if missing:
            raise StartupError(
                f"--samplers {s.samplers} (--sampler-backend {s.sampler_backend}) {missing}"
            )


def _check_keys_on_hangup(s: Settings) -> None:
    """SIGHUP: read the tenant keys file again and log what the gateway will make of it (it
    reads the file again itself once it changes, failing closed: ``service/tenants.py``)."""

    def check(_signum: int, _frame: Any) -> None:
        try:
            keys, problems = (
                read_keys(s.api_keys.read_text(), str(s.api_keys)) if s.api_keys else ({}, [])
            )
        except OSError as e:
            log.error("SIGHUP: the tenant keys file cannot be read (%s): every tenant's key "
                      "is revoked until it can", e)  # fmt: skip
            return
        for problem in problems:
            log.error("SIGHUP: %s: this line grants nothing", problem)
        if s.api_keys and not keys:
            log.error("SIGHUP: the tenant keys file holds no key: every tenant's key is revoked")
            return
        log.info("SIGHUP: tenant keys file holds %d tenant(s)", len(set(keys.values())))

    signal.signal(signal.SIGHUP, check)


def _serve(s: Settings) -> int:
    _check_sampler_stack(s)
    try:
        s.token()
        keys = s.tenant_keys()
    except OSError as e:
        raise StartupError(f"cannot read {e.filename}: {e.strerror}") from None
    except ValueError as e:
        raise StartupError(str(e)) from None
    if keys is not None:
        log.info("tenant keys: %d tenant(s) from %s", len(set(keys.values())), s.api_keys)
        _check_keys_on_hangup(s)
    exposed = s.exposure_warning()
    if exposed:
        log.warning("%s", exposed)
    reservation = _reserve_port(s.host, s.port)
    instance = s.instance_id or uuid.uuid4().hex[:16]
    # Before Ray is imported: its C++ core reads the auth mode once.
    if s.ray_address:
        _check_reachable(s.ray_address)
        source = ray_auth.joining_token()
        if source is None:
            log.warning(
                "joining %s without a Ray auth token (none in $%s, $%s or %s)",
                s.ray_address,
                ray_auth.TOKEN_ENV,
                ray_auth.PATH_ENV,
                ray_auth.HOME_TOKEN,
            )
        else:
            log.info("joining %s with the Ray auth token from %s", s.ray_address, source)
    else:
        log.info("Ray token authentication: token from %s", ray_auth.own_cluster_token(s.data_dir))
    import ray
    from ray import serve

    from trainctl.service import deployment, launch
    from trainctl.service.deployment import APP_NAME
    from trainctl.workers.engine.config import ConfigError

    try:
        cfg = launch.engine_config(s)
    except OSError as e:
        raise StartupError(f"cannot read {e.filename}: {e.strerror}") from None
    except (ConfigError, TypeError, ValueError) as e:
        raise StartupError(f"invalid configuration: {_first_line(e)}") from None

    stop = threading.Event()
    started = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        log.info("received %s: draining and shutting down", signal.Signals(signum).name)
        stop.set()
        if not started.is_set():
            raise KeyboardInterrupt

    if s.exit_with_pid is not None:
        _watch_parent(s.exit_with_pid, stop)
    t0 = time.perf_counter()
    controller = None
    head: LocalRayHead | None = None
    try:
        # Ours before ray.init, so a signal while connecting stops start-up; and again after:
        # Ray's core worker installs a SIGTERM handler that aborts the process, and ours
        # replaces it so a SIGTERM drains instead.
        _handle_signals(_on_signal)
        if s.ray_address:
            _connect(s.ray_address, None, timeout_s=0.0)
        else:
            head = LocalRayHead(
                num_cpus=s.num_cpus,
                log_path=s.data_dir.resolve() / "ray-head.log",
                worker_ports=s.ray_worker_ports,
            )
            _start_head(head)
        _handle_signals(_on_signal)
        try:
            controller = launch.create_controller(s, cfg, detached=False)
        except ConfigError as e:
            raise StartupError(f"invalid configuration: {_first_line(e)}") from None
        log.info("building %d rank(s): %s", cfg.layout.world_size, cfg.layout.describe())
        try:
            info: Info = ray.get(controller.start.remote())
        except ray.exceptions.RayTaskError as e:
            raise StartupError(f"could not start the workers: {e.cause}") from None
        log.info("model: %s parameters per replica", info.engine["parameters_per_replica"])
        if reservation is not None:
            reservation.close()  # the gateway's own, from here
        serve.start(http_options={"host": s.host, "port": s.port})
        serve.run(
            deployment.gateway_app(s, instance),
            name=APP_NAME,
            route_prefix="/",
            logging_config={"enable_access_log": False, "log_level": s.log_level},
        )
        # The gateway serves from here (a client may already have seen it ready): a signal
        # now drains through the normal path below instead of interrupting start-up code.
        started.set()
        if s.port:
            local = "127.0.0.1" if s.host in ("0.0.0.0", "::", "") else s.host
            _check_own_port(f"http://{local}:{s.port}", s.instance_id or instance, stop)
        print(
            f"trainctl ready at {s.url} (API docs: {s.url}/docs) "
            f"in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        log.info("interrupted during start-up")
    except StartupError:
        raise
    except Exception as e:
        if started.is_set():
            raise
        log.debug("start-up failed", exc_info=True)
        raise StartupError(
            f"start-up failed: {type(e).__name__}: {_first_line(e)} "
            "(run with --log-level DEBUG for the traceback)"
        ) from None
    finally:
        if reservation is not None:
            reservation.close()
        _shutdown(controller, checkpoint=s.checkpoint_on_exit)
        if head is not None:
            head.stop()
    log.info("stopped")
    return 0


def _watch_parent(pid: int, stop: threading.Event) -> None:
    """SIGTERM to ourselves once ``pid`` is gone (the normal drain then runs, start-up
    included); a daemon thread polling once a second."""

    def watch() -> None:
        while not stop.wait(1.0):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                log.warning("process %d (--exit-with-pid) is gone: stopping", pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            except PermissionError:
                pass  # alive, someone else's

    threading.Thread(target=watch, name="exit-with-pid", daemon=True).start()


def _handle_signals(handler: Any) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


class _HeadExited(StartupError):
    pass


def _start_head(head: LocalRayHead) -> None:
    """Start the local head and join it, on fresh ports each attempt (``HEAD_ATTEMPTS``)."""
    for attempt in range(1, HEAD_ATTEMPTS + 1):
        address = head.__enter__()
        try:
            if not head.wait_started(timeout_s=120.0):
                raise _HeadExited(f"the local Ray head exited during start-up; see {head.log_path}")
            _connect(address, head, timeout_s=120.0)
            return
        except _HeadExited:
            head.stop()
            if attempt == HEAD_ATTEMPTS:
                raise
            log.warning(
                "the local Ray head exited during start-up (attempt %d of %d; see %s); "
                "starting it again on other ports",
                attempt,
                HEAD_ATTEMPTS,
                head.log_path,
            )


def _connect(address: str, head: LocalRayHead | None, timeout_s: float = 120.0) -> None:
    """``ray.init`` against ``address``, retrying while a fresh head is still starting
    (``timeout_s`` 0: one attempt, for a cluster that should already be up).

    Ray reports a refused token as a plain connection failure (after about 20 s), so the
    final error when joining names the token as a possible cause.
    """
    import ray

    from trainctl.workers.control.controller import NAMESPACE

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
            return
        except ray.exceptions.AuthenticationError:
            raise StartupError(ray_auth.missing_token_hint(address)) from None
        except (ConnectionError, RuntimeError) as e:
            if head is not None and not head.running():
                raise _HeadExited(
                    f"the local Ray head exited during start-up; see {head.log_path}"
                ) from None
            if time.monotonic() > deadline:
                hint = "" if head is not None else ray_auth.TOKEN_HINT
                waited = f" within {timeout_s:.0f}s" if timeout_s else ""
                raise StartupError(
                    f"could not reach the Ray cluster at {address}{waited} "
                    f"({_first_line(e)}); check --ray-address{hint}"
                ) from None
            time.sleep(1.0)


def _with_timeout(what: str, fn: Any, timeout_s: float) -> None:
    """Run a shutdown step in a thread; a hung step is logged and abandoned."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("%s did not finish within %.0fs; continuing shutdown", what, timeout_s)


def _shutdown(controller: Any, *, checkpoint: bool) -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():
        return

    def _drain() -> None:
        ray.get(controller.drain.remote())
        log.info("drained in-flight work")

    def _stop_controller() -> None:
        ray.get(controller.shutdown.remote(checkpoint))
        ray.kill(controller)

    if controller is not None:
        _with_timeout("draining", _drain, 120)
    _with_timeout("Serve shutdown", serve.shutdown, 60)
    if controller is not None:
        _with_timeout("controller shutdown", _stop_controller, 60)
    ray.shutdown()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainctl", description="trainctl serve")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="start the service (Ray, controller, ranks, gateway)")
    _add_settings_flags(p_serve)
    return parser


def _problem(err: Any) -> str:
    """One settings error in flag words: ``--flag: what is wrong`` (a check across flags,
    which has no field, names its flags itself)."""
    where = ".".join(map(str, err["loc"])).replace("_", "-")
    msg = validation_problem(err)
    return f"--{where}: {msg}" if where else msg


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            settings = _settings_from(args)
        except ValidationError as e:
            problems = "; ".join(_problem(err) for err in e.errors())
            print(f"trainctl: invalid settings: {problems}", file=sys.stderr)
            return 2
        logs.configure(settings.log_level, settings.log_format)
        return serve_main(settings)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
