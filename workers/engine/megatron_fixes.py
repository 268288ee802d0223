"""Fixes to megatron-core 0.16.1, in one place: the first wherever it runs without
TransformerEngine (this CPU machine, and GPU machines that carry no TransformerEngine wheel),
the second everywhere.

* ``CheckpointWithoutOutput`` (``recompute: norms``: megatron's ``layernorm`` recompute
  module) sets ``self.fp8 = fp8 is not None``, so its default ``fp8=False`` reads as FP8 on,
  and its forward then calls TransformerEngine's ``FP8GlobalStateManager``, which is not
  imported without TransformerEngine: ``NameError``. Without TransformerEngine there is no
  FP8, so the flag is set from the argument's truth.

* ``TransformerLayer`` logs "Unknown MLP type" (at WARNING, once a layer) for any dense MLP
  that is not exactly its ``MLP``, such as ours (``workers/engine/mlp.py``), and then builds
  it without a ``tp_group``, so that ``MLP`` takes the default tensor-parallel group: the
  group it would have passed. The message is dropped; nothing else is.

``install()`` is idempotent; with TransformerEngine importable the first changes nothing. The
exact pin of megatron-core in pyproject.toml exists because these are private names.
"""

from __future__ import annotations

import logging
from typing import Any

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    from megatron.core.tensor_parallel import random as mrandom

    logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_no_mlp_type_warning)
    if mrandom.HAVE_TE:
        return
    init = mrandom.CheckpointWithoutOutput.__init__

    def without_fp8(self: Any, fp8: Any = False) -> None:
        init(self, fp8)
        self.fp8 = bool(fp8)

    mrandom.CheckpointWithoutOutput.__init__ = without_fp8


def _no_mlp_type_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Unknown MLP type")
