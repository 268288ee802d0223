"""Each model family end to end through the service: started from a checkpoint transformers
wrote (on a layout that splits what the family adds), trained a step, exported. The export has
the input's tensor names and dtypes (a tied model: no ``lm_head.weight``), and a second service
started from it gives the same eval loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import running_service
from hf_models import TIED, tiny_model
from test_service import ragged_batch

WEIGHTS = "model.safetensors"

# Tied embeddings split over two stages; Qwen3's wide heads over two TP ranks; experts over two
# EP ranks.
LAYOUTS = {
    "qwen2": {"pp": 2, "dp": 1},
    "qwen3": {"tp": 2, "dp": 1},
    "qwen3_moe": {"dp": 2, "ep": 2},
}


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_export_restarts_with_the_same_eval_loss(tmp_path: Path, family: str) -> None:
    from safetensors.torch import load_file

    source = tmp_path / "source"
    tiny_model(family, source)
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps({"layout": LAYOUTS[family]}))
    batch = ragged_batch(seed=31, vocab=256)
    with running_service(tmp_path / "a", f"--init-hf={source}", f"--engine-config={engine}") as a:
        c = a.client()
        assert c.info().model_name == "source"  # the HF directory's name: Tinker's base_model
        before = c.eval_batch(batch).loss
        c.train_batch(batch)
        want = c.eval_batch(batch).loss
        exported = c.export_hf()
    assert want < before  # the step changed the weights that are exported

    given, written = (
        load_file(str(d / "model.safetensors")) for d in (source, Path(exported.path))
    )
    assert {k: v.dtype for k, v in written.items()} == {k: v.dtype for k, v in given.items()}
    assert ("lm_head.weight" in written) == (family not in TIED)

    with running_service(tmp_path / "b", "--dp=1", f"--init-hf={exported.path}") as b:
        got = b.client().eval_batch(batch).loss
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
