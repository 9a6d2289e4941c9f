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

Only floating-point arrays are compressed (in ArrayRecord key order, flattened);
others (e.g. BatchNorm's step counters) travel dense beside them.

Tuning: `make_group_topk_mod(density=0.01, group_size=256, value_dtype="fp16")`;
density first (1% keeps 3 of every 256 entries), error feedback stays on.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK
from fedring.flower import carrier

RECORD = "fedring.topk"  # the reply's ConfigRecord holding the compressed delta
_STATE = "fedring.mod.residual"
_KEY = "arrays"  # FedAvg's default arrayrecord_key


def _floats(record: ArrayRecord) -> list[str]:
    return [k for k, a in record.items() if np.dtype(a.dtype).kind == "f"]


def flatten(record: ArrayRecord, keys: list[str]) -> torch.Tensor:
    """The float arrays `keys` of `record` as one flat float32 vector."""
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
        keys = _floats(sent_global)
        before = flatten(sent_global, keys)
        reply = call_next(msg, context)
        if reply.has_error() or key not in reply.content.array_records or not keys:
            return reply
        trained = reply.content.array_records[key]
        if _floats(trained) != keys:
            raise ValueError(f"group_topk_mod: reply arrays {list(trained)} != sent {keys}")
        ef = ErrorFeedback(before.numel())
        if _STATE in context.state.array_records:
            ef.residual.copy_(torch.from_numpy(context.state.array_records[_STATE]["r"].numpy()))
        sent = topk.compress(ef.compensate(flatten(trained, keys) - before))
        ef.update(sent)
        context.state[_STATE] = ArrayRecord({"r": Array(ef.residual.numpy())})
        rnd = _round(msg)
        frames = carrier.pack(sent, src="node", dst="server", round=rnd, phase="delta")
        rest = {k: a for k, a in trained.items() if k not in keys}
        content = RecordDict(
            {name: rec for name, rec in reply.content.items() if name != key}  # metrics, configs
        )
        content[key] = ArrayRecord(rest)  # non-float arrays only (often none)
        content[RECORD] = ConfigRecord({"frames": frames, "round": rnd})
        return Message(content, reply_to=msg)

    return mod


def _round(msg: Message) -> int:
    """The strategy's "server-round" when the message has one (frames carry it)."""
    for record in msg.content.config_records.values():
        value = record.get("server-round")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 0


group_topk_mod: Mod = make_group_topk_mod()


class CompressedUplinks(Strategy):
    """Wrap a message-based strategy so it aggregates `group_topk_mod` replies."""

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
        return self.inner.aggregate_train(server_round, [self._expand(m) for m in replies])

    def _expand(self, reply: Message) -> Message:
        if reply.has_error() or RECORD not in reply.content.config_records:
            return reply
        if self._global is None:
            raise RuntimeError("CompressedUplinks: a reply arrived before any configure_train")
        keys = _floats(self._global)
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
