"""Tinker's data, losses and results, to and from trainctl's own API (no I/O).

**Data shapes.** A Tinker ``Datum`` is ``model_input`` ``x[0..N)`` and per-position loss
inputs, where ``target_tokens[t]`` is the token predicted at position ``t``: the input shifted
by one, plus one token more. trainctl's sequence is ``tokens = x + [target_tokens[N-1]]``, and
its per-token fields sit on the *predicted* token, so Tinker's position ``t`` is trainctl's
``t + 1`` (position 0 predicts nothing). A datum whose targets are not its input shifted by
one, a 2-D (CSR) tensor, or an image or audio chunk is refused, naming the datum and key.

**Losses.** Tinker's losses are token sums with the client's weights: every request maps to
``normalization = sum``, and ``loss:sum`` is reported. Its keys map to trainctl's fields:

    target_tokens -> tokens (checked),  weights -> weights and loss_mask (weight != 0),
    logprobs (the sampler's) -> old_logprobs,  advantages -> advantages,
    sampler_logprobs -> sampler_logprobs (with tis_cap),  ref_logprobs (with kl_coef).

``sequence_ratio_mask`` (gspo: the tokens of the sequence ratio, Tinker's ``!= 0``) keeps its
name. Without ``weights`` every target counts for ``cross_entropy``; a policy loss counts the
**sampled positions**, where ``logprobs`` or ``advantages`` is non-zero (the cookbook's
``rl/train.py`` sends 0 placeholders over the prompt): its loss, GSPO's sequence ratio, the
sequence-level corrections and the RL metrics read those only. One rule, applied where the
native API applies it (``api/training.py``, ``sampled_positions``); an explicit ``weights``
or ``sequence_ratio_mask`` always wins. ``loss_fn_config``: ``clip_low_threshold`` and
``clip_high_threshold`` are *ratio bounds* (Tinker's ppo and cispo pages: the ratio is clamped
to ``[low, high]``, default 0.8 and 1.2), i.e. trainctl's ``clip_low = 1 - low`` and
``clip_high = high - 1`` (gspo clips its sequence ratio the same way); ``beta`` (dro),
``tis_cap``, ``kl_coef`` and the sequence-level corrections (``seq_tis_cap``, ``seq_mis_low`` /
``_high``, ``geo_mask_low`` / ``_high``) are trainctl's own. ``stable_reinforce`` is refused:
its objective is not published.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainctl.api import (
    ForwardBackwardRequest,
    ForwardBackwardResult,
    InvalidRequestError,
    LossConfig,
    LossKind,
    Normalization,
    StepResult,
)
from trainctl.api.batch import SequenceBatch
from trainctl.api.loss import LOSSES, UNPUBLISHED_LOSSES
from trainctl.service.tinker import proto

LOSS_KEYS: dict[str, str] = {
    "target_tokens": "tokens",
    "weights": "weights",
    "logprobs": "old_logprobs",
    "advantages": "advantages",
    "sampler_logprobs": "sampler_logprobs",
    "ref_logprobs": "ref_logprobs",
    "sequence_ratio_mask": "sequence_ratio_mask",
}
"""Tinker's ``loss_fn_inputs`` key -> trainctl's per-token field."""

_CORRECTIONS = ("seq_tis_cap", "seq_mis_low", "seq_mis_high", "geo_mask_low", "geo_mask_high")
_POLICY_CONFIG = ("tis_cap", "kl_coef", *_CORRECTIONS)
_KNOB_KEYS = {"clip_low": "clip_low_threshold", "clip_high": "clip_high_threshold", "beta": "beta"}
"""A ``LossSpec.knobs`` field -> its Tinker ``loss_fn_config`` key."""


def config_keys() -> dict[str, tuple[str, ...]]:
    """The ``loss_fn_config`` keys each loss reads, from its row of ``LOSSES``."""
    return {
        kind.value: (*(_KNOB_KEYS[k] for k in spec.knobs), *(_POLICY_CONFIG if spec.policy else ()))
        for kind, spec in LOSSES.items()
    }


TINKER_REDUCTIONS = ("mean", "sum", "min", "max", "slack", "hash2", "unique")
_REDUCTION = {"mean": "mean", "sum": "sum", "min": "min", "max": "max", "value": "mean"}
"""trainctl's metric reduction -> Tinker's (a per-call value folds by mean across chunks)."""


def _refuse(where: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: {problem}", details={"field": where})


def loss_config(loss_fn: str, config: dict[str, float | str]) -> LossConfig:
    """The ``LossConfig`` of a Tinker loss name and its ``loss_fn_config``."""
    if loss_fn in UNPUBLISHED_LOSSES:
        raise _refuse("loss_fn", f"{loss_fn!r}: {UNPUBLISHED_LOSSES[loss_fn]}")
    by_loss = config_keys()
    if loss_fn not in by_loss:
        known = ", ".join(by_loss)
        raise _refuse("loss_fn", f"{loss_fn!r} is not a loss trainctl computes ({known})")
    allowed = by_loss[loss_fn]
    numbers: dict[str, float] = {}
    for k, v in config.items():
        if k not in allowed:
            keys = ", ".join(allowed) or "none"
            raise _refuse(f"loss_fn_config.{k}", f"not read by {loss_fn} (its keys: {keys})")
        if isinstance(v, str) or not math.isfinite(v):
            raise _refuse(f"loss_fn_config.{k}", f"must be a finite number, got {v!r}")
        numbers[k] = float(v)
    low = numbers.get("clip_low_threshold", 0.8)
    high = numbers.get("clip_high_threshold", 1.2)
    if not 0.0 <= low <= 1.0 <= high:
        raise _refuse(
            "loss_fn_config",
            f"the ratio bounds must satisfy 0 <= clip_low_threshold <= 1 <= clip_high_threshold, "
            f"got {low} and {high}",
        )
    return LossConfig(
        kind=LossKind(loss_fn),
        normalization=Normalization.SUM,
        clip_low=1.0 - low,
        clip_high=high - 1.0,
        beta=numbers.get("beta", 0.0),
        kl_coef=numbers.get("kl_coef", 0.0),
        tis_cap=numbers.get("tis_cap"),
        **{k: numbers[k] for k in _CORRECTIONS if k in numbers},
    )


def _tensor(where: str, t: Any, n: int) -> np.ndarray:
    """A dense 1-D proto ``Tensor`` of ``n`` values."""
    if t.sparse_csr:
        raise _refuse(where, "sparse (CSR) tensors are not supported: send a dense 1-D array")
    dtypes = {
        proto.DTYPE_FLOAT32: np.float32,
        proto.DTYPE_INT64: np.int64,
        proto.DTYPE_INT32: np.int32,
    }
    if t.dtype not in dtypes:
        raise _refuse(where, f"dtype {t.dtype} is not supported (float32, int64 or int32)")
    values = np.frombuffer(t.dense, dtypes[t.dtype])
    if (len(t.shape) > 1 and math.prod(t.shape) != t.shape[0]) or values.size != n:
        shape = list(t.shape) or [values.size]
        raise _refuse(
            where, f"must be 1-D with one value per model_input token ({n}), got shape {shape}"
        )
    return values


def _tokens(i: int, datum: Any) -> np.ndarray:
    parts = []
    for j, chunk in enumerate(datum.model_input):
        if chunk.HasField("encoded_text"):
            parts.append(np.frombuffer(chunk.encoded_text.tokens, np.int32))
        else:
            raise _refuse(
                f"data[{i}].model_input.chunks[{j}]",
                "only text chunks are supported (trainctl trains text models: no image or "
                "audio input)",
            )
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    if tokens.size == 0:
        raise _refuse(f"data[{i}].model_input", "has no tokens")
    return tokens.astype(np.int64)


def datum_to_sequence(i: int, datum: Any, loss: LossConfig) -> dict[str, np.ndarray]:
    """One Tinker datum as a trainctl sequence (see the module docstring)."""
    x = _tokens(i, datum)
    n = x.size
    inputs = dict(datum.loss_fn_inputs)
    needed = {"target_tokens"} | {
        k for k, field in LOSS_KEYS.items() if field in loss.required_inputs()
    }
    optional = {"weights"}
    if loss.spec.policy:
        optional |= {"logprobs", "advantages", "sampler_logprobs", "ref_logprobs"}
    if loss.spec.sequence_ratio:
        optional.add("sequence_ratio_mask")
    for key in inputs:
        if key not in needed | optional:
            accepted = ", ".join(sorted(needed | optional))
            raise _refuse(
                f"data[{i}].loss_fn_inputs.{key}",
                f"not an input of {loss.kind.value} (it reads: {accepted})",
            )
    for key in sorted(needed):
        if key not in inputs:
            raise _refuse(f"data[{i}].loss_fn_inputs.{key}", f"required by {loss.kind.value}")
    y = _tensor(f"data[{i}].loss_fn_inputs.target_tokens", inputs["target_tokens"], n)
    y = y.astype(np.int64)
    if n > 1 and not np.array_equal(y[:-1], x[1:]):
        t = int(np.flatnonzero(y[:-1] != x[1:])[0])
        raise _refuse(
            f"data[{i}].loss_fn_inputs.target_tokens",
            f"must be model_input shifted by one (target_tokens[t] = model_input[t + 1]); "
            f"position {t} is {int(y[t])}, model_input[{t + 1}] is {int(x[t + 1])}",
        )
    seq: dict[str, np.ndarray] = {"tokens": np.concatenate([x, y[-1:]])}
    for key, field in LOSS_KEYS.items():
        if key == "target_tokens" or key not in inputs:
            continue
        values = _tensor(f"data[{i}].loss_fn_inputs.{key}", inputs[key], n)
        if field == "sequence_ratio_mask":  # a 0/1 mask: Tinker's "!= 0"
            seq[field] = np.concatenate([[0], values != 0]).astype(np.uint8)
        else:
            seq[field] = np.concatenate([[0.0], values.astype(np.float64)])
    if "weights" in seq:  # the client says which positions count
        mask = (seq["weights"] != 0).astype(np.uint8)
        mask[0] = 0
        seq["loss_mask"] = mask
    # Without weights: every target for cross-entropy; a policy loss reads the sampled
    # positions (api/training.py: sampled_positions), as the native API does.
    return seq


def forward_backward_request(msg: Any) -> ForwardBackwardRequest:
    """trainctl's ``forward_backward`` (or forward, with ``forward_only``) of a Tinker request."""
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for k, v in msg.loss_fn_config_v2.items():  # the newer map wins
        config[k] = v.text if v.WhichOneof("value") == "text" else v.number
    loss = loss_config(msg.loss_fn, config)
    if not msg.data:
        raise _refuse("data", "has no datum")
    seqs = [datum_to_sequence(i, d, loss) for i, d in enumerate(msg.data)]
    return ForwardBackwardRequest(
        sequences=SequenceBatch.from_sequences(seqs),
        loss=loss,
        packing=None,
        forward_only=msg.forward_only,
    )


