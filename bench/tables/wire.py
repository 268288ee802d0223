"""The ``wire`` table of ``bench/run.py``."""

from __future__ import annotations

from bench.tables.common import measure, table


def section(quick: bool) -> str:
    n_seqs, seq_len = (64, 1024) if quick else (256, 4096)
    rows = []
    for encoding in ("json", "binary", "binary+zlib"):
        r = measure("wire_case", "api_cases", encoding=encoding, n_seqs=n_seqs, seq_len=seq_len,
                    repeats=3)  # fmt: skip
        rows.append(
            [
                encoding,
                f"{r['body_MB']:.1f}",
                f"{r['encode_s'] * 1e3:.0f}",
                f"{r['decode_s'] * 1e3:.1f}",
                f"{r['raw_MB'] / r['decode_s']:.0f}",
                f"{r['raw_MB'] / (r['encode_s'] + r['decode_s']):.0f}",
            ]
        )
    head = (
        f"### Wire format: {n_seqs} x {seq_len} = {n_seqs * seq_len / 2**20:.2f}M-token PPO batch "
        "(tokens, loss mask, advantages, old log-probs)\n\n"
        "encode: numpy arrays per sequence to the request body; decode+validate: the body to "
        "a validated `TrainBatchRequest` (numpy columns, checked vectorised: lengths, 0/1 masks, "
        "finite floats, dtypes, token ids against a 151,936-token vocabulary, lengths against "
        "the model's maximum). MB/s counts the batch's raw numeric bytes (int64 tokens, uint8 "
        "mask, float32 floats) per second. Target: decode+validate >= 1000 MB/s on the binary "
        "row. Best of 3.\n\n"
    )
    return head + table(
        ["encoding", "body MB", "encode ms", "decode+validate ms", "decode+validate MB/s",
         "encode+decode MB/s"],
        rows,
    )  # fmt: skip
