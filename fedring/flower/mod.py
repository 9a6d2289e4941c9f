"""Adopt fedring's compression in a plain Flower app with two lines.

    app = ClientApp(mods=[group_topk_mod])                  # instead of ClientApp()
    strategy = CompressedUplinks(FedAvg(...))               # instead of FedAvg(...)

`group_topk_mod` wraps the node's train function: it notes the global model the
message carried, lets the app train, and replaces the reply's dense ArrayRecord
with the group-top-k compressed *delta* (error feedback on, the residual kept in
`Context.state` across rounds), carried as fedring frames. `CompressedUplinks`
wraps any message-based strategy: before the inner strategy aggregates, it turns
each compressed reply back into an ArrayRecord (global + delta), so FedAvg,
FedAvgM, FedProx, ... run unchanged. Replies without a compressed record pass
through, so compressed and plain nodes can mix.

Only floating-point weights are compressed (in ArrayRecord key order, flattened).
Everything else travels dense beside them and is averaged by the inner strategy
as in plain Flower: integer and bool arrays (BatchNorm's `num_batches_tracked`)
and running statistics (arrays named `*running_mean` / `*running_var`, torch's
BatchNorm buffers). The statistics are not compressed because their delta is a
distance to a moving target, not an update: error feedback would re-send the
part top-k left out on top of the next round's own delta and overshoot, which
drove `running_var` negative and the model to a constant guess from round 2
(measured on digits). They are 2 floats per channel: sending them dense costs
little beside the weights.

FedAvg averages every array into a float, so `CompressedUplinks` casts the inner
strategy's result back to the dtypes the server sent: the global model keeps its
integer counters (rounded), as the app's `state_dict` had them. That cure sits on
the server, where the dtype change happens, rather than in every node; the mod
itself checks only what it needs to rebuild a reply (names and shapes as sent,
not dtypes), so a global model whose dtypes came from elsewhere is still
accepted, and both ends choose the compressed arrays from the same global model.

A reply that does not match the global model it answers is refused: the mod
returns a Flower error reply (`MOD_FAILED_PRECONDITION`, reason starting
"fedring.flower.mod refused"), and `CompressedUplinks` raises `UplinkMismatch`
on it, since every node would refuse the same way and a run that went on would
report "completed" without learning.

Tuning: `make_group_topk_mod(density=0.01, group_size=256, value_dtype="fp16")`;
density first (1% keeps 3 of every 256 entries), error feedback stays on.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK
from fedring.flower import carrier

RECORD = "fedring.topk"  # the reply's ConfigRecord holding the compressed delta
_STATE = "fedring.mod.residual"
_KEY = "arrays"  # FedAvg's default arrayrecord_key
REFUSED = "fedring.flower.mod refused"  # how a refusal's reason starts


class UplinkMismatch(RuntimeError):
    """A node's mod refused its own train reply: the app and the strategy disagree."""


STATISTICS = ("running_mean", "running_var")  # name endings of buffers sent dense


def compressed_keys(record: ArrayRecord) -> list[str]:
    """The arrays of `record` that travel compressed: floating, and not running statistics."""
    return [
        k for k, a in record.items() if np.dtype(a.dtype).kind == "f" and not k.endswith(STATISTICS)
    ]


def flatten(record: ArrayRecord, keys: list[str]) -> torch.Tensor:
    """The arrays `keys` of `record` as one flat float32 vector."""
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


def make_group_topk_mod(
    density: float = 0.01, group_size: int = 256, value_dtype: str = "fp16", key: str = _KEY
) -> Mod:
    """A client mod compressing the train reply's ArrayRecord `key` (see module doc)."""
    topk = GroupTopK.from_density(density, group_size, value_dtype)  # type: ignore[arg-type]

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type.split(".")[0] != "train" or key not in msg.content:
            return call_next(msg, context)
        sent_global = msg.content.array_records[key]
        keys = compressed_keys(sent_global)
        before = flatten(sent_global, keys)
        reply = call_next(msg, context)
        if reply.has_error() or key not in reply.content.array_records or not keys:
            return reply
        trained = reply.content.array_records[key]
        mismatch = _mismatch(sent_global, trained)
        if mismatch:
            return _refusal(msg, f"its arrays differ from the global model it answers ({mismatch})")
        ef = ErrorFeedback(before.numel())
        if _STATE in context.state.array_records:
            residual = context.state.array_records[_STATE]["r"].numpy()
            if residual.size != before.numel():
                return _refusal(
                    msg,
                    f"the global model has {before.numel()} compressed entries, the residual "
                    f"kept from an earlier round {residual.size}: its float arrays changed",
                )
            ef.residual.copy_(torch.from_numpy(residual))
        sent = topk.compress(ef.compensate(flatten(trained, keys) - before))
        ef.update(sent)
        context.state[_STATE] = ArrayRecord({"r": Array(ef.residual.numpy())})
        rnd = _round(msg)
        frames = carrier.pack(sent, src="node", dst="server", round=rnd, phase="delta")
        rest = {k: a for k, a in trained.items() if k not in keys}
        content = RecordDict(
            {name: rec for name, rec in reply.content.items() if name != key}  # metrics, configs
        )
        content[key] = ArrayRecord(rest)  # counters and running statistics (often none)
        content[RECORD] = ConfigRecord({"frames": frames, "round": rnd})
        return Message(content, reply_to=msg)

    return mod