def metrics(ours: dict[str, float]) -> dict[str, float]:
    """trainctl's metrics under Tinker's rule: one ``:`` then a Tinker reduction."""
    out = {}
    for key, value in ours.items():
        name, _, reduction = key.rpartition(":")
        if key == "loss:mean" or reduction not in _REDUCTION:
            continue
        out[f"{name.replace(':', '_')}:{_REDUCTION[reduction]}"] = float(value)
    return out


def _fill_batched(bt: Any, rows: list[np.ndarray]) -> None:
    """Per-datum float32 arrays into the proto ``BatchedTensor`` ``bt`` (byte offsets)."""
    data = np.concatenate(rows).astype(np.float32) if rows else np.zeros(0, np.float32)
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([r.size * 4 for r in rows], out=offsets[1:])
    bt.data, bt.offsets, bt.dtype = data.tobytes(), offsets.tobytes(), proto.DTYPE_FLOAT32


def forward_backward_output(result: ForwardBackwardResult) -> bytes:
    """Tinker's ``ForwardBackwardOutput`` (protobuf): per datum ``logprobs`` and
    ``elementwise_loss`` at Tinker's positions, and ``loss:sum`` with the mapped metrics."""
    msg = proto.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(result.logprobs))
    for name, per_seq in (
        ("logprobs", result.logprobs),
        ("elementwise_loss", result.elementwise_loss),
    ):
        _fill_batched(record.fields[name], [np.asarray(v[1:], np.float32) for v in per_seq])
    for k, v in metrics(result.metrics).items():
        msg.metrics[k] = v
    msg.metrics["loss:sum"] = float(result.loss)
    return bytes(msg.SerializeToString())


def optim_step_output(result: StepResult) -> dict[str, Any]:
    """Tinker's ``OptimStepResponse``."""
    out = metrics(result.metrics)
    out["step:max"] = float(result.step)
    return {"metrics": out}


@dataclass(frozen=True)
class TinkerPath:
    """``tinker://<model_id>/<kind>/<name>``: a server-issued weights path."""

    model_id: str
    kind: str
    name: str

    @classmethod
    def parse(cls, path: str, field: str = "path") -> TinkerPath:
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3 or not all(parts):
            raise _refuse(
                field, f"{path!r} is not a tinker://<model_id>/weights/<name> path issued by "
                "save_state",
            )  # fmt: skip
        return cls(*parts)

    def __str__(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"
