"""A batch of token sequences as flat numpy columns, validated vectorised (numpy only).

``SequenceBatch`` is what a request's ``sequences`` field holds, whichever encoding it came
in: the binary frame decodes straight into it (zero-copy views of the body), JSON goes
through the ``Sequence`` model for types and is then packed into it. The same vectorised checks
run either way, so both encodings accept and reject the same batches with the same
field-named messages, and the batch reaches the ranks without ever becoming Python lists.

Layout: ``lengths [n]`` and, per field of ``api/fields.py`` present, one flat column of
``sum(lengths)`` values in sequence order. ``batch[i]`` is a ``TokenSequence`` of views.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

from trainctl.api import expert_routes
from trainctl.api.errors import InvalidRequestError, field_error
from trainctl.api.fields import BY_NAME, FIELD_NAMES, OPTIONAL_FIELDS, FieldKind
from trainctl.api.sequence import Sequence

_HOST_DTYPE = {
    FieldKind.TOKEN: np.int64,
    FieldKind.MASK: np.uint8,
    FieldKind.FLOAT: np.float32,
    FieldKind.ROUTES: np.int64,
    FieldKind.STEP: np.int64,
}
"""What a JSON list becomes (float32: the precision the ranks compute the loss inputs in)."""


class TokenSequence:
    """One sequence's per-token arrays: views into a batch, or made directly (tests, benches).

    ``seq.tokens`` always exists; every other field of ``api/fields.py`` reads as its array or
    None (``seq.advantages``).
    """

    __slots__ = ("_cols",)

    def __init__(self, tokens: Any, **fields: Any) -> None:
        unknown = sorted(set(fields) - set(FIELD_NAMES))
        if unknown:
            raise TypeError(f"not per-token fields: {unknown}")
        cols = {"tokens": np.asarray(tokens)}
        cols.update({k: np.asarray(v) for k, v in fields.items() if v is not None})
        self._cols: dict[str, np.ndarray] = cols

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in BY_NAME:
            raise AttributeError(name)
        return self._cols.get(name)

    @property
    def tokens(self) -> np.ndarray:
        return self._cols["tokens"]

    def get(self, name: str) -> np.ndarray | None:
        return self._cols.get(name)

    def __len__(self) -> int:
        return int(self._cols["tokens"].shape[0])

    @property
    def num_loss_tokens(self) -> int:
        """Targets that count in the loss: masked tokens after position 0."""
        mask = self._cols.get("loss_mask")
        return len(self) - 1 if mask is None else int(np.count_nonzero(mask[1:]))


class SequenceBatch:
    """Validated flat columns of a batch; see the module docstring."""

    __slots__ = ("columns", "lengths", "offsets")

    def __init__(self, lengths: Any, columns: Mapping[str, np.ndarray]) -> None:
        """Check shapes, dtypes and values (vectorised); raise naming the first bad field."""
        self.lengths = np.asarray(lengths)
        if self.lengths.ndim != 1 or self.lengths.dtype.kind not in "iu":
            raise field_error("lengths", "must be a 1-D array of integers")
        if self.lengths.size == 0:
            raise field_error("sequences", "List should have at least 1 item")
        short = np.flatnonzero(self.lengths < 1)
        if short.size:
            raise field_error(f"sequences[{short[0]}].tokens", "must have at least 1 token")
        self.offsets = np.zeros(self.lengths.size + 1, np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        if "tokens" not in columns:
            raise field_error("tokens", "missing")
        self.columns = {k: columns[k] for k in FIELD_NAMES if k in columns}
        extra = sorted(set(columns) - set(self.columns))
        if extra:
            raise field_error(extra[0], "not a per-token field of a sequence")
        for name, col in self.columns.items():
            self._check_column(name, col)
            if BY_NAME[name].kind is FieldKind.MASK:  # narrowed only once its values are 0/1
                self.columns[name] = col.astype(np.uint8, copy=False)

    def _check_column(self, name: str, col: np.ndarray) -> None:
        total = int(self.offsets[-1])
        kind = BY_NAME[name].kind
        if kind is FieldKind.ROUTES:
            expert_routes.check_column(name, col, total, self.locate)
            return
        if col.ndim != 1 or col.shape[0] != total:
            raise field_error(name, f"has {col.size} entries but the lengths add up to {total}")
        if kind is FieldKind.FLOAT:
            if col.dtype.kind != "f":
                raise field_error(name, f"must be floats, got {col.dtype}")
            finite = np.isfinite(col)
            if not finite.all():
                k = int(np.flatnonzero(~finite)[0])
                i, j = self.locate(k)
                raise field_error(
                    f"sequences[{i}].{name}",
                    f"must be finite (no NaN or inf); position {j} is {col[k]}",
                )
        elif col.dtype.kind not in "iub":
            raise field_error(name, f"must be integers, got {col.dtype}")
        elif kind is FieldKind.STEP and col.size and col.min() < -1:
            k = int(np.argmin(col))
            i, j = self.locate(k)
            raise field_error(
                f"sequences[{i}].{name}[{j}]",
                f"must be a weights step (>= 0), or -1 for a token no sampler produced; got "
                f"{col[k]}",
            )
        elif kind is FieldKind.MASK and col.size and (col.min() < 0 or col.max() > 1):
            k = int(np.flatnonzero((col < 0) | (col > 1))[0])
            i, j = self.locate(k)
            raise field_error(
                f"sequences[{i}].{name}[{j}]",
                f"must be 0 or 1 (greater than or equal to 0 and less than or equal to 1), "
                f"got {col[k]}",
            )

    def check_routes(self, *, layers: int, top_k: int, num_experts: int) -> None:
        """Raise naming the field if ``routed_experts`` does not fit a model of ``layers`` MoE
        layers routing each token to ``top_k`` of ``num_experts`` experts."""
        col = self.columns.get("routed_experts")
        if col is not None:
            expert_routes.check_fit(col, self.locate, layers, top_k, num_experts)

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def from_sequences(cls, seqs: Iterable[Any]) -> SequenceBatch:
        """From per-sequence mappings or objects with per-token attributes (lists or arrays).

        A field absent from some sequences is filled with ones where its absence means ones
        (``loss_mask``, ``weights``); any other field is carried by every sequence or by none.
        """
        rows = [s if isinstance(s, Mapping) else _as_mapping(s) for s in seqs]
        if not rows:
            raise field_error("sequences", "List should have at least 1 item")
        rows = [_policy_step_as_token_steps(i, r) for i, r in enumerate(rows)]
        for i, r in enumerate(rows):
            unknown = sorted(set(r) - set(FIELD_NAMES))
            if unknown:
                raise field_error(
                    f"sequences[{i}].{unknown[0]}",
                    f"Extra inputs are not permitted (per-token fields: {', '.join(FIELD_NAMES)})",
                )
            if r.get("tokens") is None:
                raise field_error(f"sequences[{i}].tokens", "Field required")
        lengths = np.array([len(r["tokens"]) for r in rows], np.int64)
        columns = {"tokens": _concat(rows, "tokens", lengths)}
        present = [f for f in OPTIONAL_FIELDS if any(r.get(f.name) is not None for r in rows)]
        loss_inputs = [f.name for f in present if not f.default_one]
        if any([k for k in loss_inputs if r.get(k) is not None] != loss_inputs for r in rows):
            i, have, first = _first_disagreeing(rows, loss_inputs)
            raise InvalidRequestError(
                f"sequences[{i}] carries {have or 'no'} per-token loss inputs but sequences[0] "
                f"carries {first or 'none'}: every sequence needs the same",
                details={"field": f"sequences[{i}]"},
            )
        for f in present:
            columns[f.name] = _concat(rows, f.name, lengths)
        return cls(lengths, columns)

    # -- reading -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.lengths.size)

    def __getitem__(self, i: int) -> TokenSequence:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        a, b = int(self.offsets[i % n]), int(self.offsets[i % n + 1])
        seq = TokenSequence.__new__(TokenSequence)
        seq._cols = {k: v[a:b] for k, v in self.columns.items()}
        return seq

    def __iter__(self) -> Iterator[TokenSequence]:
        return (self[i] for i in range(len(self)))

    def column(self, name: str) -> np.ndarray | None:
        return self.columns.get(name)

    @property
    def present(self) -> tuple[str, ...]:
        """Names of the fields this batch carries besides ``tokens``."""
        return tuple(k for k in self.columns if k != "tokens")

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def locate(self, flat_index: int) -> tuple[int, int]:
        """``(sequence, position)`` of an index into the flat columns."""
        i = int(np.searchsorted(self.offsets, flat_index, side="right")) - 1
        return i, flat_index - int(self.offsets[i])

    def num_targets(self) -> np.ndarray:
        """Per sequence: target tokens (mask 1 after position 0)."""
        mask = self.columns.get("loss_mask")
        if mask is None:
            return self.lengths.astype(np.int64) - 1
        sums = np.add.reduceat(mask.astype(np.int64), self.offsets[:-1])
        return sums - mask[self.offsets[:-1]].astype(np.int64)

    def check_limits(self, *, vocab_size: int, max_seq_len: int) -> None:
        """Raise naming the first sequence too long or token outside the vocabulary."""
        long = np.flatnonzero(self.lengths > max_seq_len)
        if long.size:
            i = int(long[0])
            raise field_error(
                f"sequences[{i}].tokens",
                f"length {self.lengths[i]} exceeds the model's max_seq_len {max_seq_len}",
            )
        tokens = self.columns["tokens"]
        if tokens.min() < 0 or tokens.max() >= vocab_size:
            k = int(np.flatnonzero((tokens < 0) | (tokens >= vocab_size))[0])
            i, j = self.locate(k)
            raise field_error(
                f"sequences[{i}].tokens[{j}]",
                f"token id {tokens[k]} is outside the vocabulary [0, {vocab_size})",
            )

    def without(self, *names: str) -> SequenceBatch:
        """The same batch without some fields (log-probs read only the tokens)."""
        return SequenceBatch(
            self.lengths, {k: v for k, v in self.columns.items() if k not in names}
        )

    def to_dicts(self) -> list[dict[str, list[Any]]]:
        """One JSON-able dict per sequence (lists): the JSON encoding."""
        cols = {k: v.tolist() for k, v in self.columns.items()}
        bounds = self.offsets.tolist()
        return [
            {k: col[bounds[i] : bounds[i + 1]] for k, col in cols.items()} for i in range(len(self))
        ]

    def __eq__(self, other: object) -> bool:
        """Equal lengths and columns; a list of per-sequence dicts compares by ``to_dicts``."""
        if isinstance(other, list):
            return self.to_dicts() == other
        if not isinstance(other, SequenceBatch):
            return NotImplemented
        return (
            np.array_equal(self.lengths, other.lengths)
            and self.columns.keys() == other.columns.keys()
            and all(np.array_equal(v, other.columns[k]) for k, v in self.columns.items())
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, so unhashable (as list is)

    def __repr__(self) -> str:
        return f"SequenceBatch({len(self)} sequences, {self.num_tokens} tokens, {self.present})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (SequenceBatch, (self.lengths, self.columns))

    # -- pydantic ------------------------------------------------------------------------------

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        """JSON: ``list[Sequence]`` (types checked by pydantic, with field locations), then
        packed; Python: a ``SequenceBatch`` as is, or anything ``from_sequences`` takes."""
        as_list = core_schema.list_schema(handler.generate_schema(Sequence), min_length=1)
        from_list = core_schema.chain_schema(
            [as_list, core_schema.no_info_plain_validator_function(cls.from_sequences)]
        )
        return core_schema.json_or_python_schema(
            json_schema=from_list,
            python_schema=core_schema.union_schema(
                [core_schema.is_instance_schema(cls), from_list]
            ),
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda b: b.to_dicts(),
                return_schema=core_schema.list_schema(core_schema.dict_schema()),
            ),
        )


POLICY_STEP = "policy_step"
"""A sequence's JSON shorthand for ``token_steps``: every token sampled at this one step."""


