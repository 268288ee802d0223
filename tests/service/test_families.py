"""A model family end to end through the service: Qwen3.5-MoE (the family that adds the most:
Gated DeltaNet, gated attention, routed and shared experts), started from a checkpoint
transformers wrote on a layout that splits all of it (tp2 x ep2), trained three steps by the
``tinker`` SDK and one natively, exported. The export has the input's tensor names and dtypes,
and an engine started from it as a service starts one gives the same eval loss. The service
also reports the router's routes and replays given ones over HTTP (binary and JSON).

Every family's import (all layouts), export (bit for bit) and trained export gathered from a
split layout are the distributed tier's (``tests/distributed/test_hf_import.py``): the
gateway and controller are the same for every family, so one family through the service
checks the path (each service start costs CI about a minute), and a dense service refusing
routes is ``test_service.py``'s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from helpers.batches import sft_batch
from helpers.hf_models import tiny_model
from helpers.servicekit import running_service

FAMILY = "qwen3_5_moe"
LAYOUT = {"tp": 2, "dp": 1, "ep": 2}


def test_a_family_trains_replays_routes_and_exports_through_the_service(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    source = tmp_path / "source"
    tiny_model(FAMILY, source)
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps({"layout": LAYOUT}))
    batch = sft_batch(seed=31, vocab=256)
    with running_service(tmp_path / "a", f"--init-hf={source}", f"--engine-config={engine}") as a:
        c = a.client()
        assert c.info().model_name == "source"  # the HF directory's name: Tinker's base_model
        _tinker_steps_lower_the_loss(a.url, batch)
        before = c.eval_batch(batch).loss
        _routes_over_http(a.url, c, batch, json.loads((source / "config.json").read_text()))
        c.train_batch(batch)
        want = c.eval_batch(batch).loss
        exported = c.export_hf()
    assert want < before  # the step changed the weights that are exported

    given, written = (
        load_file(str(d / "model.safetensors")) for d in (source, a.data_dir / exported.path)
    )
    assert {k: v.dtype for k, v in written.items()} == {k: v.dtype for k, v in given.items()}

    got = _restarted_eval(a.data_dir / exported.path, batch)
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def _restarted_eval(exported: Path, batch: list[dict]) -> float:
    """The eval loss of a one-rank engine started from ``exported`` the way ``trainctl serve
    --dp=1 --init-hf=<exported>`` starts one (``launch.engine_config``, then the rank's build),
    in a fresh interpreter (an engine leaves a process group and megatron's state behind): the
    service's own start from a family's checkpoint is the first half of the test, and a restart
    from an export through a service is ``test_reliability.py``'s."""
    out = subprocess.run(
        [sys.executable, "-c", _RESTART, str(exported)],
        input=json.dumps(batch),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return float(out.stdout.strip().splitlines()[-1])


_RESTART = """
import json, sys
from pathlib import Path
from trainctl.api import EvalBatchRequest
from trainctl.service.launch import engine_config
from trainctl.service.settings import Settings
from trainctl.workers.control.inprocess import InProcessEngine

engine = InProcessEngine(engine_config(Settings(dp=1, init_hf=Path(sys.argv[1]))), num_threads=2)
print(engine.eval_batch(EvalBatchRequest(sequences=json.load(sys.stdin))).loss)
"""


def _routes_over_http(url: str, c: Any, batch: list[dict], config: dict) -> None:
    """``logprobs`` reports the router's own routes, and the given ones when the batch carries
    ``routed_experts``, through the SDK's binary frames and through plain JSON."""
    probe = batch[:3]
    experts = config["num_experts"]
    layers, k = config["num_hidden_layers"], config["num_experts_per_tok"]
    own = c.logprobs(probe, return_routes=True)
    shapes = [(len(s["tokens"]), layers, k) for s in probe]
    assert [np.shape(r) for r in own.routed_experts] == shapes
    rng = np.random.default_rng(5)
    given = [np.argsort(rng.random((len(s["tokens"]), layers, experts)), axis=2)[..., :k]
             for s in probe]  # fmt: skip
    replay = [
        {"tokens": s["tokens"], "routed_experts": r.tolist()}
        for s, r in zip(probe, given, strict=True)
    ]
    # Random routes differ on any shared prefix, which tree packing computes once: flat.
    binary = c.logprobs(replay, return_routes=True, packing="flat")
    body = {"sequences": replay, "return_routes": True, "packing": "flat"}
    r = httpx.post(f"{url}/v1/logprobs", json=body, timeout=60)
    assert r.status_code == 200, r.text
    plain = r.json()
    for got in (binary.routed_experts, plain["routed_experts"]):
        for g, want in zip(got, given, strict=True):
            np.testing.assert_array_equal(np.sort(g, axis=2), np.sort(want, axis=2))
    np.testing.assert_allclose(plain["logprobs"][0], binary.logprobs[0], rtol=1e-6)
    assert binary.logprobs != own.logprobs  # other experts, other log-probs


def _tinker_steps_lower_the_loss(url: str, batch: list[dict]) -> None:
    """Three ``cross_entropy`` steps of the real ``tinker`` SDK (full fine-tuning: rank 0)."""
    tinker = pytest.importorskip("tinker", reason="the dev extra installs tinker")
    from tinker import types

    def datum(tokens: list[int]) -> Any:
        x, y = tokens[:-1], tokens[1:]
        inputs = {"target_tokens": y, "weights": [1.0] * len(y)}
        return types.Datum(model_input=types.ModelInput.from_ints(x), loss_fn_inputs=inputs)

    sc = tinker.ServiceClient(base_url=url, api_key="tml-families")
    training = sc.create_lora_training_client(base_model="source", rank=0).result()
    data = [datum(s["tokens"]) for s in batch[:4]]
    losses = []
    for _ in range(3):
        fb = training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.metrics["loss:sum"])
    print(f"{FAMILY} tinker cross_entropy losses: {[round(x, 3) for x in losses]}")
    assert losses[-1] < losses[0], losses
    sc.close("success").result()
