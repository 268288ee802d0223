"""The real controller's bookkeeping over fake ranks: a step is applied at most once per
idempotency key whatever fails after it, and "latest checkpoint" means the newest save."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from trainctl.api import (
    ConflictError,
    ExportRequest,
    LoadCheckpointRequest,
    Normalization,
    NotReadyError,
    OperationKind,
    OptimStepRequest,
    SaveCheckpointRequest,
    StepResult,
    TrainBatchRequest,
    WorkerError,
)
from trainctl.api.batch import SequenceBatch
from trainctl.workers.control.group import GroupLostError
from trainctl.workers.control.steps import Window

from helpers.fake_ranks import controller


def _gradients(c: object) -> None:
    """What a forward_backward part leaves behind: one window of gradients."""
    c.state.window = Window(Normalization.TOKEN_MEAN, parts=1, loss_tokens=4, raw_loss=2.0)  # type: ignore[attr-defined]


async def _step(c: object, key: str | None = None) -> StepResult:
    _gradients(c)
    return await c.run(OperationKind.OPTIM_STEP, OptimStepRequest(), key, key or "")  # type: ignore[attr-defined,no-any-return]


def test_a_failed_scheduled_checkpoint_is_reported_beside_the_applied_step(
    tmp_path: Path,
) -> None:
    """The review's case: a full disk at the scheduled checkpoint turned the call into a 5xx
    and dropped its key, so the SDK's retries applied the step again (5 steps for one call)."""
    c, ranks = controller(tmp_path, checkpoint_every_steps=1)

    async def main() -> None:
        await c.start()
        (tmp_path / "checkpoints").write_text("a file where the directory was: saves fail")
        first = await _step(c, key="k")
        assert first.step == 1 and c.step == 1
        assert len(first.warnings) == 1 and "scheduled checkpoint failed" in first.warnings[0]
        for _ in range(4):  # the retries of one call
            again = await c.run(OperationKind.OPTIM_STEP, OptimStepRequest(), "k", "k")
            assert again == first
        assert c.step == 1 and ranks.calls.count("apply") == 1 and ranks.version == 1

    asyncio.run(main())


def test_a_key_is_kept_once_the_step_applied_even_if_the_call_fails_after(
    tmp_path: Path,
) -> None:
    """A rank lost while the scheduled checkpoint is written: the step stands (reported, and
    the workers are restored), the key is kept."""
    c, ranks = controller(tmp_path, checkpoint_every_steps=1)

    async def main() -> None:
        await c.start()
        await _step(c, key="a")
        ranks.fail["save_checkpoint"] = [GroupLostError("rank 1 died", cause="rank 1 died")]
        second = await _step(c, key="b")
        assert second.step == 2 and "rank was lost" in second.warnings[0]
        await c.queue.idle()  # the recovery restores step-000001
        assert c.step == 1 and c.recovery.last is not None
        retry = await c.run(OperationKind.OPTIM_STEP, OptimStepRequest(), "b", "b")
        assert retry == second and ranks.calls.count("apply") == 2

    asyncio.run(main())


def test_recovery_restores_the_newest_history_not_the_highest_step(tmp_path: Path) -> None:
    """The review's case: load step 1 of a history that reached 5, train on, lose a rank:
    the restore went back to step 5 (steps_lost = -3)."""
    c, ranks = controller(tmp_path, checkpoint_every_steps=1, keep_checkpoints=10)

    async def main() -> None:
        await c.start()
        for _ in range(5):
            await _step(c)
        await c.run(
            OperationKind.LOAD_CHECKPOINT, LoadCheckpointRequest(checkpoint_id="step-000001")
        )
        assert c.step == 1 and ranks.version == 1
        await _step(c)  # step 2 of the new history
        await _step(c)  # step 3
        ranks.fail["apply"] = [GroupLostError("rank 0 died", cause="rank 0 died")]
        _gradients(c)
        op = await c.submit(OperationKind.OPTIM_STEP, OptimStepRequest())
        await c.queue.idle()
        assert c.queue.get(op.id).error is not None
        assert c.step == 3 and ranks.version == 3, (c.step, ranks.version)
        assert c.recovery.steps_lost == 0
        latest = (await c.list_checkpoints()).checkpoints[-1]
        assert (latest.checkpoint_id, latest.step) == ("step-000003", 3)

    asyncio.run(main())


