"""The seam between the sampler pool and an inference engine.

``SamplerEngine`` is what the pool asks of one engine replica (through its Ray actor). It is
asynchronous: an engine serves many requests at once (vLLM's, stepped by
``vllm_backend/sampler.py``), and one that serves a call at a time fits it as well:

- ``sample`` is a coroutine with a request id and a queue timeout: a request that waits longer
  for the engine answers a retryable 503 (``QueueTimeoutError``) and never runs;
  ``abort(request_id)`` drops it (a request still waiting for the engine is dropped at once;
  a running one stops at the engine's next step); a weight or adapter load waits for no
  sample but those running;
- weights and adapters arrive as a ``Shipment`` (``transport.py``) naming their version, and
  a result says which version produced it: ``SampleResult.step``, and per token
  ``Completion.token_steps`` (vLLM labels each engine step with its weight version);
- a sample names its version: the ``Shipment`` of the base's (or its adapter's) step to
  sample, one of the pool's window (``window.py``). An engine that holds another loads it
  first, in the request's turn; a result is never another version's;
- ``load_adapter(shipment, keep)`` adds one version of an adapter and drops that adapter's
  versions whose steps are not in ``keep``; ``remove_adapter`` drops them all; ``pid`` for
  ``info``.

A backend is a package beside this module that exposes ``engine_class()`` (the class the
pool makes an actor of; imported only when a pool is built), ``env(cuda, threads, routes)``
(the engine process's environment), ``check(needs)`` (what it cannot do, said before any
engine starts) and ``missing()`` (what this machine lacks to run it, said by ``trainctl
serve`` before Ray starts). ``BACKENDS`` is the registry: ``--sampler-backend`` takes its
names, and nothing else lists them.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from trainctl.api import ConflictError, InternalError, NotReadyError, SampleRequest, SampleResult
from trainctl.workers.sampler.transport import Shipment
from trainctl.workers.spans import SpanRecord

BACKENDS: dict[str, str] = {"vllm": "trainctl.workers.sampler.vllm_backend"}
"""Each sampler backend's package, by the name ``--sampler-backend`` takes."""


@dataclass(frozen=True)
class Loaded:
    """An engine's answer to ``load_weights`` and ``load_adapter``."""

    step: int
    seconds: float
    transfer_s: float | None = None
    """Of ``seconds``, those the weights took to arrive before the load (None: not told
    apart, as for an adapter)."""


class EngineBrokenError(InternalError):
    """This engine cannot serve any more (a call left it with work an abort did not clear, or
    a weight load failed half-way): the pool recreates it with the current weights."""


class RequestAbortedError(ConflictError):
    """The request was aborted (by its caller, or past its deadline) before it ran."""


class QueueTimeoutError(NotReadyError):
    """The request waited longer than its queue timeout for the engine, and never ran (503:
    the client may retry, on this engine or another)."""


class UnsupportedError(ValueError):
    """What a backend cannot do for this model on these engines (a start-up refusal)."""


@dataclass(frozen=True)
class SamplerNeeds:
    """What the service asks of its engines, for a backend's ``check``."""

    gpus: float
    """GPUs per engine (0: a CPU engine)."""
    moe: bool
    """The model is a mixture of experts."""
    linear_attention: bool
    """The model has linear-attention (Gated DeltaNet) layers: Qwen3.5."""
    lora: bool
    """The service serves LoRA adapters."""
    routes: bool
    """The engines capture the experts each token was routed to."""


class SamplerEngine(Protocol):
    async def pid(self) -> int: ...

    async def sample(
        self,
        request_id: str,
        req: SampleRequest,
        version: Shipment,
        queue_timeout_s: float | None = None,
        trace: str | None = None,
    ) -> SampleResult:
        """``trace``: the caller's W3C ``traceparent``, which the engine's spans join."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Drop the request; True if it will not produce a result."""
        ...

    async def load_weights(
        self,
        shipment: Shipment,
        member: tuple[dict[str, Any], int] | None = None,
        keep: Sequence[str] = (),
        trace: str | None = None,
    ) -> Loaded:
        """Load ``shipment``: opened (``transport.open_shipment``), or received over the
        group ``member`` names (its rendezvous and this engine's rank) while it is sent,
        keeping in host memory the received versions whose shipment ids ``keep`` lists."""
        ...

    async def load_adapter(
        self, shipment: Shipment, keep: Sequence[int], trace: str | None = None
    ) -> Loaded: ...

    async def remove_adapter(self, name: str) -> None: ...

    async def clock(self) -> float:
        """This process's wall clock (the timeline takes the engine's offset from it)."""
        ...

    async def recent_spans(
        self, since: float, until: float, offset_s: float
    ) -> tuple[list[SpanRecord], int]:
        """The engine's spans in ``[since, until]`` of a collector whose clock runs
        ``offset_s`` ahead, on that clock, and the count its ring dropped (``spans.recent``)."""
        ...


class Backend(Protocol):
    """A backend package, as ``load`` returns it."""

    def engine_class(self) -> type[SamplerEngine]: ...

    def env(self, cuda: bool, threads: int, routes: bool = False) -> dict[str, str]: ...

    def check(self, needs: SamplerNeeds) -> None: ...

    def missing(self) -> str | None:
        """What this machine lacks to run the engines, with how to install it (None:
        nothing). Imports nothing heavy: it runs before Ray starts."""


def load(name: str) -> Backend:
    """The backend called ``name``."""
    if name not in BACKENDS:
        raise UnsupportedError(f"sampler_backend: no backend {name!r}; one of {sorted(BACKENDS)}")
    return cast(Backend, importlib.import_module(BACKENDS[name]))
