"""Tinker's compressed protobuf bodies: inflated within a bound, and the ids read from the
head of a body too large to take (so its 413 reaches the right future)."""

from __future__ import annotations

from trainctl.api import InvalidRequestError, PayloadTooLargeError
from trainctl.service.codec import HEAD_BYTES


def unzstd(body: bytes, max_bytes: int) -> bytes:
    """``body`` inflated in a bounded stream: the body limit applies to the inflated size,
    whatever content size the frame states, and no more than ``max_bytes + 1`` bytes are
    ever produced."""
    import zstandard

    declared = zstandard.frame_content_size(body) if len(body) >= 18 else -1
    if declared > max_bytes:
        raise _inflates_past(max_bytes)
    out, size = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True) as r:
            while chunk := r.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise _inflates_past(max_bytes)
                out.append(chunk)
    except zstandard.ZstdError as e:
        raise InvalidRequestError(f"body: not valid zstd ({e})") from e
    return b"".join(out)


def unzstd_head(body: bytes) -> bytes:
    """The first ``HEAD_BYTES`` a zstd body (or its start) inflates to; b"" if it cannot
    say. Bounded: no more is ever inflated."""
    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as r:
            return bytes(r.read(HEAD_BYTES))
    except zstandard.ZstdError:
        return b""


def leading_ids(buf: bytes) -> tuple[str, int] | None:
    """``(model_id, seq_id)`` from the start of a ``ForwardBackwardRequest``: protobuf writes
    fields in number order, and these are fields 1 and 2, ahead of the data."""
    pos, model_id, seq_id = 0, None, None
    try:
        while pos < len(buf) and (model_id is None or seq_id is None):
            key, pos = _varint(buf, pos)
            if key == (1 << 3) | 2:  # model_id: length-delimited
                n, pos = _varint(buf, pos)
                model_id, pos = buf[pos : pos + n].decode(), pos + n
            elif key == (2 << 3) | 0:  # seq_id: varint
                seq_id, pos = _varint(buf, pos)
            else:
                break
    except (IndexError, UnicodeDecodeError):
        return None
    return None if model_id is None or seq_id is None else (model_id, seq_id)


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        value, shift, pos = value | (b & 0x7F) << shift, shift + 7, pos + 1
        if b < 0x80 or shift > 63:
            return value, pos


def _inflates_past(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"body: the zstd payload inflates past the limit of {limit} bytes",
        details={"limit_bytes": limit},
    )
