"""`fedring bench compress`: group-top-k beside global top-k compressors.

Baselines, timed in the same run on the same vector and keeping the same number
of entries as ours (k per group times the number of groups):
- global top-k (GRACE / DGC "TopK"): ``torch.topk(|x|, K)`` over the whole vector,
  then gather the values; indices as int32, values as the same dtype as ours;
- DGC sampled threshold: estimate the K-th magnitude from a 1% sample, then keep
  everything above it (approximately K).

"select + encode" is everything from the flat float32 vector to compact arrays
ready for a body (indices narrowed, values cast, int8 scales). Wire bytes are the
full encoded frames as a ring sends them: compact header, tag, every part.
`compression_ratio` = dense fp32 bytes / our wire bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from fedring.bench.timing import best_ms
from fedring.collective.payloads import decode_payload, encode_payload
from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK
from fedring.compression.payload import PayloadLimits
from fedring.compression.sparse import n_groups
from fedring.compression.values import BYTES_PER_VALUE, ValueDtype, torch_dtype
from fedring.wire.chunks import Reassembler, split_payload
from fedring.wire.compact import decode_compact, encode_compact
from fedring.wire.frame import Frame, FrameLimits

_KEY = b"bench-job-key"


def global_topk(
    x: torch.Tensor, k: int, value_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GRACE/DGC baseline compressor."""
    _, idx = torch.topk(x.abs(), k, sorted=False)
    return idx.to(torch.int32), x.gather(0, idx).to(value_dtype)


def sampled_threshold(
    x: torch.Tensor, k: int, value_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """DGC's sampling: threshold from a 1% sample, then a mask over the vector."""
    n = x.numel()
    sample = x[torch.randint(0, n, (max(1, n // 100),), generator=torch.Generator().manual_seed(0))]
    ks = max(1, round(sample.numel() * k / n))
    threshold = torch.topk(sample.abs(), ks, sorted=False).values.min()
    idx = torch.nonzero(x.abs() >= threshold).reshape(-1)
    return idx.to(torch.int32), x[idx].to(value_dtype)


def encode_wire(payload: Any, limits: FrameLimits) -> list[bytes]:
    meta, body = encode_payload(payload)
    template = Frame(kind="chunk", job="bench", src="a", dst="b", seq=0, meta=meta)
    return [encode_compact(f, _KEY) for f in split_payload(template, body, 0, limits)]


def decode_wire(frames: list[bytes], limits: FrameLimits) -> Any:
    parts = Reassembler(limits)
    for data in frames:
        done = parts.add(
            decode_compact(data, job="bench", src="a", dsts=("b",), key=_KEY, limits=limits)
        )
    head, body = done  # type: ignore[misc]
    return decode_payload(head.meta, body, PayloadLimits())


def _feedback(ef: ErrorFeedback, x: torch.Tensor, sent: Any) -> None:
    ef.compensate(x)
    ef.update(sent)


def run(
    numel: int = 10_000_000,
    density: float = 0.01,
    group_size: int = 256,
    value_dtype: ValueDtype = "fp16",
    repeats: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    ours = GroupTopK.from_density(density, group_size, value_dtype)
    # Same number of entries as ours (k per group, the padded tail group included).
    k_global = min(numel, ours.k * n_groups(numel, group_size))
    vt = torch_dtype(value_dtype) if value_dtype not in ("int8", "sign") else torch.float16
    limits = FrameLimits()

    payload = ours.compress(x)
    frames = encode_wire(payload, limits)
    wire_bytes = sum(len(f) for f in frames)
    ef = ErrorFeedback(numel)
    out = torch.zeros(numel)
    idx_g, _ = global_topk(x, k_global, vt)
    energy = float(x.pow(2).sum())
    result: dict[str, Any] = {
        "numel": numel,
        "density": density,
        "group_size": group_size,
        "k": ours.k,
        "effective_density": ours.density,
        "value_dtype": value_dtype,
        "threads": torch.get_num_threads(),
        "group_topk_ms": best_ms(lambda: ours.compress(x), repeats),
        "global_topk_ms": best_ms(lambda: global_topk(x, k_global, vt), repeats),
        "dgc_sampled_ms": best_ms(lambda: sampled_threshold(x, k_global, vt), repeats),
        "wire_encode_ms": best_ms(lambda: encode_wire(payload, limits), repeats),
        "wire_decode_ms": best_ms(lambda: decode_wire(frames, limits), repeats),
        "accumulate_ms": best_ms(lambda: payload.add_to(out), repeats),
        "error_feedback_ms": best_ms(lambda: _feedback(ef, x, payload), repeats),
        "bytes_dense_fp32": numel * 4,
        "bytes_compressed": wire_bytes,
        "bytes_payload": payload.wire_nbytes,
        "frames": len(frames),
        "bytes_global_topk": k_global * (4 + BYTES_PER_VALUE.get(value_dtype, 2)),
        "energy_kept_group_topk": float(payload.decompress().pow(2).sum()) / energy,
        "energy_kept_global_topk": float(x.gather(0, idx_g.long()).pow(2).sum()) / energy,
    }
    result["speedup_vs_global_topk"] = result["global_topk_ms"] / result["group_topk_ms"]
    result["compression_ratio"] = result["bytes_dense_fp32"] / wire_bytes
    return result
