"""The binary wire format: typed little-endian arrays in one frame (numpy only, no torch).

JSON stays for curl; the SDK sends and asks for this by default. Token ids travel as int32 or
int64, per-token floats in the caller's dtype (float16, bfloat16, float32 or float64): nothing
is upcast on the wire.

Frame layout::

    b"TCTB" | version: u8 | flags: u8 (bit 0: payload zlib-compressed) | reserved: u16
    | header_len: u32 LE | header: JSON, UTF-8 | payload

    header = {"fields": {...},  # every non-tensor field, as in the JSON body
              "arrays": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}

``offset``/``nbytes`` index the (decompressed) payload. A batch of sequences is sent as flat
arrays: ``lengths [n]`` and, concatenated in sequence order, one array per per-token field of
``api/fields.py`` that the batch carries (``tokens``, ``loss_mask`` as uint8, the floats).
bfloat16 has no numpy dtype: it travels as its raw 16 bits and decodes to float32 (exact).
A decoded batch is a ``SequenceBatch`` of views into the body: no Python lists on the way.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from trainctl.api.batch import SequenceBatch
from trainctl.api.errors import InvalidRequestError, PayloadTooLargeError
from trainctl.api.fields import OPTIONAL_FIELDS, FieldKind

CONTENT_TYPE = "application/vnd.trainctl.tensors"
JSON_CONTENT_TYPE = "application/json"

MAGIC = b"TCTB"
VERSION = 1
FLAG_ZLIB = 1
_PREFIX = struct.Struct("<4sBBHI")
MAX_INFLATED_BYTES = 1 << 30
"""A compressed payload inflates to at most this many bytes unless the caller says less
(the gateway passes its body limit: the limit applies to the inflated size)."""

DTYPES: dict[str, np.dtype[Any]] = {
    "uint8": np.dtype("<u1"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),  # raw bits; see ``_as_float``
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
_NAME_OF = {v: k for k, v in DTYPES.items() if k != "bfloat16"}


class WireError(InvalidRequestError):
    """A frame that cannot be decoded; the message names the field and the problem."""


def encode(
    fields: Mapping[str, Any], arrays: Mapping[str, np.ndarray], *, compress: bool = False
) -> bytes:
    """One frame holding ``fields`` (JSON-able) and ``arrays`` (little-endian, as given)."""
    specs, chunks, offset = [], [], 0
    for name, a in arrays.items():
        dtype = getattr(a, "wire_dtype", None) or _NAME_OF.get(a.dtype.newbyteorder("<"))
        if dtype is None:
            raise WireError(f"{name}: dtype {a.dtype} cannot be sent")
        raw = np.ascontiguousarray(a, dtype=DTYPES[dtype]).tobytes()
        specs.append(
            {"name": name, "dtype": dtype, "shape": list(a.shape), "offset": offset,
             "nbytes": len(raw)}
        )  # fmt: skip
        chunks.append(raw)
        offset += len(raw)
    header = json.dumps({"fields": dict(fields), "arrays": specs}).encode()
    payload = b"".join(chunks)
    flags = 0
    if compress:
        payload, flags = zlib.compress(payload, 1), FLAG_ZLIB
    return _PREFIX.pack(MAGIC, VERSION, flags, 0, len(header)) + header + payload


class BFloat16(np.ndarray):
    """A uint16 array marked to travel as bfloat16 (``to_bfloat16`` makes one)."""

    wire_dtype = "bfloat16"


def to_bfloat16(x: np.ndarray) -> BFloat16:
    """Round float32 ``x`` to bfloat16 (nearest even) and keep the raw 16 bits."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded.view(BFloat16)