def _as_mapping(seq: Any) -> dict[str, Any]:
    if isinstance(seq, TokenSequence):
        return dict(seq._cols)
    return {k: getattr(seq, k, None) for k in (*FIELD_NAMES, POLICY_STEP)}


def _policy_step_as_token_steps(i: int, row: Mapping[str, Any]) -> Mapping[str, Any]:
    """``row`` with its ``policy_step`` (if any) spelled out as ``token_steps``."""
    if POLICY_STEP not in row:
        return row
    out = {k: v for k, v in row.items() if k != POLICY_STEP}
    step = row[POLICY_STEP]
    if step is None:
        return out
    if out.get("token_steps") is not None:
        raise field_error(
            f"sequences[{i}].{POLICY_STEP}", "give policy_step or token_steps, not both"
        )
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or not 0 <= step < 2**63:
        raise field_error(
            f"sequences[{i}].{POLICY_STEP}", f"must be a step in [0, 2^63), got {step!r}"
        )
    tokens = out.get("tokens")
    out["token_steps"] = np.full(0 if tokens is None else len(tokens), step, np.int64)
    return out


def _concat(rows: list[Mapping[str, Any]], name: str, lengths: np.ndarray) -> np.ndarray:
    """One flat column of field ``name`` (ones where a default-one field is absent).

    Token ids become int64 and floats float32 (float arrays keep their dtype); a mask keeps
    the dtype it came in, so ``SequenceBatch`` checks its values before narrowing it.
    """
    field = BY_NAME[name]
    dtype = _HOST_DTYPE[field.kind]
    parts = []
    for i, (r, n) in enumerate(zip(rows, lengths.tolist(), strict=True)):
        v = r.get(name)
        if v is None:
            parts.append(np.ones(n, dtype))
            continue
        if len(v) != n:
            raise field_error(f"sequences[{i}].{name}", f"has {len(v)} entries but tokens has {n}")
        if field.kind is FieldKind.ROUTES:
            parts.append(expert_routes.of_sequence(v, f"sequences[{i}].{name}"))
        elif field.kind is FieldKind.MASK:
            parts.append(np.asarray(v))
        elif field.kind is FieldKind.FLOAT:
            is_float = getattr(v, "dtype", None) is not None and v.dtype.kind == "f"
            parts.append(v if is_float else np.asarray(v, dtype=dtype))
        else:
            try:
                parts.append(np.asarray(v, dtype=dtype))
            except OverflowError:
                j = next(k for k, t in enumerate(v) if not -(2**63) <= t < 2**63)
                raise field_error(
                    f"sequences[{i}].{name}[{j}]", f"token id {v[j]} is outside the vocabulary"
                ) from None
    if field.kind is FieldKind.ROUTES:
        expert_routes.check_same_shape(name, parts)
    return np.concatenate(parts)


def _first_disagreeing(rows: list[Mapping[str, Any]], names: list[str]) -> tuple[int, Any, Any]:
    first = [k for k in names if rows[0].get(k) is not None]
    for i, r in enumerate(rows):
        have = [k for k in names if r.get(k) is not None]
        if have != first:
            return i, have, first
    raise AssertionError("no disagreeing sequence")  # pragma: no cover
