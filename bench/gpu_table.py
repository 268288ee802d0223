"""The GPU benchmark's result table: one line per (batch, configuration), each through the
correctness gate (``gpu_gate.py``) against the batch's reference row, with tokens/s, MFU in
both conventions, peak memory, step 1 and the loss curve; a cell without numbers says why."""

from __future__ import annotations

from typing import Any

from bench import gpu_gate
from bench.gpu_baselines import BY_NAME


def step_flops(model: dict[str, Any], params: int, lengths: list[int], palm: bool = False) -> float:
    """Model FLOPs of one train step (the conventions: ``bench/gpu.py``'s docstring)."""
    untied_embedding = 0 if model["tie_embeddings"] else model["vocab_size"] * model["hidden_size"]
    matmul_params = params - untied_embedding
    attn = 6 * model["num_layers"] * model["num_attention_heads"] * model["head_dim"]
    attn *= 2 if palm else 1
    return 6.0 * matmul_params * sum(lengths) + attn * sum(n * n for n in lengths)


def no_numbers(cell: dict[str, Any]) -> str | None:
    """What a cell without numbers says: skipped, OOM, failed; None if it has numbers."""
    if "skipped" in cell:
        return f"skipped: {cell['skipped']}"
    if cell.get("oom"):
        return "OOM"
    if "failed" in cell:
        return f"failed: {cell['failed']}"
    return None


class Table:
    """The result table: one line per (batch, configuration)."""

    HEADER = (
        "| batch | configuration | tokens/s (median) | step ms median [min, max] "
        "| MFU bench / PaLM | peak GiB | micro-batch | step-1 loss | step-1 grad norm "
        "| loss step 1 → last | gate | trainctl speed-up |"
    )
    RULE = "|---|---|---|---|---|---|---|---|---|---|---|---|"

    def __init__(
        self, model: dict[str, Any], peak: float | None, params: int, reference: str
    ) -> None:
        self.model, self.peak, self.params, self.reference = model, peak, params, reference
        self.rows: list[str] = []
        self.failed_gate: list[str] = []
        self.kernels: list[str] = []

    def add(self, label: str, lengths: list[int], cells: dict[str, dict[str, Any]]) -> None:
        tokens = sum(lengths)
        reference = cells.get(self.reference)
        ref = reference if reference is not None and not no_numbers(reference) else None
        ours = cells.get("trainctl", {})
        for name, cell in cells.items():
            config = cell.get("config") or (BY_NAME[name].label if name in BY_NAME else name)
            if why := no_numbers(cell):
                self._line(label, config, why)
                continue
            gate = gpu_gate.problems(cell, ref)
            cell["gate"] = gate or "pass"
            if gate:
                self.failed_gate.append(f"{label}, {config}: {'; '.join(gate)}")
                self._line(label, config, f"not published: failed the gate ({'; '.join(gate)})")
                continue
            rate = [step_flops(self.model, self.params, lengths, palm) / cell["step_s"]
                    for palm in (False, True)]  # fmt: skip
            mfu = " / ".join(f"{100 * r / self.peak:.1f}%" for r in rate) if self.peak else "n/a"
            speedup = "n/a"
            if name != "trainctl" and not no_numbers(ours) and ours.get("gate") == "pass":
                speedup = f"{cell['step_s'] / ours['step_s']:.2f}x"
            losses, ms = cell["losses"], [1e3 * cell[k] for k in ("step_s", "min_s", "max_s")]
            cols = [
                label, config, f"{tokens / cell['step_s']:,.0f}",
                f"{ms[0]:.0f} [{ms[1]:.0f}, {ms[2]:.0f}]", mfu, f"{cell['peak_gib']:.1f}",
                f"{cell['micro_tokens']:,}", f"{losses[0]:.4f}", f"{cell['grad_norms'][0]:.4g}",
                f"{losses[0]:.3f} → {losses[-1]:.3f} ({len(losses)})", "pass", speedup,
            ]  # fmt: skip
            self.rows.append("| " + " | ".join(cols) + " |")
            print(self.rows[-1], flush=True)
            self.kernels.append(f"{label}, {config}: {cell.get('attention')}")

    def _line(self, label: str, config: str, why: str) -> None:
        self.rows.append(f"| {label} | {config} | {why} |" + " |" * 9)
        print(self.rows[-1], flush=True)

    def text(self, caption: str, provenance: dict[str, Any]) -> str:
        """The result file: the caption, the table, the provenance and the kernels."""
        sw, code = provenance["software"], provenance["code"]
        peak = self.peak
        prov = [
            f"- code: {code['commit']} (dirty: {code['dirty']}; from {code['source']})",
            "- software: " + ", ".join(f"{k} {v}" for k, v in sw.items() if k != "device"),
            f"- card before: {provenance['card_before']}",
            f"- card after: {provenance.get('card_after')}",
            f"- MFU peak: {peak / 1e12 if peak else 'none (card not in the table)'}"
            + (" TFLOP/s dense bf16" if peak else ""),
        ]
        return "\n".join([
            caption, "", self.HEADER, self.RULE, *self.rows, "", "Provenance:", "", *prov, "",
            "Attention kernels (one profiled step each):", "", *[f"- {k}" for k in self.kernels],
        ])  # fmt: skip