def test_planning_a_large_batch_leaves_the_event_loop_free(tmp_path: Path) -> None:
    """The review's case: the controller planned on its only event loop, so a request of
    many tiny sequences froze readiness and every poll while it was planned."""
    c, _ = controller(tmp_path)
    n = 16384
    req = TrainBatchRequest(
        sequences=SequenceBatch(np.full(n, 2, np.int64), {"tokens": np.ones(2 * n, np.int64)})
    )

    async def main() -> tuple[float, float]:
        gaps: list[float] = []
        done = asyncio.Event()

        async def heartbeat() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        beat = asyncio.ensure_future(heartbeat())
        t0 = time.perf_counter()
        await c._prepare(OperationKind.TRAIN_BATCH, req)
        took = time.perf_counter() - t0
        done.set()
        await beat
        return took, max(gaps)

    took, worst = asyncio.run(main())
    assert worst < took / 3, f"the loop stalled {worst:.2f} s of {took:.2f} s of planning"


def test_a_load_that_fails_on_one_rank_changes_no_rank(tmp_path: Path) -> None:
    """Loads run in two phases: every rank reads and checks its shard, then all apply. A
    corrupt shard fails the load with every rank's weights as they were (no recovery)."""
    c, ranks = controller(tmp_path, checkpoint_every_steps=1)

    async def main() -> None:
        await c.start()
        await _step(c)
        await _step(c)
        (tmp_path / "checkpoints" / "step-000001" / "rank-00001.pt").write_text("corrupt")
        before = (await c.info()).weights_digest
        try:
            await c.run(OperationKind.LOAD_CHECKPOINT,
                        LoadCheckpointRequest(checkpoint_id="step-000001"))  # fmt: skip
        except Exception as e:
            assert "ValueError" in str(e), e
        else:
            raise AssertionError("the load of a corrupt shard succeeded")
        assert ranks.version == 2 and c.step == 2 and c.recovery.last is None
        assert "apply_checkpoint" not in ranks.calls and "drop_staged" in ranks.calls
        assert (await c.info()).weights_digest == before

        # A failure while applying may leave the ranks different: they are restored.
        ranks.fail["apply_checkpoint"] = [WorkerError("rank 1 failed in apply_checkpoint")]
        op = await c.submit(OperationKind.LOAD_CHECKPOINT,
                            LoadCheckpointRequest(checkpoint_id="step-000002"))  # fmt: skip
        await c.queue.idle()
        assert c.queue.get(op.id).error is not None
        assert c.recovery.last is not None and c.recovery.last.restored_checkpoint == "step-000002"

    asyncio.run(main())


def test_info_hashes_the_weights_once_per_version(tmp_path: Path) -> None:
    c, ranks = controller(tmp_path)

    async def main() -> None:
        await c.start()
        first = [(await c.info()).weights_digest for _ in range(3)]
        assert ranks.calls.count("weights_digest") == 1 and len(set(first)) == 1
        await _step(c)
        stepped = (await c.info()).weights_digest
        assert ranks.calls.count("weights_digest") == 2 and stepped != first[0]
        await c.run(OperationKind.SAVE_CHECKPOINT, SaveCheckpointRequest())
        await c.run(OperationKind.LOAD_CHECKPOINT,
                    LoadCheckpointRequest(checkpoint_id="step-000001"))  # fmt: skip
        assert (await c.info()).weights_digest == stepped  # the same weights, hashed anew
        assert ranks.calls.count("weights_digest") == 3

    asyncio.run(main())