def _shapes(record: ArrayRecord) -> dict[str, tuple[int, ...]]:
    return {k: tuple(a.shape) for k, a in record.items()}


def _mismatch(sent: ArrayRecord, reply: ArrayRecord) -> str:
    """How `reply` differs from `sent` in names or shapes ("" when it does not).

    Dtypes are not compared: the compressed arrays are those that were sent as
    floats, whatever dtype the trained model gives them back in.
    """
    want, got = _shapes(sent), _shapes(reply)
    if want == got:
        return ""
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    reshaped = [f"{k} {want[k]}->{got[k]}" for k in want if k in got and want[k] != got[k]]
    return f"missing {missing}, extra {extra}, reshaped {reshaped}"


def _refusal(msg: Message, why: str) -> Message:
    reason = (
        f"{REFUSED} the train reply: {why}. Reply with the ArrayRecord the ServerApp sent, "
        "trained (same names and shapes), and wrap the ServerApp's strategy in "
        "CompressedUplinks (it keeps the global model's arrays and dtypes as sent)."
    )
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)


def _round(msg: Message) -> int:
    """The strategy's "server-round" when the message has one (frames carry it)."""
    for record in msg.content.config_records.values():
        value = record.get("server-round")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 0


group_topk_mod: Mod = make_group_topk_mod()


def _refused(reply: Message) -> bool:
    return REFUSED in (reply.error.reason or "")


def as_sent(aggregated: ArrayRecord, sent: ArrayRecord) -> ArrayRecord:
    """`aggregated` with every array cast back to the dtype it had in `sent`.

    Averaging makes floats of integer arrays (FedAvg: ``int64 * weight``); those
    are rounded first, so a step counter averaged over nodes that all took the
    same steps comes back exact. Arrays `sent` does not hold are kept as they are.
    """
    out: dict[str, Array] = {}
    for k, a in aggregated.items():
        dtype = np.dtype(sent[k].dtype) if k in sent else np.dtype(a.dtype)
        if dtype == np.dtype(a.dtype):
            out[k] = a
            continue
        values = a.numpy()
        if dtype.kind in "iub" and np.dtype(a.dtype).kind == "f":
            values = np.rint(values)
        out[k] = Array(np.asarray(values).astype(dtype))
    return ArrayRecord(out)


class CompressedUplinks(Strategy):
    """Wrap a message-based strategy so it aggregates `group_topk_mod` replies.

    The inner strategy's result is cast back to the dtypes of the global model
    that was sent (`as_sent`), and a reply the mod refused raises `UplinkMismatch`.
    """

    def __init__(self, inner: Strategy, key: str = _KEY) -> None:
        self.inner = inner
        self.key = key
        self._global: ArrayRecord | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._global = arrays
        return self.inner.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        refused = [m.error.reason for m in replies if m.has_error() and _refused(m)]
        if refused:
            raise UplinkMismatch(
                f"round {server_round}: {len(refused)} of {len(replies)} train replies "
                f"refused by fedring's group_topk_mod; the first: {refused[0]}"
            )
        arrays, metrics = self.inner.aggregate_train(
            server_round, [self._expand(m) for m in replies]
        )
        if arrays is None or self._global is None:
            return arrays, metrics
        return as_sent(arrays, self._global), metrics

    def _expand(self, reply: Message) -> Message:
        if reply.has_error() or RECORD not in reply.content.config_records:
            return reply
        if self._global is None:
            raise RuntimeError("CompressedUplinks: a reply arrived before any configure_train")
        keys = compressed_keys(self._global)
        base = flatten(self._global, keys)
        cfg = reply.content.config_records[RECORD]
        delta = carrier.unpack(
            list(cfg["frames"]),  # type: ignore[arg-type]
            src="node", dst="server", round=int(cfg["round"]),  # type: ignore[arg-type]
            phase="delta", numel=base.numel(),
        )  # fmt: skip
        delta.add_to(base)
        rebuilt = unflatten(base, self._global, keys)
        dense_rest = reply.content.array_records.get(self.key, ArrayRecord())
        for k, a in dense_rest.items():
            rebuilt[k] = a
        reply.content[self.key] = rebuilt
        del reply.content[RECORD]
        return reply

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.inner.summary()
