"""Without CUDA, megatron-core's ``jit_fuser`` decorates nothing.

megatron-core 0.16.1 binds ``megatron.core.jit.jit_fuser = torch.compile`` when that module is
imported, and a dozen modules decorate functions with it while they are imported (fused
bias/activation kernels, Qwen3.5's attention output gate, the Gated DeltaNet output norm).
``torch.compile`` imports dynamo and inductor the first time it is called: 2.6 of the 8.8
CPU-seconds a rank spends importing the engine (measured on the CPU machine). On a CPU those
functions then compile C++ kernels on their first call, for an elementwise op or two.

:func:`install` adds an import hook that, the moment ``megatron.core.jit`` has run, calls its
own ``disable_jit_fuser()`` when this process has no CUDA device: every module imported after
it decorates with megatron's no-op, and the functions run eagerly. With CUDA nothing changes.
The hook is installed when ``trainctl.workers.engine`` is imported, so every process that
builds an engine (a rank, the in-process engine, a test's reference) gets the same eager
functions; it imports nothing itself (the gateway, which imports the engine's config, stays
free of torch).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

MODULE = "megatron.core.jit"


class _AfterExec(importlib.abc.Loader):
    """``loader``, then ``megatron.core.jit.disable_jit_fuser()`` when there is no CUDA. Owns
    the loader it wraps."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        import torch  # megatron.core.jit imported it

        if not torch.cuda.is_available():
            module.disable_jit_fuser()


class _JitFuserHook(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _AfterExec(spec.loader)
                return spec
        return None


def install() -> None:
    """Add the hook (once), unless megatron-core is already imported (then it is too late)."""
    if MODULE in sys.modules or any(isinstance(f, _JitFuserHook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitFuserHook())