def test_an_export_never_replaces_one_silently_and_crash_leftovers_are_swept(
    tmp_path: Path,
) -> None:
    c, _ = controller(tmp_path)
    (tmp_path / "exports" / "mine").mkdir(parents=True)
    (tmp_path / "exports" / ".partial-mine-123").mkdir()

    async def main() -> None:
        await c.start()
        assert not (tmp_path / "exports" / ".partial-mine-123").exists()
        try:
            await c.submit(OperationKind.EXPORT_HF, ExportRequest(name="mine"))
        except ConflictError as e:
            assert "pass overwrite" in e.message
        else:
            raise AssertionError("an export replaced 'mine' silently")
        assert c.queue.depth == 0 and (tmp_path / "exports" / "mine").is_dir()

    asyncio.run(main())


def _rewrite(root: Path, name: str, **fields: object) -> None:
    """Change a saved checkpoint's manifest, as if another service had written it."""
    import json

    path = root / "checkpoints" / name / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_what_loads_here_follows_the_format_and_the_model(tmp_path: Path) -> None:
    """Issue 49: a reshardable checkpoint written at another layout is the latest and loads
    (the ranks are told to cut it for theirs); a per-rank one of another layout and one of
    another model are passed over by "latest" and refused by a load, saying why; --resume
    NAME starts from that checkpoint, a missing one fails the start."""
    import pytest

    from trainctl.api import NotFoundError

    c, ranks = controller(tmp_path)
    foreign = {"dp": 4, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "vp": 1}

    async def main() -> None:  # one event loop for the controller's whole life
        await c.start()
        for name in ("other-layout", "per-rank", "other-model", "newest"):
            await _step(c)
            await c.run(OperationKind.SAVE_CHECKPOINT, SaveCheckpointRequest(name=name))
        _rewrite(tmp_path, "other-layout", layout=foreign)
        _rewrite(tmp_path, "per-rank", layout=foreign, format="per_rank")
        _rewrite(tmp_path, "other-model", model={**c.saves.model(), "hidden_size": 64})
        _rewrite(tmp_path, "newest", layout=foreign, format="per_rank")  # (of another layout)
        found = c.saves.restorable()  # newest last: what restore_latest tries first
        assert found and found[-1].checkpoint_id == "other-layout"

        for name, words in (("per-rank", "per-rank format"), ("other-model", "hidden_size 64")):
            with pytest.raises(ConflictError, match=words):
                await c.run(
                    OperationKind.LOAD_CHECKPOINT, LoadCheckpointRequest(checkpoint_id=name)
                )
        ranks.calls.clear()
        await c.run(
            OperationKind.LOAD_CHECKPOINT, LoadCheckpointRequest(checkpoint_id="other-layout")
        )
        assert c.step == 1 and "apply_checkpoint" in ranks.calls
        await _step(c)
        await c.run(OperationKind.SAVE_CHECKPOINT, SaveCheckpointRequest(name="after"))

    asyncio.run(main())

    again, _ = controller(tmp_path, resume="per-rank")
    with pytest.raises(ConflictError, match="per-rank format"):
        asyncio.run(again.start())
    latest, _ = controller(tmp_path)
    asyncio.run(latest.start())
    assert latest.step == 2  # "after", the newest save that loads here
    named, _ = controller(tmp_path, resume="other-layout")
    asyncio.run(named.start())
    assert named.step == 1
    missing, _ = controller(tmp_path, resume="nowhere")
    with pytest.raises(NotFoundError):
        asyncio.run(missing.start())


