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

Tuning: `make_group_topk_mod(density="auto", group_size=256, value_dtype="fp16",
sit_out="pace", saving=10)`. ``density = "auto"`` (the default) takes the run's
rounds and the fraction of nodes trained a round from `CompressedUplinks`'s stamp
and chooses as `compression.policy` does for `fedring simulate`: enough density
that error feedback delivers within the rounds each node trains, at most what
keeps `saving` x fewer uplink bytes than dense, and a closing flush (every entry
in the last round) where the budget holds it; `sit_out` may raise k up to that
cap. A number fixes the density (1% keeps 3 of every 256 entries); error
feedback stays on.

Client sampling (`sit_out`). Where the strategy samples (FedAvg ``fraction_train``
< 1), a node trains only some rounds. Its residual does not grow while it sits out,
but it drains only when the node trains: at a fifth of the rounds, what the top-k
held back reaches the server five times later, in rounds, than at full
participation. The mod keeps in `Context.state` the server round the node last
trained and how many rounds it trained (from the message's "server-round"; without
one, nothing counts as missed), and `sit_out` says what a node back from m rounds
sat out does:

- ``"pace[:C]"``, the default: keeps the residual and sends k x (server round /
  rounds trained, this one included) entries a group, at most C = 3 x k: k per
  round elapsed, as at full participation, where it is exactly ``keep``;
- ``"keep"``: the residual as it was, k entries (the mod's behaviour before);
- ``"reset"``: zeroes the residual; ``"decay:G"``: multiplies it by G**m;
- ``"catch-up[:C]"``: keeps it and sends k x (1 + m), at most C = 3 x k.

Measured by ``python bench/flower_sampling.py --seeds 3`` (examples/flower_app,
digits MLP, 50 clients, FedAvg sampling 10 a round, the same clients for every run
of a seed, 40 rounds, 3 seeds): accuracy against plain FedAvg after the last round
/ over the last 10 rounds, and FedAvg's uplink bytes over the mod's::

    keep            -1.11 / -0.94 pp   45.7x     catch-up     -0.65 / -0.62 pp   29.7x
    reset           -2.04 / -2.08 pp   45.8x     pace         -0.28 / -0.56 pp   26.9x
    decay:0.5       -1.76 / -1.75 pp   45.7x     pace:4       -0.37 / -0.46 pp   23.6x
    decay:0.8       -1.11 / -1.29 pp   45.7x     keep at 3.5% -0.46 / -0.24 pp   25.8x
    full participation (every policy is keep there): -0.84 / -0.78 pp, 45.8x

Stale residuals were not what cost accuracy: dropping them (reset, decay) costs
more; sending more each time a node trains closes the gap (after 10 rounds keep
is at 0.844, pace 0.904, FedAvg 0.951). Pace, pace:4, catch-up and a 3.5% density
all end within 1 pp of FedAvg on both measures with at least 20x fewer uplink
bytes, and the differences among them are within the test set's noise (one of 360
samples is 0.28 pp). Pace is the default: the smallest final gap, and unlike a
higher density it changes nothing at full participation (1%, 45.8x); its cap
bounds the bytes at any participation rate (3 x 1%: 25.8x fewer for this MLP). A
node that joins late counts the rounds before it joined as sat out, so it sends
up to 3 x k until the rounds it trained catch up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from logging import WARNING

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK, k_for
from fedring.compression.policy import FLOOR, SAVING, cap_for, choose_density
from fedring.compression.settings import check_codec
from fedring.compression.values import VALUE_DTYPES
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
    "RECORD", "REFUSED", "SIT_OUT", "STAMP", "STATISTICS", "CompressedUplinks", "SitOut",
    "UplinkMismatch", "as_sent", "compressed_keys", "flatten", "group_topk_mod",
    "make_group_topk_mod", "unflatten",
]  # fmt: skip

_STATE = "fedring.mod.residual"
_ROUND = "fedring.mod.round"  # ConfigRecord {"round": last trained, "trained": times}
SIT_OUT = "pace"  # the default policy, chosen by bench/flower_sampling.py (module doc)
CAP = 3.0  # catch-up's and pace's k at most 3 x k: >= 25x fewer bytes than dense at 1%
UNSTAMPED = (
    "fedring.flower.mod: this train message was not sent by a strategy wrapped in "
    "CompressedUplinks, so its reply goes dense (uncompressed). To compress uplinks, write "
    "strategy = CompressedUplinks(FedAvg(...)) in the ServerApp (a Message-API strategy; a "
    "legacy flwr.server.strategy / NumPyClient app must move to the Message API first)."
)


