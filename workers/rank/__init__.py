"""The rank room: one Ray actor per rank (``worker.py``: ``RankWorker``) hosting that rank's
engine shard, the rank's side of exports (``export.py``), what a step plan is as the rank
receives it (``step_plan.py``) and the logs both sides write (``logs.py``). The controller
reaches it only through its rank group (``workers/control/rank_group.py``)."""
