"""Value dtypes shared by dense quantizers and top-k values.

`encode_values` turns float32 rows into the wire dtype (fp32, fp16, bf16, int8
with one scale per row, or sign: +-1 times the row's mean magnitude, one bit an
entry on the wire); `decode_values` is its inverse. Both sides of a link use
the same `decode_values`, so `decode(encode(v))` is the same bits everywhere.

Hazard, and why `exactify` exists: error feedback promises
``decompressed + residual == compensated`` bit for bit. That needs
``v - decode(v)`` to be exact in fp32, which holds for every dtype here by
Sterbenz's lemma except in corner cases (fp16 overflow, int8 entries rounded up
from just below half a step). `exactify` zeroes exactly those entries, so their
whole value stays in the residual instead of being half sent. `sign` values
cannot be 0, so for them the invariant holds to one rounding, not bit for bit.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

ValueDtype = Literal["fp32", "fp16", "bf16", "int8", "sign"]
VALUE_DTYPES: tuple[ValueDtype, ...] = ("fp32", "fp16", "bf16", "int8", "sign")
WIRE_DTYPE = {"fp32": "f4", "fp16": "f2", "bf16": "bf16", "int8": "i1", "sign": "u1"}
BYTES_PER_VALUE = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "sign": 0.125}
# sign values live in memory as int8 +-1 (times a float32 scale per row).
_TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}
_NAMES: dict[torch.dtype, ValueDtype] = {dt: name for name, dt in _TORCH.items()}  # type: ignore[misc]
_FP16_MAX = 65504.0
_INT8_MAX = 127.0


def float_wire(value_dtype: str) -> ValueDtype:
    """The float dtype that carries every entry for a job whose kept values travel as
    `value_dtype`: the same for fp32, fp16 and bf16; fp16 for int8 and sign (whose
    scales mean nothing without a selection)."""
    return value_dtype if value_dtype in ("fp32", "fp16", "bf16") else "fp16"  # type: ignore[return-value]


def check_value_dtype(name: str) -> ValueDtype:
    if name not in VALUE_DTYPES:
        raise ValueError(f"value dtype {name!r} is not one of {', '.join(VALUE_DTYPES)}")
    return name


def encode_values(
    rows: torch.Tensor, dtype: ValueDtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Encode float32 `rows` [n, m]; int8 gets one float32 scale per row."""
    if dtype == "fp32":
        return rows.to(torch.float32), None
    if dtype == "fp16":
        return rows.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16), None
    if dtype == "bf16":
        return rows.to(torch.bfloat16), None
    if dtype == "sign":
        signs = torch.where(rows > 0, 1, -1).to(torch.int8)
        return signs, rows.abs().mean(dim=1) if rows.shape[1] else rows.new_zeros(rows.shape[0])
    scales = rows.abs().amax(dim=1) / _INT8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q, scales


def decode_values(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Float32 rows from wire values (and int8 scales)."""
    if values.dtype == torch.int8:
        if scales is None:
            raise ValueError("int8 values need per-row scales")
        return values.to(torch.float32) * scales[:, None]
    return values.to(torch.float32)


def exactify(rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Zero the encoded entries whose residual ``rows - decoded`` would round."""
    return exactify_decoded(rows, values, scales)[0]


def exactify_decoded(
    rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`exactify`, and ``decode_values`` of what it returns (computed on the way):
    a zeroed entry decodes to 0.0 in every dtype, scales being finite and >= 0."""
    decoded = decode_values(values, scales)
    bad = (rows - decoded) + decoded != rows
    if bool(bad.any()):
        values = values.masked_fill(bad, 0)
        decoded = decoded.masked_fill(bad, 0.0)
    return values, decoded


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor; bf16 becomes its raw uint16 bit patterns."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.uint16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_numpy(a: np.ndarray, wire_dtype: str) -> torch.Tensor:
    """Tensor over `a`'s memory; `wire_dtype` tells bf16 apart from uint16."""
    if wire_dtype in ("bf16", "u2"):
        t = torch.from_numpy(a.view(np.int16))
        return t.view(torch.bfloat16) if wire_dtype == "bf16" else t.view(torch.uint16)
    return torch.from_numpy(a)


def torch_dtype(name: ValueDtype) -> torch.dtype:
    return _TORCH.get(name, torch.int8)


def dtype_name(t: torch.Tensor) -> ValueDtype:
    """The value dtype of a tensor (int8 tensors read as int8, never sign)."""
    name = _NAMES.get(t.dtype)
    if name is not None:
        return name
    raise ValueError(f"tensor dtype {t.dtype} is not a value dtype")
