"""LoRA adapters through a real service (`trainctl serve --dp=2 --max-adapters=4
--adapters-in-memory=1`: ZeRO-1, and idle adapters beyond one wait on disk):
the native API and SDK, the exports read back by transformers and PEFT, and the real
``tinker`` SDK's default LoRA client. The tests run in file order on one service; each says
what it leaves."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainctl.api import ConflictError, InvalidRequestError, NotFoundError
from trainctl.service.tinker.bodies import native_name

from helpers.servicekit import Service, running_service

BATCH_A = [{"tokens": [5, 17, 3, 9, 22, 41, 7, 8, 30, 2, 11] * 2}, {"tokens": [1, 2, 3, 4, 5]}]
BATCH_B = [{"tokens": [40, 41, 42, 43, 44, 45, 46, 47] * 3}]
PROBE = [{"tokens": [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 17, 33]}]


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    data = tmp_path_factory.mktemp("adapters-data")
    # One idle adapter in host memory: the others wait on disk between their calls.
    flags = (
        "--dp=2",
        "--max-adapters=4",
        "--lora-max-rank=32",
        "--lr=0.01",
        "--adapters-in-memory=1",
    )
    with running_service(data, *flags) as s:
        yield s


def _lp(svc: Service, adapter: str | None, batch: list[dict] = PROBE) -> np.ndarray:
    return np.asarray(svc.client().logprobs(batch, adapter=adapter).logprobs[0])


def test_adapters_train_apart_and_the_base_never_moves(svc: Service) -> None:
    """Leaves adapters a (3 steps) and b (untrained)."""
    c = svc.client()
    digest, base_loss = c.info().weights_digest, c.eval_batch(BATCH_A).loss
    a = c.create_adapter("a", rank=4, alpha=8.0, seed=1)
    b = c.create_adapter("b", rank=8, alpha=16.0, targets=["attn"], seed=2)
    assert (a.rank, a.step, b.targets) == (4, 0, ["attn"]) and a.bytes > 0
    # B starts at zero: a new adapter is the base.
    assert c.eval_batch(BATCH_A, adapter="a").loss == pytest.approx(base_loss, rel=1e-6)
    b_before = c.eval_batch(BATCH_A, adapter="b").loss
    losses = [c.train_batch(BATCH_A, adapter="a").loss for _ in range(3)]
    assert c.eval_batch(BATCH_A, adapter="a").loss < losses[0]
    assert c.eval_batch(BATCH_A, adapter="b").loss == b_before
    assert c.eval_batch(BATCH_A).loss == base_loss
    assert c.info().weights_digest == digest
    steps = {x.name: x.step for x in c.list_adapters().adapters}
    assert steps == {"a": 3, "b": 0}


def test_refusals_name_the_field_and_the_limit(svc: Service) -> None:
    c = svc.client()
    with pytest.raises(NotFoundError, match=r"adapter 'nope' does not exist"):
        c.train_batch(BATCH_A, adapter="nope")
    with pytest.raises(InvalidRequestError, match=r"rank: 33 exceeds.*--lora-max-rank \(32\)"):
        c.create_adapter("big", rank=33)
    with pytest.raises(ConflictError, match="exists already"):
        c.create_adapter("a")
    with pytest.raises(InvalidRequestError, match="frozen base"):
        c.train_batch(BATCH_A)
    c.create_adapter("c")
    c.create_adapter("d")
    with pytest.raises(ConflictError, match=r"at most 4 \(--max-adapters\)"):
        c.create_adapter("e")
    c.delete_adapter("c")
    c.delete_adapter("d")
    with pytest.raises(NotFoundError):
        c.delete_adapter("d")
    assert sorted(x.name for x in c.list_adapters().adapters) == ["a", "b"]


def test_exports_load_in_transformers_and_peft(svc: Service) -> None:
    """The PEFT adapter on the exported base, and the merged model, give the service's
    log-probs under the adapter."""
    import transformers
    from peft import PeftModel

    c = svc.client()
    base = Path(c.export_hf("base").path)
    peft_dir = Path(c.export_hf("a-peft", adapter="a").path)
    merged_dir = Path(c.export_hf("a-merged", adapter="a", merged=True).path)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in peft_dir.iterdir()
    }
    want = _lp(svc, "a")
    assert np.abs(want - _lp(svc, None)).max() > 1e-4  # the adapter changes the model

    def logprobs(model: Any) -> np.ndarray:
        ids = torch.tensor([PROBE[0]["tokens"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].double()
        return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].numpy()

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    np.testing.assert_allclose(logprobs(PeftModel.from_pretrained(hf, peft_dir)), want[1:],
                               atol=1e-5)  # fmt: skip
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    np.testing.assert_allclose(logprobs(merged), want[1:], atol=1e-5)


def test_deleting_one_leaves_the_other(svc: Service) -> None:
    """Leaves only b."""
    c = svc.client()
    before = _lp(svc, "b")
    c.delete_adapter("a")
    assert [x.name for x in c.list_adapters().adapters] == ["b"]
    np.testing.assert_array_equal(_lp(svc, "b"), before)


# -- the real tinker SDK's default client: LoRA ---------------------------------------------

tinker = pytest.importorskip("tinker", reason="the dev extra installs tinker (Python >= 3.11)")
BASE = "trainctl-tiny"


def _datum(tokens: list[int]) -> Any:
    from tinker import types

    x, y = tokens[:-1], tokens[1:]
    return types.Datum(
        model_input=types.ModelInput.from_ints(x),
        loss_fn_inputs={"target_tokens": np.asarray(y, np.int64)},
    )


def _train(client: Any, data: list[Any], steps: int) -> list[float]:
    from tinker import types

    losses = []
    for _ in range(steps):
        out = client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=3e-3)).result()
        lp = np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])
        losses.append(float(-lp.mean()))
    return losses


def _forward(client: Any, data: list[Any]) -> np.ndarray:
    out = client.forward(data, "cross_entropy").result()
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


def test_tinker_lora_clients_train_their_own_adapters(svc: Service) -> None:
    """Two default LoRA clients (rank 32) train concurrently on different data; each one's
    forward equals a third client's with the first one's seed trained alone on its data, so
    nothing of the other leaked in. save_state then create_training_client_from_state_with_
    optimizer restores the saved adapter as the new client's own, and leaves the saver's."""
    sc = tinker.ServiceClient(base_url=svc.url, api_key="tml-test")
    data1 = [_datum(BATCH_A[0]["tokens"]), _datum(BATCH_A[1]["tokens"])]
    data2 = [_datum(BATCH_B[0]["tokens"])]
    one = sc.create_lora_training_client(base_model=BASE, rank=32, seed=11).result()
    two = sc.create_lora_training_client(base_model=BASE, rank=32, seed=12).result()
    info = one.get_info()
    assert info.is_lora is True and info.lora_rank == 32
    losses: dict[str, list[float]] = {}
    threads = [
        threading.Thread(target=lambda k=k, cl=cl, d=d: losses.__setitem__(k, _train(cl, d, 5)))
        for k, cl, d in (("one", one, data1), ("two", two, data2))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert losses["one"][-1] < losses["one"][0] and losses["two"][-1] < losses["two"][0]
    alone = sc.create_lora_training_client(base_model=BASE, rank=32, seed=11).result()
    assert _train(alone, data1, 5) == pytest.approx(losses["one"], rel=1e-6)
    np.testing.assert_allclose(_forward(one, data1), _forward(alone, data1), rtol=1e-6)
    assert np.abs(_forward(one, data2) - _forward(two, data2)).max() > 1e-3

    svc.client().delete_adapter(native_name(alone.model_id))  # room for the restored one
    saved = one.save_state("lora-one").result().path
    at_save = _forward(one, data1)
    _train(one, data1, 2)
    assert np.abs(_forward(one, data1) - at_save).max() > 1e-4
    back = sc.create_training_client_from_state_with_optimizer(saved).result()
    np.testing.assert_allclose(_forward(back, data1), at_save, rtol=1e-6)
    assert np.abs(_forward(one, data1) - at_save).max() > 1e-4  # a new adapter: one's own moved on
    # One adapter active, one idle in memory: the others wait on disk, on each rank.
    n = len(svc.client().list_adapters().adapters)
    assert n >= 3
    for rank in ("rank-00000", "rank-00001"):
        assert len(list((svc.data_dir / "adapters" / rank).glob("*.pt"))) == n - 2, rank
    sc.close("success").result()


def _step(c: Any, name: str) -> int:
    return next(a.step for a in c.list_adapters().adapters if a.name == name)


def test_an_adapter_saved_alone_loads_alone_under_its_owner(svc: Service) -> None:
    """The native API: an adapter's checkpoint holds that adapter alone, under its owner's
    names; loading it restores that adapter and nothing else: the base, and another adapter
    with a split step open, are the same to the bit. Leaves only b."""
    c = svc.client()
    for a in c.list_adapters().adapters:
        if a.name != "b":
            c.delete_adapter(a.name)
    c.create_adapter("p", rank=4, seed=3)
    for _ in range(2):
        c.train_batch(BATCH_A, adapter="p")
    digest, b_step = c.info().weights_digest, _step(c, "b")
    saved = c.save_checkpoint("mine", adapter="p", owner="alice")
    assert (saved.owner, saved.adapter, saved.step) == ("alice", "p", 2)
    theirs = c.save_checkpoint("mine", adapter="b", owner="bob")  # the same name, its own
    assert (theirs.owner, theirs.adapter) == ("bob", "b")
    assert [x.checkpoint_id for x in c.list_checkpoints(owner="alice").checkpoints] == ["mine"]
    assert "mine" not in {x.checkpoint_id for x in c.list_checkpoints().checkpoints}
    p_at = _lp(svc, "p")

    c.train_batch(BATCH_A, adapter="p")
    assert np.abs(_lp(svc, "p") - p_at).max() > 1e-4
    c.forward_backward(BATCH_B, adapter="b")  # b's split step, open across the load
    b_mid = _lp(svc, "b")
    loaded = c.load_checkpoint("mine", owner="alice", adapter="p")
    assert loaded.step == 2 and _step(c, "p") == 2
    assert np.abs(_lp(svc, "p") - p_at).max() == 0.0
    assert np.abs(_lp(svc, "b") - b_mid).max() == 0.0 and _step(c, "b") == b_step
    assert c.info().weights_digest == digest
    assert c.optim_step(adapter="b").step == b_step + 1  # its window survived the load

    c.load_checkpoint("mine", owner="alice", adapter="p", into="p2")  # a copy beside it
    assert np.abs(_lp(svc, "p2") - p_at).max() == 0.0 and _step(c, "p2") == 2
    with pytest.raises(InvalidRequestError, match="adapter='p'"):
        c.load_checkpoint("mine", owner="alice")  # an adapter's state is no whole state
    with pytest.raises(NotFoundError, match="'mine'"):
        c.load_checkpoint("mine")  # not one of the service's own names
    with pytest.raises(ConflictError, match="exists"):
        c.save_checkpoint("mine", adapter="p", owner="alice")
    for name in ("p", "p2"):
        c.delete_adapter(name)
