"""The engine room: one rank's megatron-core shard (model, attention, inputs, HF mapping,
profiling, CPU adaptations). No Ray."""
