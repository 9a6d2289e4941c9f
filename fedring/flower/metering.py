"""Bytes that Flower moves, counted from the messages themselves.

Flower 1.4x ships a message as a tree of content-addressed objects (the message,
its RecordDict, each record, each array and its chunks), each deflated to bytes
with a small header. `message_bytes` sums those deflated objects: what a
SuperNode pulls or pushes for one message, metadata and record keys included
(gRPC framing and TLS are not counted). `MeteredGrid` wraps any `Grid` and keeps
those sums per node in both directions, so fedring's ServerApp and a plain
Flower strategy are measured the same way.

On a SuperLink it also waits for replies promptly. Flower's deployment grid
(`HttpGrid`: a ServerApp that `flwr run` starts on a SuperLink) sleeps 3 s between
pulls in `send_and_receive`, so an exchange whose first pull came too early took at
least 3 s, and fedring's relayed ring makes 2(N - 1) + 1 exchanges a round. There the
pulls follow `PULL_S` (20 ms, then longer, at most 0.25 s apart). Other grids keep
their own `send_and_receive`: the simulation engine's pulls every 0.1 s already.
`prompt=False` keeps Flower's everywhere (the plain Flower FedAvg baseline does).
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.run import Run
from flwr.superlink.grid.http_grid import HttpGrid

PULL_S = (0.02, 0.05, 0.1, 0.25)  # the waits between pulls for replies; then the last


def message_bytes(message: Message) -> int:
    """Deflated size of every object in `message`'s tree (each counted once)."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


class MeteredGrid(Grid):
    """A `Grid` that counts the bytes of every message sent and every reply received.

    `down[node]` is what the ServerApp sent that node, `up[node]` what it replied.
    `prompt`: pull for replies every `PULL_S` rather than at the inner grid's pace
    (None: where the inner grid is Flower's `HttpGrid`).
    """

    def __init__(self, inner: Grid, prompt: bool | None = None) -> None:
        self.inner = inner
        if prompt is None:
            prompt = isinstance(inner, HttpGrid)
        self.pull_s: Sequence[float] | None = PULL_S if prompt else None
        self.down: defaultdict[int, int] = defaultdict(int)
        self.up: defaultdict[int, int] = defaultdict(int)
        self.sent = 0
        self.received = 0

    def set_run(self, run: Run) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Run:
        return self.inner.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def _count_out(self, messages: Iterable[Message]) -> list[Message]:
        out = list(messages)
        for m in out:
            self.down[m.metadata.dst_node_id] += message_bytes(m)
            self.sent += 1
        return out

    def _count_in(self, replies: Iterable[Message]) -> list[Message]:
        got = list(replies)
        for m in got:
            self.up[m.metadata.src_node_id] += message_bytes(m)
            self.received += 1
        return got

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(self._count_out(messages))

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._count_in(self.inner.pull_messages(message_ids))

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push `messages`, then pull their replies until all came or `timeout` (None:
        for ever, as Flower's grids) passed; the replies that came."""
        if self.pull_s is None:
            return self._count_in(
                self.inner.send_and_receive(self._count_out(messages), timeout=timeout)
            )
        waiting = set(self.push_messages(messages))
        end = None if timeout is None else time.monotonic() + timeout
        got: list[Message] = []
        for wait in itertools.chain(self.pull_s, itertools.repeat(self.pull_s[-1])):
            replies = list(self.pull_messages(waiting))
            got.extend(replies)
            waiting -= {m.metadata.reply_to_message_id for m in replies}
            left = None if end is None else end - time.monotonic()
            if not waiting or (left is not None and left <= 0):
                return got
            time.sleep(wait if left is None else min(wait, left))
        return got  # not reached: the waits repeat for ever

    def totals(self) -> dict[str, float]:
        """Per-node means and sums of both directions (nodes that took part)."""
        nodes = set(self.up) | set(self.down)
        n = max(1, len(nodes))
        return {
            "uplink_bytes_total": float(sum(self.up.values())),
            "downlink_bytes_total": float(sum(self.down.values())),
            "uplink_bytes_per_client": sum(self.up.values()) / n,
            "downlink_bytes_per_client": sum(self.down.values()) / n,
            "messages_sent": float(self.sent),
            "replies_received": float(self.received),
        }
