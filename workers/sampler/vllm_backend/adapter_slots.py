"""The LoRA adapters one vLLM engine holds, each version its own vLLM adapter.

A version of an adapter (its name and step) is loaded as a vLLM adapter of its own
(``name@step``, an id of its own), from a memory-backed directory (``/dev/shm`` where it
exists) that vLLM reads: its two files in PEFT's format, a few MB, never the base. A request
names the version it wants; the versions the pool's window no longer keeps are dropped.

With in-flight updates (``--sampler-sync in_flight``) each adapter also has a **newest
slot**: one more vLLM adapter (``name@newest``) that every sync of the adapter replaces in
place, between two engine steps. Requests for an adapter's newest version run on that slot,
so a sync does not wait for them: they go on with the new version (the engine has vLLM
recompute their prefixes, as for the base), and each token's step is in its label. Requests
pinned to a step keep their own version's adapter.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainctl.api import InternalError
from trainctl.workers.sampler.spec import PeftAdapter
from trainctl.workers.sampler.transport import Schema, Shipment, schema_mismatch, schema_of
from trainctl.workers.sampler.vllm_backend.folders import ADAPTER_DIR_PREFIX, memory_dir

NEWEST = "newest"
"""The tag of an adapter's newest slot in vLLM's adapter names (``name@newest``)."""


@dataclass
class Served:
    """One vLLM adapter the engine holds: a version of an adapter, or its newest slot."""

    lora_id: int
    step: int
    path: Path
    schema: Schema
    shipment: str
    """The id of the shipment it was loaded from."""
    tag: str = ""
    """``name@tag`` in vLLM: the step, or ``NEWEST``."""

    def request(self, name: str) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"{name}@{self.tag or self.step}", self.lora_id, str(self.path))


class AdapterSlots:
    """The adapters of one engine. Owns their vLLM ids, their directory, the versions held
    (by name and step) and, with in-flight updates, each adapter's newest slot."""

    def __init__(self, llm: Any, index: int, in_flight: bool) -> None:
        self.llm, self.index, self.in_flight = llm, index, in_flight
        self._dir = tempfile.TemporaryDirectory(
            prefix=f"{ADAPTER_DIR_PREFIX}{os.getpid()}-", dir=memory_dir()
        )
        self.versions: dict[tuple[str, int], Served] = {}
        """Each adapter version held, by name and step."""
        self.newest: dict[str, Served] = {}
        """Each adapter's newest slot, by name (in-flight updates only)."""
        self._next_id = 1

    def versions_of(self, name: str) -> list[Served]:
        return [v for (n, _), v in self.versions.items() if n == name]

    def steps(self) -> dict[str, int]:
        """The step each newest slot holds, by adapter name (the engine's step labels)."""
        return {name: s.step for name, s in sorted(self.newest.items())}

    def load(
        self, shipment: Shipment, adapter: PeftAdapter, keep: Sequence[int], newest: bool
    ) -> bool:
        """Load ``shipment``'s version of its adapter (replacing one of the same step in
        place), then drop that adapter's versions whose steps are not in ``keep``. ``newest``:
        also into the adapter's newest slot (in-flight updates). True if an adapter the engine
        serves was replaced in place: the prefixes cached with it are stale."""
        assert shipment.adapter is not None
        name, step = shipment.adapter, shipment.version
        schema = schema_of(adapter.tensors)
        held = self.versions_of(name)
        if held and (problem := schema_mismatch(schema, held[0].schema)):
            raise InternalError(
                f"sampler {self.index} refused adapter {name!r} at step {step}, whose tensors "
                f"do not match the version it serves (step {held[0].step}): {problem}"
            )
        old = self.versions.get((name, step))
        # A new directory per load: vLLM may re-read an evicted adapter from its path later.
        path = self._write(Path(self._dir.name, f"{name}.{step}.{time.monotonic_ns()}"), adapter)
        served = self._add(name, Served(0, step, path, schema, shipment.id), old)
        self.versions[(name, step)] = served
        replaced = old is not None
        if newest and self.in_flight:
            replaced |= self._load_newest(name, adapter, served)
        for v in self.versions_of(name):
            if v.step != step and v.step not in keep:
                self.drop(name, v.step)
        return replaced

    def _load_newest(self, name: str, adapter: PeftAdapter, version: Served) -> bool:
        """The adapter's newest slot, with ``version``'s factors: at one path that each load
        overwrites (a request running on the slot, which vLLM may re-read, finds the newest)."""
        slot = self.newest.get(name)
        path = self._write(Path(self._dir.name, f"{name}.{NEWEST}"), adapter)
        fresh = Served(0, version.step, path, version.schema, version.shipment, tag=NEWEST)
        self.newest[name] = self._add(name, fresh, slot, keep_path=True)
        return slot is not None

    def _add(
        self, name: str, served: Served, old: Served | None, keep_path: bool = False
    ) -> Served:
        """Hand ``served`` to vLLM, under ``old``'s id where it replaces one (in place)."""
        from vllm.lora.request import LoRARequest

        served.lora_id = old.lora_id if old is not None else self._next_id
        vllm_name = f"{name}@{served.tag or served.step}"
        request = LoRARequest(vllm_name, served.lora_id, str(served.path), load_inplace=True)
        if not self.llm.llm_engine.add_lora(request):
            if not keep_path:
                shutil.rmtree(served.path, ignore_errors=True)
            raise RuntimeError(f"vLLM did not load adapter {vllm_name!r}")
        if old is None:
            self._next_id += 1
        elif not keep_path:
            shutil.rmtree(old.path, ignore_errors=True)  # the copy it replaced
        return served

    @staticmethod
    def _write(path: Path, adapter: PeftAdapter) -> Path:
        """PEFT's two files under ``path``, each written whole before it replaces the last."""
        from safetensors.torch import save_file

        path.mkdir(exist_ok=True)
        config, tensors = path / "adapter_config.json", path / "adapter_model.safetensors"
        config.with_suffix(".tmp").write_text(json.dumps(adapter.config))
        save_file(adapter.tensors, str(tensors.with_suffix(".tmp")))
        os.replace(config.with_suffix(".tmp"), config)
        os.replace(tensors.with_suffix(".tmp"), tensors)
        return path

    def drop(self, name: str, step: int) -> None:
        served = self.versions.pop((name, step))
        self.llm.llm_engine.remove_lora(served.lora_id)
        shutil.rmtree(served.path, ignore_errors=True)

    def remove(self, name: str) -> None:
        """Drop every version of ``name``, and its newest slot."""
        for v in self.versions_of(name):
            self.drop(name, v.step)
        slot = self.newest.pop(name, None)
        if slot is not None:
            self.llm.llm_engine.remove_lora(slot.lora_id)
            shutil.rmtree(slot.path, ignore_errors=True)

    def held(self, version: Shipment) -> Served | None:
        """The adapter this engine serves ``version`` with, if it holds it."""
        assert version.adapter is not None
        served = self.versions.get((version.adapter, version.version))
        return served if served is not None and served.shipment == version.id else None