def decode(
    body: bytes, *, max_inflated: int = MAX_INFLATED_BYTES
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(fields, arrays)`` of a frame; arrays are read-only views where not compressed. A
    compressed payload that would inflate past ``max_inflated`` bytes is a 413, found
    without inflating more than that."""
    if len(body) < _PREFIX.size:
        raise WireError(f"body: {len(body)} bytes is shorter than the frame prefix")
    magic, version, flags, _, header_len = _PREFIX.unpack_from(body)
    if magic != MAGIC:
        raise WireError(f"body: not a {CONTENT_TYPE} frame (magic {magic!r})")
    if version != VERSION:
        raise WireError(f"body: frame version {version}; this service reads {VERSION}")
    start = _PREFIX.size + header_len
    try:
        header = json.loads(body[_PREFIX.size : start])
        fields, specs = header["fields"], header["arrays"]
    except (ValueError, KeyError, TypeError) as e:
        raise WireError(f"body: the frame header is not valid: {e}") from None
    if not isinstance(fields, dict) or not isinstance(specs, list):
        raise WireError("body: the frame header needs a 'fields' object and an 'arrays' list")
    payload: bytes | memoryview = memoryview(body)[start:]
    if flags & FLAG_ZLIB:
        payload = inflate(payload, max_inflated)
    arrays = {}
    for spec in specs:
        name, a = _array(spec, payload)
        arrays[name] = a
    return fields, arrays


def inflate(data: bytes | memoryview, limit: int) -> bytes:
    """zlib ``data`` inflated, in one bounded pass: never more than ``limit + 1`` bytes."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as e:
        raise WireError(f"body: the compressed payload is corrupt: {e}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise PayloadTooLargeError(
            f"body: the compressed payload inflates past the limit of {limit} bytes",
            details={"limit_bytes": limit},
        )
    if not d.eof:
        raise WireError("body: the compressed payload is truncated")
    return out


def _array(spec: Any, payload: bytes | memoryview) -> tuple[str, np.ndarray]:
    try:
        name = str(spec["name"])
        dtype_name, shape = str(spec["dtype"]), [int(d) for d in spec["shape"]]
        offset, nbytes = int(spec["offset"]), int(spec["nbytes"])
    except (KeyError, TypeError, ValueError):
        raise WireError(f"body: array spec {spec!r} is not valid") from None
    if dtype_name not in DTYPES:
        raise WireError(f"{name}: dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
    dtype = DTYPES[dtype_name]
    count = math.prod(shape)  # Python ints: a shape cannot overflow into a small count
    if any(not 0 <= d < 2**62 for d in shape) or count * dtype.itemsize != nbytes:
        raise WireError(f"{name}: shape {shape} of {dtype_name} does not fill {nbytes} bytes")
    if offset < 0 or offset + nbytes > len(payload):
        raise WireError(f"{name}: bytes [{offset}, {offset + nbytes}) lie outside the payload")
    a = np.frombuffer(payload, dtype=dtype, count=count, offset=offset).reshape(shape)
    if dtype_name == "bfloat16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return name, a


# -- batches of sequences ------------------------------------------------------------------


def encode_sequences(
    sequences: list[Mapping[str, Any]] | SequenceBatch,
    fields: Mapping[str, Any],
    *,
    float_dtype: str = "float32",
    compress: bool = False,
) -> bytes:
    """A request body: ``sequences`` (a ``SequenceBatch``, or dicts with ``tokens`` and
    optional per-token fields as lists or arrays) as flat arrays, the other request ``fields``
    in the header."""
    batch = sequences if isinstance(sequences, SequenceBatch) else _batch_of(sequences)
    arrays: dict[str, np.ndarray] = {
        "lengths": batch.lengths.astype(np.int64, copy=False),
        "tokens": _narrow(batch.columns["tokens"]),
    }
    for f in OPTIONAL_FIELDS:
        col = batch.column(f.name)
        if col is None:
            continue
        if f.kind is FieldKind.MASK:
            arrays[f.name] = col.astype(np.uint8, copy=False)
        elif f.kind is FieldKind.ROUTES:  # expert ids: int32 is plenty
            arrays[f.name] = col.astype(np.int32, copy=False)
        elif f.kind is FieldKind.STEP:
            arrays[f.name] = _narrow(col)
        elif float_dtype == "bfloat16":
            arrays[f.name] = to_bfloat16(col)
        else:
            arrays[f.name] = col.astype(DTYPES[float_dtype], copy=False)
    return encode(fields, arrays, compress=compress)


def _narrow(ids: np.ndarray) -> np.ndarray:
    """Integers as int32 where every one fits, else int64 (nothing wraps)."""
    small = ids.size == 0 or (ids.min() >= -(2**31) and ids.max() < 2**31)
    return ids.astype(np.int32 if small else np.int64, copy=False)


def _batch_of(sequences: list[Mapping[str, Any]]) -> SequenceBatch:
    """Dicts of lists or arrays as columns; arrays keep their dtype (floats are not rounded
    to float32 before the caller's ``float_dtype`` is applied)."""
    with _as_wire_errors():
        return SequenceBatch.from_sequences(
            [{k: np.asarray(v) for k, v in s.items() if v is not None} for s in sequences]
        )


def decode_sequences(body: bytes, *, max_inflated: int = MAX_INFLATED_BYTES) -> dict[str, Any]:
    """The request of a sequences frame: ``{**fields, "sequences": SequenceBatch}``.

    The batch's own checks run here (sizes, dtypes, 0/1 masks, finite floats; vectorised,
    naming the field); the request model then checks the rest exactly as for JSON.
    """
    fields, arrays = decode(body, max_inflated=max_inflated)
    if "sequences" in fields:
        raise WireError("sequences: send them as arrays, not in the header fields")
    if "lengths" not in arrays:
        raise WireError("lengths: missing from the frame")
    lengths = arrays.pop("lengths")
    with _as_wire_errors():
        return {**fields, "sequences": SequenceBatch(lengths, arrays)}


@contextlib.contextmanager
def _as_wire_errors() -> Iterator[None]:
    """A batch that fails its checks is a bad frame: the same message, as a ``WireError``."""
    try:
        yield
    except WireError:
        raise
    except InvalidRequestError as e:
        raise WireError(e.message, e.details) from None


def encode_per_sequence(
    fields: Mapping[str, Any], columns: Mapping[str, list[np.ndarray] | None]
) -> bytes:
    """A response body with per-sequence columns: floats as float32 (e.g. log-probs and
    entropy), integers as int32 (e.g. routes ``[tokens, layers, top_k]``)."""
    present = {k: v for k, v in columns.items() if v is not None}
    first = next(iter(present.values()), [])
    arrays: dict[str, np.ndarray] = {"lengths": np.array([len(x) for x in first], np.int64)}
    for name, seqs in present.items():
        dtype = np.int32 if seqs and seqs[0].dtype.kind in "iu" else np.float32
        arrays[name] = np.concatenate(seqs).astype(dtype) if seqs else np.zeros(0, dtype)
    return encode(fields, arrays)


def decode_per_sequence(body: bytes) -> tuple[dict[str, Any], dict[str, list[np.ndarray]]]:
    """Inverse of ``encode_per_sequence``: fields and each column split per sequence."""
    fields, arrays = decode(body)
    lengths = arrays.pop("lengths")
    cuts = np.cumsum(lengths)[:-1]
    return fields, {k: np.split(v, cuts) for k, v in arrays.items()}
