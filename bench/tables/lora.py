"""The ``lora`` table of ``bench/run.py``."""

from __future__ import annotations

from bench.tables.common import measure, table


def section(quick: bool) -> str:
    """Training state per base parameter on one rank: full fine-tuning against LoRA r=32 with
    one and with eight adapters; then the cost of switching adapters."""
    rows = []
    for precision in ("fp32",) if quick else ("fp32", "bf16"):
        for adapters in (0, 1, 8):
            r = measure("lora_state_case", "lora_cases", precision=precision, adapters=adapters,
                        rank=32)  # fmt: skip
            total = sum(r[k] for k in ("params", "grads", "masters", "adam", "slots"))
            rows.append(
                [
                    precision,
                    "full fine-tuning" if not adapters else f"LoRA r=32 x {adapters}",
                    *(f"{r[k]:.3f}" for k in ("params", "grads", "masters", "adam", "slots")),
                    f"**{total:.3f}**",
                ]
            )
    head = (
        f"### LoRA: training state per base parameter on one rank "
        f"({r['base_parameters'] / 1e6:.1f}M-parameter base, after a step of every adapter)\n\n"
        "Read off the live tensors (each storage once). `params` counts the base and the LoRA "
        "sites (sized for rank 32); gradients, master weights and Adam exist for the sites "
        "only; `slots` holds each adapter's factors and AdamW state in host memory (the active "
        "one's included: a checkpoint or a switch copies it there).\n\n"
    )
    state = table(
        ["precision", "training", "params", "main grads", "master weights", "Adam",
         "adapter slots", "total B/param"],
        rows,
    )  # fmt: skip
    sw = measure("lora_switch_case", "lora_cases", precision="fp32", rank=32,
                 repeats=5 if quick else 21)  # fmt: skip
    disk = measure("lora_switch_case", "lora_cases", precision="fp32", rank=32,
                   repeats=5 if quick else 21, disk=True)  # fmt: skip
    switch = table(
        ["call", "ms (median)"],
        [
            ["the active adapter again (no switch)", f"{sw['same_ms']:.3f}"],
            [f"another adapter, from host memory ({sw['adapter_mb']:.1f} MB of factors, and "
             "their AdamW state)", f"{sw['switch_ms']:.2f}"],
            ["another adapter, from disk (`--adapters-in-memory`: one read, one written)",
             f"{disk['switch_ms']:.2f}"],
        ],
    )  # fmt: skip
    note = (
        "\n\nSwitching stashes the active adapter (its factors and AdamW state, copied to host "
        "memory) and loads the other. On this CPU the device is host memory, so *on device* "
        "and *from host* are one number here; on a GPU a switch adds the host-device copies of "
        "the same bytes. The round trip through disk is bit-exact "
        "(tests/distributed/test_lora_adapters.py).\n"
    )
    return head + state + "\n\n" + switch + note
