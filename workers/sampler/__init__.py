"""The sampler room: inference engines that sample with the weights being trained.

What lives here (docs/architecture.md): the vLLM sampler actors, one per engine replica;
the weight-sync protocol that brings them a step's weights without touching disk; and the
gathering of a rank's shards into whole tensors under Hugging Face names. The controller
drives this room as it drives the ranks.

The rule that keeps it small: a sampler knows Hugging Face names and tensors, never the
engine's shards or megatron-core (an import-linter contract says so). What crosses from the
trainer is a named tensor, so any engine that loads HF weights can be a sampler.
"""
