"""Adopt fedring's compression in a plain Flower app: four lines, two in each file.

    from fedring.flower.mod import group_topk_mod              # client_app.py
    app = ClientApp(mods=[group_topk_mod])                     # instead of ClientApp()

    from fedring.flower.mod import CompressedUplinks           # server_app.py
    strategy = CompressedUplinks(FedAvg(...))                  # instead of FedAvg(...)

`group_topk_mod` wraps the node's train function: it notes the global model the
message carried, lets the app train, and replaces the reply's dense arrays with
the group-top-k compressed *delta* (error feedback on, the residual kept in
`Context.state` across rounds), carried as fedring frames. `CompressedUplinks`
(`fedring.flower.uplinks`) turns the replies back into ArrayRecords before its
strategy aggregates. What travels compressed and what dense: `fedring.flower.uplink_record`.

The mod compresses only a train message stamped by `CompressedUplinks`, which
names the ArrayRecord to compress (the strategy's `arrayrecord_key`, "arrays" or
any other); it removes the stamp before the app sees the message. A message
without the stamp, from a strategy that is not wrapped or from a legacy
`flwr.server.strategy` app (NumPyClient, ``fitres.parameters``), is answered dense
and uncompressed, with a warning naming the fix: a mod alone cannot fail the run
on the ServerApp, and a dense reply keeps it learning, where a compressed reply
nobody decompresses would empty the global model.

A reply that does not match the global model it answers (an array missing,
added or reshaped; key order does not matter) is refused: the mod returns a
Flower error reply (`MOD_FAILED_PRECONDITION`, reason starting
"fedring.flower.mod refused") and `CompressedUplinks` raises `UplinkMismatch`.

Tuning: `make_group_topk_mod(density=0.01, group_size=256, value_dtype="fp16")`;
density first (1% keeps 3 of every 256 entries), error feedback stays on.
"""

from __future__ import annotations

from logging import WARNING

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK
from fedring.flower import carrier
from fedring.flower.uplink_record import (
    RECORD,
    REFUSED,
    STAMP,
    STATISTICS,
    UplinkMismatch,
    as_sent,
    compressed_keys,
    flatten,
    mismatch,
    unflatten,
)
from fedring.flower.uplinks import CompressedUplinks

__all__ = [
    "RECORD", "REFUSED", "STAMP", "STATISTICS", "CompressedUplinks", "UplinkMismatch",
    "as_sent", "compressed_keys", "flatten", "group_topk_mod", "make_group_topk_mod", "unflatten",
]  # fmt: skip

_STATE = "fedring.mod.residual"
UNSTAMPED = (
    "fedring.flower.mod: this train message was not sent by a strategy wrapped in "
    "CompressedUplinks, so its reply goes dense (uncompressed). To compress uplinks, write "
    "strategy = CompressedUplinks(FedAvg(...)) in the ServerApp (a Message-API strategy; a "
    "legacy flwr.server.strategy / NumPyClient app must move to the Message API first)."
)


def make_group_topk_mod(
    density: float = 0.01, group_size: int = 256, value_dtype: str = "fp16"
) -> Mod:
    """A client mod compressing the train reply's stamped ArrayRecord (see module doc)."""
    topk = GroupTopK.from_density(density, group_size, value_dtype)  # type: ignore[arg-type]

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type.split(".")[0] != "train":
            return call_next(msg, context)
        if STAMP not in msg.content.config_records:
            log(WARNING, UNSTAMPED)
            return call_next(msg, context)
        key = str(msg.content.config_records[STAMP].get("key", ""))
        # the app sees what plain Flower sends; a new RecordDict, since an in-process
        # grid may hand every node the same content object
        msg.content = RecordDict({n: r for n, r in msg.content.items() if n != STAMP})
        if key not in msg.content.array_records:
            have = list(msg.content.array_records)
            return _refusal(msg, f"the train message holds no ArrayRecord {key!r} (it has {have})")
        sent_global = msg.content.array_records[key]
        keys = compressed_keys(sent_global)
        before = flatten(sent_global, keys)
        reply = call_next(msg, context)
        if reply.has_error() or not keys:
            return reply
        if key not in reply.content.array_records:
            have = list(reply.content.array_records)
            return _refusal(msg, f"it holds no ArrayRecord {key!r} (it has {have})")
        trained = reply.content.array_records[key]
        differs = mismatch(sent_global, trained)
        if differs:
            return _refusal(msg, f"its arrays differ from the global model it answers ({differs})")
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
