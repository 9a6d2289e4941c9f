"""What `group_topk_mod` and `CompressedUplinks` agree on: record names and the
ArrayRecord <-> flat vector mapping.

The wrapper stamps every train message with a ConfigRecord `STAMP` naming the
ArrayRecord its inner strategy sends (FedAvg's `arrayrecord_key`); the mod
compresses only what a stamped message asks for, so the two ends never guess a
key, and a message without the stamp (no wrapper, or a legacy strategy) is
answered dense. The compressed delta travels in the reply's ConfigRecord `RECORD`.

Only floating-point weights are compressed (in the global model's key order,
flattened). Integer and bool arrays (BatchNorm's `num_batches_tracked`) and running
statistics (`*running_mean` / `*running_var`) travel dense beside them: a
statistic's delta is a distance to a moving target, not an update, and error
feedback re-sending what top-k left out overshot it (`running_var` went negative
on digits).
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

RECORD = "fedring.topk"  # the reply's ConfigRecord holding the compressed delta
STAMP = "fedring.uplink"  # the train message's ConfigRecord: {"key": ArrayRecord name}
REFUSED = "fedring.flower.mod refused"  # how a refusal's reason starts
STATISTICS = ("running_mean", "running_var")  # name endings of buffers sent dense


class UplinkMismatch(RuntimeError):
    """A node's mod refused its own train reply: the app and the strategy disagree."""


def compressed_keys(record: ArrayRecord) -> list[str]:
    """The arrays of `record` that travel compressed: floating, and not running statistics."""
    return [
        k for k, a in record.items() if np.dtype(a.dtype).kind == "f" and not k.endswith(STATISTICS)
    ]


def flatten(record: ArrayRecord, keys: list[str]) -> torch.Tensor:
    """The arrays `keys` of `record`, in the order of `keys`, as one flat float32 vector."""
    if not keys:
        return torch.zeros(0)
    parts = [np.asarray(record[k].numpy(), dtype=np.float32).reshape(-1) for k in keys]
    return torch.from_numpy(np.concatenate(parts))


def unflatten(flat: torch.Tensor, like: ArrayRecord, keys: list[str]) -> ArrayRecord:
    """An ArrayRecord shaped like `like`: `keys` from `flat`, the rest copied."""
    out: dict[str, Array] = {}
    offset = 0
    flat_np = flat.numpy()
    for k, a in like.items():
        if k in keys:
            n = int(np.prod(a.shape))
            values = flat_np[offset : offset + n].reshape(a.shape).astype(a.dtype)
            out[k] = Array(values)
            offset += n
        else:
            out[k] = a
    return ArrayRecord(out)


def mismatch(sent: ArrayRecord, reply: ArrayRecord) -> str:
    """How `reply` differs from `sent` in names or shapes ("" when it does not).

    Key order and dtypes are not compared: arrays are matched by name, and the
    compressed arrays are those that were sent as floats, whatever dtype the
    trained model gives them back in.
    """
    want = {k: tuple(a.shape) for k, a in sent.items()}
    got = {k: tuple(a.shape) for k, a in reply.items()}
    if want == got:
        return ""
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    reshaped = [f"{k} {want[k]}->{got[k]}" for k in want if k in got and want[k] != got[k]]
    return f"missing {missing}, extra {extra}, reshaped {reshaped}"


def as_sent(aggregated: ArrayRecord, sent: ArrayRecord) -> ArrayRecord:
    """`aggregated` with every array cast back to the dtype it had in `sent`.

    Averaging makes floats of integer arrays (FedAvg: ``int64 * weight``); those
    are rounded first, so a step counter averaged over nodes that all took the
    same steps comes back exact. Arrays `sent` does not hold are kept as they are.
    The order is `sent`'s (then the others): FedAvg keeps its first reply's order, and
    the next round's compressed entries, residual included, follow the global model's.
    """
    out: dict[str, Array] = {}
    order = [k for k in sent if k in aggregated] + [k for k in aggregated if k not in sent]
    for k in order:
        a = aggregated[k]
        dtype = np.dtype(sent[k].dtype) if k in sent else np.dtype(a.dtype)
        if dtype == np.dtype(a.dtype):
            out[k] = a
            continue
        values = a.numpy()
        if dtype.kind in "iub" and np.dtype(a.dtype).kind == "f":
            values = np.rint(values)
        out[k] = Array(np.asarray(values).astype(dtype))
    return ArrayRecord(out)
