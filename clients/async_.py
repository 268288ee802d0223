"""The asynchronous Python client (``httpx.AsyncClient``), generated from
``clients/sync.py`` by ``scripts/unasync.py``: edit that file, not this one.

from trainctl.clients import AsyncTrainctlClient

async with AsyncTrainctlClient("http://127.0.0.1:8000") as tc:
    result = await tc.train_batch([{"tokens": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}])
    print(result.loss, result.step)

Batches travel in the binary encoding by default (``binary=False`` for JSON); every call that
touches the model carries an idempotency key and is retried on 408, 429 and 5xx.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from trainctl.api import (
    AdapterInfo,
    AdapterList,
    CheckpointInfo,
    CheckpointList,
    CreateAdapterRequest,
    Deleted,
    ExportRequest,
    ExportResult,
    ForwardBackwardResult,
    Health,
    Info,
    LoadCheckpointRequest,
    LogProbsResult,
    MemoryProfileList,
    MemoryProfileResult,
    MemoryProfileStarted,
    MemoryProfileStartRequest,
    Operation,
    OperationKind,
    OptimStepRequest,
    SampleResult,
    SaveCheckpointRequest,
    SequenceBatch,
    StepResult,
    SyncResult,
    SyncWeightsRequest,
)
from trainctl.api.errors import TrainctlError
from trainctl.clients._base import (
    DEFAULT_BASE_URL,
    DEFAULT_TIMEOUT_S,
    NO_RETRY,
    Call,
    LossLike,
    Packing,
    Requests,
    RetryPolicy,
    SequenceLike,
    Staleness,
    auth_headers,
    new_traceparent,
    operation_result,
)
from trainctl.clients.errors import APIConnectionError

T = TypeVar("T")
Sequences = Iterable[SequenceLike] | SequenceBatch


class AsyncTrainctlClient:
    """Async client of one trainctl service. Use as an async context manager, or ``aclose()``."""

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_token: str | None = None,
        binary: bool = True,
        retry: RetryPolicy | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self._http = http_client or httpx.AsyncClient(
            base_url=base_url, timeout=timeout, headers=auth_headers(api_token)
        )
        self._req = Requests(binary=binary)
        self._retry = retry or RetryPolicy()
        self.last_trace_id: str | None = None
        """The trace of the last call (32 hex digits): each call sends a W3C ``traceparent``
        of its own (its retries the same one), so its spans on the gateway, the controller
        and the ranks are one trace (``timeline``, OTLP)."""

    async def __aenter__(self) -> AsyncTrainctlClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: Call[T], retry: RetryPolicy | None = None) -> T:
        policy = retry or self._retry
        parent = new_traceparent()
        self.last_trace_id = parent[3:35]
        headers = {**(call.headers or {}), "traceparent": parent}
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self._http.request(
                    call.method, call.url, content=call.content, params=call.params,
                    headers=headers,
                )  # fmt: skip
            except httpx.TransportError as e:
                delay = policy.delay(attempt, None)
                if delay is None:
                    where = f"{self._http.base_url}".rstrip("/")
                    raise APIConnectionError(
                        f"could not reach {where} ({call.method} {call.url}): {e}"
                    ) from e
            else:
                delay = policy.delay(attempt, response)
                if delay is None:
                    return call.parse(response)
            await asyncio.sleep(delay)

    # -- training ----------------------------------------------------------------------------

    async def train_batch(
        self,
        sequences: Sequences,
        loss: LossLike = None,
        *,
        expected_step: int | None = None,
        packing: Packing = None,
        adapter: str | None = None,
        staleness: Staleness = "refuse",
        idempotency_key: str | None = None,
    ) -> StepResult:
        """Forward/backward over ``sequences`` and one optimizer step (default loss:
        token-mean cross-entropy; see ``LossConfig`` for importance sampling and PPO).
        ``expected_step``: apply only if the model is at that step (else ``ConflictError``).
        ``packing``: ``"tree"`` computes prefixes shared by several sequences once, ``"flat"``
        packs each whole (the same results); default: the server's setting. ``adapter``: the
        LoRA adapter to train (``create_adapter``); none: the full model."""
        call = self._req.run(
            OperationKind.TRAIN_BATCH, StepResult, sequences=sequences, loss=loss,
            expected_step=expected_step, packing=packing, adapter=adapter, staleness=staleness,
            idempotency_key=idempotency_key,
        )  # fmt: skip
        return await self._send(call)

    async def eval_batch(
        self,
        sequences: Sequences,
        loss: LossLike = None,
        *,
        packing: Packing = None,
        adapter: str | None = None,
    ) -> StepResult:
        """The loss of ``sequences`` without backward or update (under ``adapter``, if named)."""
        call = self._req.run(
            OperationKind.EVAL_BATCH, StepResult, sequences=sequences, loss=loss, packing=packing,
            adapter=adapter,
        )  # fmt: skip
        return await self._send(call)

    async def logprobs(
        self,
        sequences: Sequences,
        *,
        entropy: bool = False,
        packing: Packing = None,
        adapter: str | None = None,
        return_routes: bool = False,
    ) -> LogProbsResult:
        """Per-token log-probs (and entropy) of each sequence under the current weights (with
        ``adapter``, if named). MoE: ``return_routes`` also returns the experts each token was
        routed through (``routed_experts`` of the sequences, if they carry it: replay)."""
        call = self._req.run(
            OperationKind.LOGPROBS, LogProbsResult, sequences=sequences, entropy=entropy,
            packing=packing, adapter=adapter, return_routes=return_routes,
        )  # fmt: skip
        return await self._send(call)

    async def forward_backward(
        self,
        sequences: Sequences,
        loss: LossLike = None,
        *,
        packing: Packing = None,
        forward_only: bool = False,
        adapter: str | None = None,
        staleness: Staleness = "refuse",
        idempotency_key: str | None = None,
    ) -> ForwardBackwardResult:
        """Split step, part: gradients of ``sequences`` added to those waiting for
        ``optim_step``; the part's loss, per-token log-probs and per-token losses. Several
        parts then one ``optim_step`` equal one ``train_batch`` of all their sequences.
        ``forward_only``: the same outputs, no gradients."""
        call = self._req.run(
            OperationKind.FORWARD_BACKWARD, ForwardBackwardResult, sequences=sequences,
            loss=loss, packing=packing, forward_only=forward_only, adapter=adapter,
            staleness=staleness, idempotency_key=idempotency_key,
        )  # fmt: skip
        return await self._send(call)

    async def optim_step(
        self,
        *,
        lr: float | None = None,
        beta1: float | None = None,
        beta2: float | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        clip_grad: float | None = None,
        expected_step: int | None = None,
        adapter: str | None = None,
    ) -> StepResult:
        """Split step, end: apply the accumulated gradients with these AdamW settings (the
        server's where left out); the result's ``step`` is the new policy version (of
        ``adapter``, if named: each adapter has its own window and step)."""
        req = OptimStepRequest(
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            clip_grad=clip_grad, expected_step=expected_step, adapter=adapter,
        )  # fmt: skip
        return await self._send(self._req.call(OperationKind.OPTIM_STEP, StepResult, req))

    async def submit(
        self, kind: OperationKind | str, sequences: Sequences, **kwargs: Any
    ) -> Operation:
        """Start ``train_batch``, ``eval_batch`` or ``logprobs`` and return its operation at
        once; ``wait(op)`` for the result."""
        return await self._send(self._req.submit(kind, sequences=sequences, **kwargs))

    async def operation(self, op_id: str, wait_s: float = 0.0) -> Operation:
        return await self._send(self._req.operation(op_id, wait_s))

    async def wait(
        self,
        op: Operation,
        *,
        timeout: float | None = None,
        on_update: Callable[[Operation], None] | None = None,
    ) -> BaseModel:
        """Poll until ``op`` finishes; its typed result, or its error raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not op.finished:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"operation {op.id} not finished after {timeout:.0f}s")
            op = await self.operation(op.id, wait_s=2.0)
            if on_update is not None:
                on_update(op)
        return operation_result(op)

    # -- profiling ---------------------------------------------------------------------------

    async def start_memory_profile(self, max_entries: int = 100_000) -> MemoryProfileStarted:
        body = MemoryProfileStartRequest(max_entries=max_entries)
        call = self._req.call(OperationKind.START_MEMORY_PROFILE, MemoryProfileStarted, body)
        return await self._send(call)

    async def stop_memory_profile(self) -> MemoryProfileResult:
        return await self._send(
            self._req.call(OperationKind.STOP_MEMORY_PROFILE, MemoryProfileResult)
        )

    async def list_memory_profiles(self) -> MemoryProfileList:
        return await self._send(self._req.get("memory_profiles", MemoryProfileList))

    async def download_profile_file(self, profile_id: str, name: str) -> bytes:
        """One rank's profile file or picture (``ProfileFile.name`` / ``.picture``)."""
        return await self._send(self._req.download(profile_id, name))

    # -- sampling ----------------------------------------------------------------------------

    async def sample(
        self,
        prompts: Iterable[Iterable[int]],
        *,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        stop_token_ids: Iterable[int] = (),
        stop: Iterable[str] = (),
        logprobs: bool = True,
        prompt_logprobs: bool = False,
        expected_step: int | None = None,
        adapter: str | None = None,
        return_routes: bool = False,
        step: int | None = None,
    ) -> SampleResult:
        """``n`` completions of each token-id prompt from the service's sampler engines, with
        the sampler's log-prob of each generated token (and, ``prompt_logprobs``, of each
        prompt token). ``result.step`` is the optimizer step of the weights that produced
        them (``adapter``'s step with an adapter): the newest synced, or ``step``, one of the
        versions the samplers keep (``info().samplers.versions``; ``GoneError`` once it has
        left that window). ``expected_step`` refuses (``ConflictError``) any other;
        ``return_routes`` adds each completion's ``routed_experts`` (``--sampler-routes``);
        ``stop`` ends a completion at any of these strings (a model with a tokenizer: see
        ``info().limits.tokenizer``). Needs ``--samplers``."""
        call = self._req.sample(
            prompts, n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, stop_token_ids=list(stop_token_ids), stop=list(stop),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, expected_step=expected_step,
            adapter=adapter, return_routes=return_routes, step=step,
        )  # fmt: skip
        return await self._send(call)

    async def sync_weights(self, adapter: str | None = None) -> SyncResult:
        """Send the current weights (or ``adapter``'s factors) to every sampler engine now
        (for ``sampler_sync: manual``; with ``after_step`` every applied step is synced
        already, and an adapter is synced when created)."""
        req = SyncWeightsRequest(adapter=adapter)
        return await self._send(self._req.call(OperationKind.SYNC_WEIGHTS, SyncResult, req))

    # -- checkpoints ---------------------------------------------------------------------------

    async def save_checkpoint(
        self,
        name: str | None = None,
        overwrite: bool = False,
        *,
        adapter: str | None = None,
        owner: str | None = None,
    ) -> CheckpointInfo:
        """Save weights, optimizer state and step (atomically; any layout of the model loads
        a whole-state one). Unnamed: ``step-NNNNNN``, pruned to the server's
        ``keep_checkpoints``; named: kept. ``adapter``: that LoRA adapter alone; ``owner``:
        under that owner's names (default: the service's)."""
        req = SaveCheckpointRequest(name=name, overwrite=overwrite, adapter=adapter, owner=owner)
        return await self._send(self._req.call(OperationKind.SAVE_CHECKPOINT, CheckpointInfo, req))

    async def list_checkpoints(self, owner: str | None = None) -> CheckpointList:
        """``owner``'s checkpoints (default: the service's own names), oldest save first."""
        return await self._send(self._req.get("checkpoints", CheckpointList, owner=owner))

    async def delete_checkpoint(self, checkpoint_id: str, owner: str | None = None) -> Deleted:
        """Delete ``owner``'s checkpoint from disk (in the operation queue's turn)."""
        call = self._req.delete(f"checkpoints/{checkpoint_id}", Deleted, owner=owner)
        return await self._send(call)

    async def delete_export(self, name: str, owner: str | None = None) -> Deleted:
        """Delete ``owner``'s Hugging Face export from disk (in the operation queue's turn)."""
        return await self._send(self._req.delete(f"exports/{name}", Deleted, owner=owner))

    async def load_checkpoint(
        self,
        checkpoint_id: str,
        optimizer: bool = True,
        *,
        adapter: str | None = None,
        into: str | None = None,
        owner: str | None = None,
    ) -> CheckpointInfo:
        """Restore a checkpoint (reshardable: written at any layout): weights, step and
        (``optimizer``) the optimizer state; without it the optimizer starts afresh on the
        loaded weights. ``adapter``: that adapter alone (as ``into``), nothing else;
        ``owner``: a checkpoint of those names."""
        req = LoadCheckpointRequest(
            checkpoint_id=checkpoint_id, optimizer=optimizer, adapter=adapter, into=into,
            owner=owner,
        )  # fmt: skip
        return await self._send(self._req.call(OperationKind.LOAD_CHECKPOINT, CheckpointInfo, req))

    async def export_hf(
        self,
        name: str | None = None,
        *,
        adapter: str | None = None,
        merged: bool = False,
        owner: str | None = None,
    ) -> ExportResult:
        """Write the model as a Hugging Face checkpoint of its family on the server; with
        ``adapter``, that adapter in PEFT's format, or (``merged``) the model with it folded
        in; ``owner``: under that owner's names (default: the service's)."""
        req = ExportRequest(name=name, adapter=adapter, merged=merged, owner=owner)
        return await self._send(self._req.call(OperationKind.EXPORT_HF, ExportResult, req))

    # -- LoRA adapters (docs/lora.md) ---------------------------------------------------------

    async def create_adapter(
        self,
        name: str,
        rank: int = 32,
        alpha: float = 32.0,
        *,
        targets: Iterable[str] = ("attn", "mlp", "unembed"),
        dropout: float = 0.0,
        seed: int = 0,
    ) -> AdapterInfo:
        """A new LoRA adapter on the service's frozen base (``trainctl serve --max-adapters
        N``); batch calls train and read it with ``adapter=name``."""
        req = CreateAdapterRequest.model_validate(
            {"name": name, "rank": rank, "alpha": alpha, "targets": list(targets),
             "dropout": dropout, "seed": seed}
        )  # fmt: skip
        return await self._send(self._req.call(OperationKind.CREATE_ADAPTER, AdapterInfo, req))

    async def list_adapters(self) -> AdapterList:
        return await self._send(self._req.get("adapters", AdapterList))

    async def delete_adapter(self, name: str) -> AdapterList:
        """Delete an adapter: its weights, optimizer state and waiting gradients."""
        return await self._send(self._req.delete(f"adapters/{name}", AdapterList))

    # -- service -----------------------------------------------------------------------------

    async def info(self) -> Info:
        return await self._send(self._req.get("info", Info))

    async def health(self) -> Health:
        return await self._send(self._req.get("health", Health))

    async def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        return await self._send(self._req.metrics())

    async def timeline(
        self, since: float | None = None, until: float | None = None
    ) -> dict[str, Any]:
        """The spans of the gateway, the controller and every rank overlapping ``[since,
        until]`` (Unix seconds; default: the last minute) as Chrome trace JSON: write it to a
        file and open it in https://ui.perfetto.dev. Needs the operator's token."""
        return await self._send(self._req.timeline(since, until))

    async def is_ready(self, instance: str | None = None) -> bool:
        """Whether trainctl answers ready at this URL: a 200 from anything else (a server
        that took the port) is not ready. ``instance``: also that it is this start of it."""
        try:
            health = await self._send(self._req.get("ready", Health), NO_RETRY)
        except (TrainctlError, ValueError):  # ValueError: a body that is not trainctl's
            return False
        return health.status == "ready" and instance in (None, health.instance)

    async def wait_ready(self, timeout: float = 300.0, poll_s: float = 1.0) -> None:
        """Block until the service reports ready; ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not await self.is_ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainctl not ready after {timeout:.0f}s")
            await asyncio.sleep(poll_s)
