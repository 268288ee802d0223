"""The binary wire format: exact round trips, no upcast, clear errors on bad frames."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from trainctl.api import TrainBatchRequest, wire


def batch(rng: np.random.Generator, n: int = 5) -> list[dict]:
    out = []
    for _ in range(n):
        length = int(rng.integers(1, 40))
        out.append(
            {
                "tokens": rng.integers(0, 50_000, length).tolist(),
                "loss_mask": rng.integers(0, 2, length).tolist(),
                "advantages": rng.normal(size=length).astype(np.float32).tolist(),
            }
        )
    return out


def test_sequences_round_trip_exactly() -> None:
    seqs = batch(np.random.default_rng(0))
    fields = {"loss": {"kind": "importance_sampling"}}
    out = wire.decode_sequences(wire.encode_sequences(seqs, fields))
    assert out["loss"] == fields["loss"]
    assert out["sequences"] == seqs  # float32 values survive bit for bit


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_floats_travel_in_the_callers_dtype(dtype: str) -> None:
    seqs = [{"tokens": [1, 2, 3], "weights": np.array([0.5, 1.25, 2.0], dtype=dtype)}]
    body = wire.encode_sequences(seqs, {}, float_dtype=dtype)
    _, arrays = wire.decode(body)
    assert arrays["weights"].dtype == np.dtype(dtype) and arrays["tokens"].dtype == np.int32
    assert arrays["weights"].tolist() == [0.5, 1.25, 2.0]


def test_bfloat16_is_16_bits_on_the_wire_and_exact_when_representable() -> None:
    x = np.array([1.0, -2.5, 0.15625, 3.0e38], np.float32)
    body = wire.encode({}, {"x": wire.to_bfloat16(x)})
    header_len = struct.unpack_from("<I", body, 8)[0]
    spec = json.loads(body[12 : 12 + header_len])["arrays"][0]
    assert spec["dtype"] == "bfloat16" and spec["nbytes"] == 2 * x.size
    _, arrays = wire.decode(body)
    got = arrays["x"]
    assert got.dtype == np.float32
    assert got[:3].tolist() == [1.0, -2.5, 0.15625]
    assert abs(got[3] - x[3]) / x[3] < 2**-8  # rounded to 8 significant bits


def test_large_token_ids_use_int64() -> None:
    body = wire.encode_sequences([{"tokens": [2**40, 1]}], {})
    _, arrays = wire.decode(body)
    assert arrays["tokens"].dtype == np.int64 and arrays["tokens"][0] == 2**40


def test_compression_round_trips_and_shrinks_repetitive_batches() -> None:
    seqs = [{"tokens": [7] * 10_000}]
    plain, packed = wire.encode_sequences(seqs, {}), wire.encode_sequences(seqs, {}, compress=True)
    assert len(packed) < len(plain) / 10
    assert wire.decode_sequences(packed)["sequences"] == seqs


def test_binary_and_json_validate_to_the_same_request() -> None:
    seqs = batch(np.random.default_rng(1))
    fields = {"loss": {"kind": "importance_sampling"}}
    for s in seqs:
        s["old_logprobs"] = [-1.0] * len(s["tokens"])
    via_json = TrainBatchRequest.model_validate_json(json.dumps({**fields, "sequences": seqs}))
    via_wire = TrainBatchRequest.model_validate(
        wire.decode_sequences(wire.encode_sequences(seqs, fields))
    )
    assert via_wire == via_json


def _frame(header: dict, payload: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<4sBBHI", b"TCTB", 1, 0, 0, len(h)) + h + payload


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"TC", "shorter than the frame prefix"),
        (b"JSON" + bytes(8), "not a application/vnd.trainctl.tensors frame"),
        (struct.pack("<4sBBHI", b"TCTB", 9, 0, 0, 0), "frame version 9"),
        (struct.pack("<4sBBHI", b"TCTB", 1, 0, 0, 3) + b"{x}", "header is not valid"),
        (_frame({"fields": {}, "arrays": []}), "lengths: missing"),
        (
            _frame(
                {"fields": {}, "arrays": [
                    {"name": "lengths", "dtype": "int64", "shape": [1], "offset": 0, "nbytes": 8},
                    {"name": "tokens", "dtype": "int64", "shape": [3], "offset": 8, "nbytes": 24},
                ]},
                struct.pack("<q", 3) + struct.pack("<qq", 1, 2),
            ),
            "tokens: bytes [8, 32) lie outside the payload",
        ),
        (
            _frame(
                {"fields": {}, "arrays": [
                    {"name": "lengths", "dtype": "int64", "shape": [1], "offset": 0, "nbytes": 8},
                    {"name": "tokens", "dtype": "int64", "shape": [2], "offset": 8, "nbytes": 16},
                ]},
                struct.pack("<q", 3) + struct.pack("<qq", 1, 2),
            ),
            "tokens: has 2 entries but the lengths add up to 3",
        ),
        (
            _frame(
                {"fields": {}, "arrays": [
                    {"name": "lengths", "dtype": "complex64", "shape": [1], "offset": 0,
                     "nbytes": 8},
                ]},
                bytes(8),
            ),
            "lengths: dtype 'complex64' is not one of",
        ),
        (
            _frame(
                {"fields": {}, "arrays": [
                    {"name": "lengths", "dtype": "int64", "shape": [2], "offset": 0, "nbytes": 8},
                ]},
                bytes(8),
            ),
            "lengths: shape [2] of int64 does not fill 8 bytes",
        ),
    ],
)  # fmt: skip
def test_bad_frames_name_the_field(body: bytes, words: str) -> None:
    with pytest.raises(wire.WireError, match=None) as e:
        wire.decode_sequences(body)
    assert words in str(e.value), str(e.value)


def test_per_sequence_columns_round_trip() -> None:
    rows = [np.array([0.0, -1.5], np.float32), np.array([0.0], np.float32)]
    fields, cols = wire.decode_per_sequence(
        wire.encode_per_sequence({"step": 3}, {"logprobs": rows, "entropy": None})
    )
    assert fields == {"step": 3} and set(cols) == {"logprobs"}
    assert [c.tolist() for c in cols["logprobs"]] == [r.tolist() for r in rows]
