"""The real ``tinker`` SDK (0.38, unpatched) samples from trainctl's samplers.

A sampling client is pinned to the step its weights were saved at (Tinker's ``snapshot``),
and the ``sampled`` service's samplers keep the newest three synced versions
(``--sampler-versions 3``): a client made at step 0 samples exactly step 0 after step 2 too,
beside one made at step 2, on either of the two engines, and once step 0 leaves the window
it is refused with a 410 that says so, never answered with other weights
(``helpers/snapshots.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from helpers.parity import PARITY, WINDOW
from helpers.servicekit import Service
from helpers.snapshots import snapshots_hold_through_the_window

BASE = "trainctl-tiny"


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

            # Steps 0 and 2 after step 2, on either of the two engines; then step 0's 410.
            out = snapshots_hold_through_the_window(tc, native, None, window=WINDOW)
            assert out["steps"] == (0, 2), out

            path = tc.save_weights_for_sampler("tinker-sampled").result().path
            assert path.endswith("/sampler_weights/tinker-sampled")
            by_path = sc.create_sampling_client(model_path=path).result()
            got = by_path.sample(
                types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=3)
            ).result()
            assert len(got.sequences[0].tokens) == 3

            # The cookbook's stable_reinforce recipe asks for stability info: refused with
            # what to do instead, where the recipe meets it (its first sample).
            stable = tc.create_sampling_client(path, record_stability_info=True).result()
            with pytest.raises(
                Exception,
                match=r"record_stability_info: only the "
                r"stable_reinforce loss reads it.*'gspo' or 'importance_sampling'",
            ):
                stable.sample(
                    types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=3)
                ).result()
        finally:
            sc.close("success").result()