@pytest.mark.parametrize("replicated", [True, False])
def test_a_lost_rank_is_rebuilt_from_its_peers_unless_zero1_holds_one_copy(
    tmp_path: Path, replicated: bool
) -> None:
    """Three steps, a checkpoint at step 2, a rank lost in phase 1 of the fourth: with a
    replicated optimizer the survivors' state comes back (step 3, nothing lost); under ZeRO-1
    the checkpoint does (step 2, one step lost), saying why."""
    c, ranks = controller(tmp_path, replicated_optimizer=replicated, checkpoint_every_steps=2)

    async def main() -> None:
        await c.start()
        for _ in range(3):
            await _step(c)
        ranks.fail["finish_window"] = [GroupLostError("rank 1 died", cause="rank 1 died")]
        with pytest.raises(GroupLostError):
            await _step(c)
        await c.queue.idle()
        rec = c.recovery.last
        assert rec is not None
        if replicated:
            assert (rec.source, rec.restored_checkpoint, rec.peer_fallback) == ("peer", None, None)
            assert c.step == 3 and ranks.version == 3 and c.recovery.steps_lost == 0
            assert {"peer_step", "peer_state", "stage_peers"} <= set(ranks.calls)
        else:
            assert (rec.source, rec.restored_checkpoint) == ("checkpoint", "step-000002")
            assert rec.peer_fallback is not None and "ZeRO-1" in rec.peer_fallback
            assert c.step == 2 and ranks.version == 2 and c.recovery.steps_lost == 1
            assert "peer_state" not in ranks.calls

    asyncio.run(main())


def test_no_survivor_of_a_coordinate_falls_back_to_the_checkpoint(tmp_path: Path) -> None:
    c, ranks = controller(tmp_path, replicated_optimizer=True, checkpoint_every_steps=2)

    async def main() -> None:
        await c.start()
        for _ in range(3):
            await _step(c)
        ranks.dead = {0, 1}  # every replica of the one coordinate
        ranks.fail["finish_window"] = [GroupLostError("ranks died", cause="ranks died")]
        with pytest.raises(GroupLostError):
            await _step(c)
        await c.queue.idle()
        rec = c.recovery.last
        assert rec is not None and rec.source == "checkpoint" and c.step == 2
        assert rec.peer_fallback == "no rank survived"

    asyncio.run(main())


def test_a_rank_lost_in_the_update_before_applying_fails_retryable_and_frees_the_key(
    tmp_path: Path,
) -> None:
    """The update failed and the survivors are at the step before it: rebuilt inside the
    call from them, the step not applied, the error retryable and the key free again."""
    c, ranks = controller(tmp_path, replicated_optimizer=True)

    async def main() -> None:
        await c.start()
        await _step(c)
        ranks.fail["apply"] = [GroupLostError("rank 1 died", cause="rank 1 died in apply")]
        with pytest.raises(NotReadyError, match="survivors' state, which had not applied it"):
            await _step(c, key="k")
        assert c.recovery.last is not None and c.recovery.last.source == "peer"
        assert c.step == 1 and c.serving.ready
        again = await _step(c, key="k")  # the same key runs afresh, once
        assert again.step == 2 and ranks.version == 2

    asyncio.run(main())


