"""The rank actor's exporter: the model (or an adapter) gathered from every rank's shards
into whole tensors on one rank, written as a Hugging Face checkpoint or PEFT adapter, or (an
adapter's, a few MB) kept in memory for the samplers. The base's weights reach the samplers
without a gather: ``stream.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainctl.workers.engine.boundary import OwnedShards, WrittenFile
from trainctl.workers.sampler.spec import PeftAdapter

if TYPE_CHECKING:
    from trainctl.workers.engine.shard import EngineShard

Part = Literal["base", "adapter", "merged"]
"""What an export gathers: the base's weights, an adapter's factors, or both (to merge)."""


class Exporter:
    """Owns the rank's side of an export: its shards of the model (or of an adapter), and on
    one rank all of them merged into whole tensors, written or kept in memory. It reads the
    rank's engine shard (``RankWorker`` builds one per engine, and its methods of these names
    delegate here)."""

    def __init__(self, engine: EngineShard) -> None:
        self.engine = engine

    def canonical_shards(self, part: Part = "base", adapter: str | None = None) -> OwnedShards:
        """What this rank adds to one full copy of ``part`` (for export and the samplers):
        the base's parameters, ``adapter``'s factors, or both."""
        from trainctl.workers.engine.lora import is_lora

        if adapter is not None:
            self.engine.adapters.activate(adapter)
        shards = self.engine.canonical_shards(owned=True)
        keep = {"base": lambda n: not is_lora(n), "adapter": is_lora}.get(part, lambda n: True)
        return OwnedShards(
            tp=self.engine.coords.tp, shards={n: t for n, t in shards.items() if keep(n)}
        )

    def _merged(self, parts: list[Any]) -> dict[str, Any]:
        """Every rank's ``canonical_shards`` (object refs) merged into whole canonical
        tensors."""
        import ray

        from trainctl.workers.engine import weights

        return weights.merge_owned(ray.get(parts), self.engine.cfg.layout.tp)

    def write_hf(
        self, parts: list[Any], directory: str, adapter: str | None = None, merged: bool = False
    ) -> list[WrittenFile]:
        """On one rank: merge every rank's ``canonical_shards`` and write a Hugging Face
        checkpoint of the model's family; with ``adapter``, its PEFT adapter, or (``merged``)
        the model with the adapter folded in."""
        from trainctl.workers.engine import hf, hf_adapter

        full, m = self._merged(parts), self.engine.cfg.model
        if adapter is None:
            files = hf.save(Path(directory), full, m)
        else:
            spec = self.engine.adapters.spec(adapter)
            if merged:
                m2 = hf_adapter.untie_if_head_adapted(m, spec)
                files = hf.save(Path(directory), hf_adapter.merged(full, m, spec), m2)
            else:
                files = hf_adapter.save_peft(Path(directory), full, m, spec)
        return [WrittenFile(name=f.name, size_bytes=f.stat().st_size) for f in files]

    def peft_weights(self, parts: list[Any], adapter: str) -> tuple[PeftAdapter, int]:
        """On one rank: ``adapter``'s factors from every rank, in PEFT's format (what
        ``write_hf`` writes for it), and their size in bytes. Called with ``num_returns=2``:
        the tensors go to the sampler engines, the size to the controller, which so never
        holds them itself."""
        from trainctl.workers.engine import hf_adapter
        from trainctl.workers.engine.checkpoint.files import tensor_bytes

        spec = self.engine.adapters.spec(adapter)
        config, tensors = hf_adapter.to_peft(self._merged(parts), self.engine.cfg.model, spec)
        return PeftAdapter(config=config, tensors=tensors), tensor_bytes(tensors)

    def hf_config(self) -> dict[str, Any]:
        """The model's Hugging Face ``config.json`` (an export's), or the reason there is none."""
        from trainctl.workers.engine import hf
        from trainctl.workers.engine.families import export_problem

        m = self.engine.cfg.model
        problem = export_problem(m.family, m.num_experts)
        if problem:
            raise ValueError(problem)
        config = hf.hf_config(m)
        # End-of-sequence as the model's own files say (a sampler stops there), and none for
        # a model made here: transformers' class defaults (Llama's eos 2) are not its own.
        config["eos_token_id"] = config["bos_token_id"] = None
        if self.engine.cfg.init_hf:
            for name in ("config.json", "generation_config.json"):
                path = Path(self.engine.cfg.init_hf) / name
                if path.is_file():
                    own = json.loads(path.read_text())
                    config |= {k: own[k] for k in ("eos_token_id", "bos_token_id") if k in own}
        return config