@dataclass(frozen=True)
class SitOut:
    """What a node back from rounds it sat out does with its residual and its k."""

    kind: str  # keep | reset | decay | catch-up | pace
    factor: float = 1.0  # decay: residual x factor**missed; catch-up, pace: the cap on k's multiple

    @classmethod
    def parse(cls, text: str) -> SitOut:
        kind, sep, arg = str(text).partition(":")
        if kind in ("keep", "reset") and not sep:
            return cls(kind)
        number = _number(arg) if sep else math.nan
        if kind == "decay" and 0.0 <= number <= 1.0:
            return cls(kind, number)
        if kind in ("catch-up", "pace") and (not sep or number >= 1.0):
            return cls(kind, number if sep else CAP)
        raise ValueError(
            f"sit_out={text!r} must be keep, reset, decay:G (0 <= G <= 1), catch-up[:C] or "
            "pace[:C] (C >= 1)"
        )

    def residual(self, residual: torch.Tensor, missed: int) -> None:
        """Adjust, in place, the residual kept from before `missed` rounds sat out."""
        if missed > 0 and self.kind == "reset":
            residual.zero_()
        elif missed > 0 and self.kind == "decay":
            residual.mul_(self.factor**missed)

    def k(self, k: int, group_size: int, missed: int, pace: float) -> int:
        """Entries a group sends this round, of `k` at full participation: catch-up
        adds k for each of the `missed` rounds, pace multiplies k by the node's rounds
        per training so far (`pace`); both at most `factor` x k. The others: k."""
        if self.kind == "catch-up":
            times = 1.0 + missed
        elif self.kind == "pace":
            times = pace
        else:
            return k
        return min(group_size, max(k, int(k * min(times, self.factor))))


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def make_group_topk_mod(
    density: float | str = "auto", group_size: int = 256, value_dtype: str = "fp16",
    sit_out: str = SIT_OUT, saving: float = SAVING, local_steps: int = 1,
) -> Mod:  # fmt: skip
    """A client mod compressing the train reply's stamped ArrayRecord (see module doc);
    `sit_out` is the policy for a node back from rounds it did not train; ``density =
    "auto"`` chooses k each round from the run's rounds and the fraction trained a
    round (`compression.policy`, both stamped by `CompressedUplinks`), for at least
    `saving` x fewer uplink bytes than dense; `local_steps`, the steps the app takes
    a round, lets it choose a sparser density (the mod cannot see them: 1 is safe)."""
    auto = density == "auto"
    check_codec(
        density=0.01 if auto else density,
        group_size=group_size,
        value_dtype=value_dtype,
        value_dtypes=VALUE_DTYPES,
    )  # as ReducerSettings, JobSpec
    cap = cap_for(saving)
    topk = GroupTopK.from_density(0.01 if auto else density, group_size, value_dtype)  # type: ignore[arg-type]
    policy = SitOut.parse(sit_out)

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type.split(".")[0] != "train":
            return call_next(msg, context)
        if STAMP not in msg.content.config_records:
            log(WARNING, UNSTAMPED)
            return call_next(msg, context)
        stamp = msg.content.config_records[STAMP]
        key = str(stamp.get("key", ""))
        k_auto = _auto_k(stamp, _round(msg), group_size, saving, local_steps) if auto else None
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
        rnd = _round(msg)
        last, times = _history(context)
        missed = max(0, rnd - last - 1) if rnd > 0 and last >= 0 else 0
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
            policy.residual(ef.residual, missed)
        pace = rnd / (times + 1) if rnd > 0 and times >= 0 else 1.0
        if k_auto is None:
            k_now = policy.k(topk.k, topk.group_size, missed, pace)
        else:  # auto counted the participation already: sit_out may add up to the cap
            k_now = max(k_auto, min(policy.k(k_auto, group_size, missed, pace),
                                    k_for(cap, group_size)))  # fmt: skip
        sent = topk.compress(ef.compensate(flatten(trained, keys) - before), k=k_now)
        ef.update(sent)
        context.state[_STATE] = ArrayRecord({"r": Array(ef.residual.numpy())})
        context.state[_ROUND] = ConfigRecord({"round": rnd, "trained": max(times, 0) + 1})
        frames = carrier.pack(sent, src="node", dst="server", round=rnd, phase="delta")
        rest = {k: a for k, a in trained.items() if k not in keys}
        content = RecordDict(
            {name: rec for name, rec in reply.content.items() if name != key}  # metrics, configs
        )
        content[key] = ArrayRecord(rest)  # counters and running statistics (often none)
        content[RECORD] = ConfigRecord({"frames": frames, "round": rnd})
        return Message(content, reply_to=msg)

    return mod


def _auto_k(
    stamp: ConfigRecord, rnd: int, group_size: int, saving: float, local_steps: int = 1
) -> int:
    """k of density auto this round: the plan of the stamped rounds and participation;
    every entry in the last round (the closing flush). Without a stamp's rounds (a
    strategy not started by `start`), the plan of a long run: the floor, 1%."""
    rounds, part = stamp.get("rounds"), stamp.get("participation")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        return k_for(FLOOR, group_size)
    part = float(part) if isinstance(part, float | int) and 0 < part <= 1 else 1.0
    plan = choose_density(rounds=rounds, local=True, participation=part, saving=saving,
                          local_steps=local_steps)  # fmt: skip
    if plan.flush and rnd >= rounds - plan.flush + 1:  # server rounds count from 1
        return group_size
    return k_for(plan.density, group_size)


def _refusal(msg: Message, why: str) -> Message:
    reason = (
        f"{REFUSED} the train reply: {why}. Reply with the ArrayRecord the ServerApp sent, "
        "trained (same names and shapes), and wrap the ServerApp's strategy in "
        "CompressedUplinks (it keeps the global model's arrays and dtypes as sent)."
    )
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)


def _history(context: Context) -> tuple[int, int]:
    """(the server round this node last trained, how many rounds it trained), from its
    state; (0, 0) for a node that never trained (rounds start at 1, so the rounds it
    missed are those before this one), -1 for what is unknown: a round no message
    named ("server-round" missing), or a residual kept without this record."""
    if _ROUND in context.state.config_records:
        record = context.state.config_records[_ROUND]
        last, times = record.get("round"), record.get("trained")
        known = [isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (last, times)]
        return (last if known[0] else -1), (times if known[1] else -1)  # type: ignore[return-value]
    return (-1, -1) if _STATE in context.state.array_records else (0, 0)


def _round(msg: Message) -> int:
    """The strategy's "server-round" when the message has one (frames carry it)."""
    for record in msg.content.config_records.values():
        value = record.get("server-round")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 0


group_topk_mod: Mod = make_group_topk_mod()
