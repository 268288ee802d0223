"""The engine room: one rank's megatron-core shard (model, attention, inputs, HF mapping,
profiling, CPU adaptations). No Ray."""

from trainctl.workers.engine import megatron_jit

megatron_jit.install()  # before megatron-core is first imported (see megatron_jit.py)