def test_the_survivors_copy_waits_for_room_and_is_restored_on_the_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster has no room for the new ranks at first: the survivors are gone by the
    retry, so it restores the copy taken before the first try (taken once)."""
    from trainctl.workers.control import recovery
    from trainctl.workers.engine.config import ConfigError

    monkeypatch.setattr(recovery, "RECOVERY_RETRY_S", 0.05)
    c, ranks = controller(tmp_path, replicated_optimizer=True, checkpoint_every_steps=2)

    async def main() -> None:
        await c.start()
        for _ in range(3):
            await _step(c)
        ranks.place_errors = [ConfigError("no room for 2 ranks")]
        ranks.fail["finish_window"] = [GroupLostError("rank 1 died", cause="rank 1 died")]
        with pytest.raises(GroupLostError):
            await _step(c)
        while not c.serving.ready:
            await asyncio.sleep(0.05)
        rec = c.recovery.last
        assert rec is not None and rec.source == "peer" and c.step == 3, rec
        assert ranks.calls.count("peer_state") == 1 and c.recovery.steps_lost == 0

    asyncio.run(main())


def test_a_background_save_commits_after_the_step_and_is_listed_only_then(
    tmp_path: Path,
) -> None:
    """--async-save: the step answers while the ranks still write; info shows the save in
    flight; the checkpoint is listed once every rank's file is written, with the state the
    ranks copied at the step (not what they hold later)."""
    c, ranks = controller(tmp_path, checkpoint_every_steps=2, async_save=True)

    async def main() -> None:
        await c.start()
        ranks.write_polls = 5
        await _step(c)
        second = await _step(c)  # the scheduled save of step 2 starts, in the background
        assert second.step == 2 and not second.warnings
        flight = (await c.info()).save_in_flight
        assert flight is not None and flight.step == 2
        assert (await c.list_checkpoints()).checkpoints == []  # not listed before it is whole
        await _step(c)  # training goes on during the write
        await c.saves.flight.settle()
        info = await c.info()
        assert info.save_in_flight is None and info.last_save_error is None
        (saved,) = (await c.list_checkpoints()).checkpoints
        assert (saved.checkpoint_id, saved.step) == ("step-000002", 2)
        assert (tmp_path / "checkpoints" / "step-000002" / "rank-00000.pt").read_text() == "2"
        assert c.state.last_checkpoint_step == 2

    asyncio.run(main())


def test_a_failed_background_save_shows_in_info_and_leaves_nothing_listed(
    tmp_path: Path,
) -> None:
    c, ranks = controller(tmp_path, checkpoint_every_steps=1, async_save=True)

    async def main() -> None:
        await c.start()
        ranks.write_error = OSError(28, "No space left on device")
        first = await _step(c)
        assert first.step == 1
        await c.saves.flight.settle()
        info = await c.info()
        assert info.last_save_error is not None
        assert "step 1" in info.last_save_error and "No space left" in info.last_save_error
        assert (await c.list_checkpoints()).checkpoints == []
        assert list((tmp_path / "checkpoints").glob(".partial-*")) == []  # aborted, removed
        ranks.write_error = None
        await _step(c)  # the next one succeeds and clears the error
        await c.saves.flight.settle()
        assert (await c.info()).last_save_error is None
        assert [k.step for k in (await c.list_checkpoints()).checkpoints] == [2]

    asyncio.run(main())


def test_a_lost_node_shrinks_and_the_group_grows_back_after_a_checkpoint_outside_a_window(
    tmp_path: Path,
) -> None:
    """``--on-node-loss shrink``: a lost rank with too few slots left comes back on fewer
    replicas (the survivors' state, nothing lost). With the slots back, an explicit save while
    a ``forward_backward`` window is open grows nothing; the next step's checkpoint does, and
    the failure's record and ``steps_lost`` stay as they were."""
    c, ranks = controller(
        tmp_path, replicated_optimizer=True, on_node_loss="shrink", checkpoint_every_steps=1
    )

    async def main() -> None:
        await c.start()
        await _step(c)
        ranks.room = False  # a node leaves: the configured layout no longer fits
        ranks.fail["finish_window"] = [GroupLostError("rank 1 died", cause="rank 1 died")]
        with pytest.raises(GroupLostError):
            await _step(c)
        await c.queue.idle()
        lost = c.recovery.last
        assert ranks.shrunk and lost is not None and lost.source == "peer" and c.step == 1
        assert c.serving.taking_work and c.recovery.steps_lost == 0

        ranks.room = True  # the node is back
        spawns = ranks.calls.count("spawn")
        _gradients(c)  # a forward_backward part waits for its optim_step
        await c.run(OperationKind.SAVE_CHECKPOINT, SaveCheckpointRequest())
        await c.queue.idle()
        assert ranks.shrunk and ranks.calls.count("spawn") == spawns  # not inside the window
        c.state.window = None

        await _step(c)  # its checkpoint, then the grow, ahead of anything queued
        await c.queue.idle()
        assert not ranks.shrunk and ranks.calls.count("spawn") == spawns + 1
        assert c.step == 2 and ranks.version == 2 and c.serving.taking_work
        assert c.recovery.last == lost and c.recovery.steps_lost == 0

    asyncio.run(main())
