"""The real ``tinker`` SDK (0.38, unpatched) samples from trainctl's samplers.

A sampling client is pinned to the step its weights were saved at (Tinker's ``snapshot``),
and trainctl's samplers keep the newest two synced versions (``--sampler-versions``'s
default): a client made at step k samples exactly step k after the next step too, on either
of the two engines, and once k leaves the window it is refused with a 410 that says so, never
answered with other weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from helpers.servicekit import Service

BASE = "trainctl-tiny"
PARITY = 1e-4


def _datum(tokens: list[int]) -> Any:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64)},
    )


def test_tinker_sampling_clients_sample_their_step(sampled: Service) -> None:
    with sampled.client() as native:
        native.load_checkpoint("untrained")  # create_model wants the base weights
        sc = tinker.ServiceClient(base_url=sampled.url, api_key="tml-local")
        try:
            (model,) = sc.get_server_capabilities().supported_models
            assert model.model_name == BASE and model.sampleable is True
            tc = sc.create_lora_training_client(base_model=BASE, rank=0).result()

            sampler = tc.save_weights_and_get_sampling_client().result()
            prompt = [1, 2, 3, 4]
            r = sampler.sample(
                types.ModelInput.from_ints(prompt), 3,
                types.SamplingParams(max_tokens=8, temperature=1.0, seed=4),
            ).result()  # fmt: skip
            assert len(r.sequences) == 3 and len({s.sequence_id for s in r.sequences}) == 3
            for s in r.sequences:
                assert s.stop_reason == "length" and len(s.tokens) == 8
                trainer = native.logprobs([prompt + s.tokens]).logprobs[0]
                assert np.abs(np.asarray(trainer[4:]) - np.asarray(s.logprobs)).max() <= PARITY

            scored = [5, 17, 3, 9, 22, 41]
            lps = sampler.compute_logprobs(types.ModelInput.from_ints(scored)).result()
            trainer = native.logprobs([scored]).logprobs[0]
            assert lps[0] is None
            assert np.abs(np.asarray(lps[1:]) - np.asarray(trainer[1:])).max() <= PARITY

            def step() -> None:
                tc.forward_backward([_datum(scored)], "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()

            step()  # synced after the step: steps 0 and 1 are served
            fresh = tc.save_weights_and_get_sampling_client().result()
            after = fresh.compute_logprobs(types.ModelInput.from_ints(scored)).result()
            trainer = native.logprobs([scored]).logprobs[0]
            assert np.abs(np.asarray(after[1:]) - np.asarray(trainer[1:])).max() <= PARITY
            assert np.abs(np.asarray(after[1:]) - np.asarray(lps[1:])).max() > 1e-3
            # The step-0 client still samples step 0, however the two engines are picked:
            # each request swaps in the version it names.
            for _ in range(3):
                for client, want in ((sampler, lps), (fresh, after)):
                    got = client.compute_logprobs(types.ModelInput.from_ints(scored)).result()
                    assert np.abs(np.asarray(got[1:]) - np.asarray(want[1:])).max() <= PARITY
            served = native.info().samplers
            assert served is not None and (served.versions, served.window) == ([0, 1], 2), served

            step()  # step 2: step 0 leaves the window
            with pytest.raises(Exception, match="step 0, which have left the samplers' window"):
                sampler.sample(
                    types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2)
                ).result()
            kept = fresh.compute_logprobs(types.ModelInput.from_ints(scored)).result()
            assert np.abs(np.asarray(kept[1:]) - np.asarray(after[1:])).max() <= PARITY

            path = tc.save_weights_for_sampler("tinker-sampled").result().path
            assert path.endswith("/sampler_weights/tinker-sampled")
            by_path = sc.create_sampling_client(model_path=path).result()
            got = by_path.sample(
                types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=3)
            ).result()
            assert len(got.sequences[0].tokens) == 3
        finally:
            sc.close("success").result()
