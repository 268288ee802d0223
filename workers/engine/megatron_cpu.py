"""Everything megatron-core 0.16.1 needs to run without CUDA, in one place.

megatron-core assumes a CUDA device in a handful of spots (measured; see
docs/megatron_cpu.md). This module patches exactly those, and only when
``torch.cuda.is_available()`` is False; on a GPU it does nothing.

* ``install()`` (once per process, before building a model):
  - ``torch.cuda.current_device()`` returns the CPU device, so the global memory
    buffer and RoPE's ``inv_freq.to(current_device())`` land on the CPU;
  - ``torch.cuda.synchronize`` becomes a no-op;
  - megatron's CUDA RNG tracker is replaced by one that forks the CPU generator;
  - ``moe_utils.te_general_gemm`` is defined as None (it is referenced unguarded).
* ``cuda_to_cpu()`` is a context manager (a ``TorchFunctionMode``) that rewrites
  ``device="cuda"`` factory arguments and ``Tensor.cuda()`` to the CPU. The engine
  wraps model construction, the schedule and the optimizer step in it.

The exact pin of megatron-core in pyproject.toml exists because these are private names.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_installed = False

# Seed offsets used by megatron-core's model_parallel_cuda_manual_seed; kept identical so a
# CPU run initialises the same streams as a GPU run would.
_TP_SEED_OFFSET = 2718
_EXPERT_SEED_OFFSET = 1024
_EXPERT_RANK_STRIDE = 100


def needed() -> bool:
    """True when the CUDA-absent adaptations apply (no CUDA device in this process)."""
    return not torch.cuda.is_available()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch function call."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers sort parameters by their type *name* and accept only
            # CUDA ones ('torch.cuda.BFloat16Tensor', ...): a CPU tensor answers with the name
            # its CUDA twin would have.
            name: str = func(*args)
            return (
                name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
            )
        if func in (torch.Tensor.to,) and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Run megatron-core code that hard-codes ``device="cuda"`` on the CPU (no-op on GPU)."""
    if not needed():
        yield
        return
    with _CudaToCpu():
        yield


def _make_cpu_rng_tracker() -> Any:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):  # type: ignore[misc]  # megatron-core ships no types
        """megatron's named-RNG-stream tracker over the CPU generator."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker()


def install() -> None:
    """Apply the process-wide adaptations (idempotent; no-op when CUDA is present)."""
    global _installed
    if _installed or not needed():
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]  # CPU stand-in
    torch.cuda.synchronize = lambda *a, **k: None

    mrandom._CUDA_RNG_STATE_TRACKER = _make_cpu_rng_tracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Checkpointed (recomputed) layers save and restore the "CUDA" RNG state.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    try:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    except ImportError:  # pragma: no cover - MoE module missing in a trimmed install
        pass
    _installed = True
    log.debug("megatron-core CPU adaptations installed")


def seed_model_parallel_rng(seed: int, *, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    """Seed the default and megatron's named RNG streams, as upstream does on CUDA."""
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(seed)
    if not needed():
        mrandom.model_parallel_cuda_manual_seed(
            seed, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank
        )
        return
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TP_SEED_OFFSET + tp_rank)
    tracker.add(
        mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        seed + _EXPERT_SEED_OFFSET + _EXPERT_RANK_STRIDE * ep_rank + etp_rank,
    )
