"""`CompressedUplinks(strategy)`: a Message-API strategy that reads `group_topk_mod` replies.

    strategy = CompressedUplinks(FedAvg(...))        # instead of FedAvg(...)

Before the inner strategy aggregates, each compressed reply becomes an ArrayRecord
again (the global model sent + the decompressed delta, the dense arrays beside
it), so FedAvg, FedAvgM, FedProx, ... aggregate unchanged. The result is cast
back to the dtypes the server sent (`as_sent`: FedAvg averages integer counters
into floats). Replies without a compressed record pass through, so compressed and
plain nodes can mix. A reply the mod refused raises `UplinkMismatch`: every node
would refuse the same way, and a run that went on would "complete" without learning.

Every train message carries a stamp naming the inner strategy's ArrayRecord key
(`arrayrecord_key`, found through wrappers such as Flower's DP ones, or `key=`),
which is how the mod knows what to compress and that a wrapper will read it.

The wrapper *is* its strategy: `CompressedUplinks(FedAvg())` is an instance of a
class made once per strategy class, ``CompressedUplinks[FedAvg]``, a subclass of
both, whose instance shares the wrapped object's ``__dict__``. So
`isinstance(wrapped, FedAvg)` holds, `wrapped.fraction_train` reads and writes the
one state both names see, and every method not overridden here is FedAvg's own,
run on that state. Plain `__getattr__` delegation was the alternative: it forwards
reads but not `isinstance` or writes (`wrapped.fraction_train = 0.5` would set an
attribute nobody reads), and Flower's own code checks `isinstance(s, FedAvg)`.

It must be the outermost strategy: a wrapper around it (Flower's
`DifferentialPrivacyServerSideFixedClipping`, say) reads the replies before they
are decompressed, so that order is refused at the first round with the order to
use instead: ``CompressedUplinks(DifferentialPrivacyServerSideFixedClipping(FedAvg(), ...))``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedring.flower import carrier
from fedring.flower.uplink_record import (
    RECORD,
    REFUSED,
    STAMP,
    UplinkMismatch,
    as_sent,
    compressed_keys,
    flatten,
    unflatten,
)

DEFAULT_KEY = "arrays"  # FedAvg's default arrayrecord_key


def inner_key(strategy: Strategy) -> str:
    """The ArrayRecord key `strategy` sends, looked for through `.strategy` wrappers."""
    s: object = strategy
    for _ in range(16):  # a chain of wrappers, never a cycle
        key = getattr(s, "arrayrecord_key", None)
        if isinstance(key, str):
            return key
        s = getattr(s, "strategy", None)
        if s is None:
            break
    return DEFAULT_KEY


class CompressedUplinks(Strategy):
    """Wrap a Message-API strategy so it aggregates `group_topk_mod` replies (module doc).

    Parameters
    ----------
    inner : Strategy
        A `flwr.serverapp.strategy` strategy; wrappers such as Flower's DP go inside.
    key : str, optional
        The ArrayRecord the nodes train; default: the inner strategy's `arrayrecord_key`.
    """

    _made: ClassVar[dict[type, type]] = {}

    def __new__(cls, inner: Strategy | None = None, key: str | None = None) -> CompressedUplinks:
        if cls is not CompressedUplinks:  # a made class being copied: nothing to choose
            return super().__new__(cls)
        _check_inner(inner)
        made = cls._made.get(type(inner))
        if made is None:
            name = f"CompressedUplinks[{type(inner).__name__}]"
            made = type(name, (cls, type(inner)), {"__module__": __name__})
            cls._made[type(inner)] = made
        obj: CompressedUplinks = super().__new__(made)
        return obj

    def __init__(self, inner: Strategy, key: str | None = None) -> None:
        self.__dict__ = inner.__dict__  # one state for both names (module doc)
        self._fedring_key = key if key is not None else inner_key(inner)
        self._fedring_global: ArrayRecord | None = None
        self._fedring_rounds = 0  # the run's rounds, from `start` (0: not started by it)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        """The inner strategy's `start`; notes `num_rounds` for the mod's density auto."""
        self._fedring_rounds = num_rounds
        return super().start(grid, initial_arrays, num_rounds, *args, **kwargs)

    if TYPE_CHECKING:  # the inner strategy's attributes, for type checkers

        def __getattr__(self, name: str) -> Any: ...

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        outer = sys._getframe(1).f_locals.get("self")  # who asks: a strategy wrapping us?
        if isinstance(outer, Strategy) and outer is not self:
            raise TypeError(
                f"fedring: CompressedUplinks must be the outermost strategy, but "
                f"{type(outer).__name__} wraps it and would read the replies before they are "
                f"decompressed. Write CompressedUplinks({type(outer).__name__}(...)) instead."
            )
        self._fedring_global = arrays
        messages = list(super().configure_train(server_round, arrays, config, grid))  # type: ignore[safe-super]
        nodes = max(len(list(grid.get_node_ids())), len(messages), 1)
        for m in messages:  # rounds and participation: for the mod's density auto
            m.content[STAMP] = ConfigRecord(
                {"key": self._fedring_key, "rounds": self._fedring_rounds,
                 "participation": len(messages) / nodes}
            )  # fmt: skip
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        reasons = [str(m.error.reason or "") for m in replies if m.has_error()]
        refused = [r for r in reasons if REFUSED in r]
        if refused:
            raise UplinkMismatch(
                f"round {server_round}: {len(refused)} of {len(replies)} train replies "
                f"refused by fedring's group_topk_mod; the first: {refused[0]}"
            )
        expanded = [self._fedring_expand(m) for m in replies]
        arrays, metrics = super().aggregate_train(server_round, expanded)  # type: ignore[safe-super]
        if arrays is None or self._fedring_global is None:
            return arrays, metrics
        return as_sent(arrays, self._fedring_global), metrics

    def _fedring_expand(self, reply: Message) -> Message:
        """A compressed reply back as the ArrayRecord the inner strategy expects."""
        if reply.has_error() or RECORD not in reply.content.config_records:
            return reply
        if self._fedring_global is None:
            raise RuntimeError("CompressedUplinks: a reply arrived before any configure_train")
        sent = self._fedring_global
        keys = compressed_keys(sent)
        base = flatten(sent, keys)
        cfg = reply.content.config_records[RECORD]
        delta = carrier.unpack(
            list(cfg["frames"]),  # type: ignore[arg-type]
            src="node", dst="server", round=int(cfg["round"]),  # type: ignore[arg-type]
            phase="delta", numel=base.numel(),
        )  # fmt: skip
        delta.add_to(base)
        rebuilt = unflatten(base, sent, keys)
        for k, a in reply.content.array_records.get(self._fedring_key, ArrayRecord()).items():
            rebuilt[k] = a
        reply.content[self._fedring_key] = rebuilt
        del reply.content[RECORD]
        return reply


def _check_inner(inner: object) -> None:
    if isinstance(inner, CompressedUplinks) or "_fedring_key" in getattr(inner, "__dict__", {}):
        raise TypeError("fedring: this strategy is already wrapped in CompressedUplinks")
    if not isinstance(inner, Strategy):
        raise TypeError(
            f"fedring: CompressedUplinks wraps a Message-API strategy from "
            f"flwr.serverapp.strategy (FedAvg, FedAvgM, ...), not {type(inner).__module__}."
            f"{type(inner).__qualname__}. A legacy flwr.server.strategy app (NumPyClient, "
            "fitres.parameters) sends dense replies: move it to the Message API to compress them."
        )
    if not hasattr(inner, "__dict__"):
        raise TypeError(f"fedring: CompressedUplinks cannot share the state of {type(inner)!r}")
