"""The shard's checkpoint, one room: what a rank saves and loads (``shard.py``), the
reshardable format any layout loads (``reshard.py``), and the rank files on disk, written
through a hash and proved before a load (``files.py``)."""

from trainctl.workers.engine.checkpoint.shard import ShardCheckpoint, Staged

__all__ = ["ShardCheckpoint", "Staged"]
