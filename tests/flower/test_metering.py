"""`MeteredGrid` waits for replies promptly where Flower's deployment grid would not.

Flower's `HttpGrid` (a ServerApp on a SuperLink) sleeps 3 s between pulls in
`send_and_receive`. A stand-in grid here answers each message a set time after it
was pushed; the metered grid must hand the replies back within a pull interval of
their arrival, stop at the timeout with the replies that came, and count every byte.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.superlink.grid.http_grid import HttpGrid

from fedring.flower.metering import PULL_S, MeteredGrid, message_bytes
from tests.flower.inproc_grid import StubGrid


class SlowGrid(StubGrid):
    """Each node answers `delay[node]` s after its message was pushed (never if absent);
    `send_and_receive` sleeps 1 s before its one pull (Flower's HttpGrid: 3 s)."""

    def __init__(self, delay: dict[int, float]) -> None:
        self.delay = delay
        self.due: dict[str, tuple[float, Message]] = {}  # message id -> (when, reply)
        self.pulls = 0
        self.slow_calls = 0

    def get_node_ids(self) -> Iterable[int]:
        return list(self.delay)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = mid = uuid.uuid4().hex
            node = msg.metadata.dst_node_id
            if node in self.delay:
                reply = Message(RecordDict({"r": ConfigRecord({"node": node})}), reply_to=msg)
                self.due[mid] = (time.monotonic() + self.delay[node], reply)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self.pulls += 1
        now, ready = time.monotonic(), []
        for mid in list(message_ids):
            if mid in self.due and self.due[mid][0] <= now:
                ready.append(self.due.pop(mid)[1])
        return ready

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        self.slow_calls += 1
        ids = set(self.push_messages(messages))
        time.sleep(1)
        return list(self.pull_messages(ids))


def _messages(nodes: Iterable[int]) -> list[Message]:
    return [Message(RecordDict({"q": ConfigRecord({"x": 1})}), dst_node_id=n,
                    message_type="query.ping") for n in nodes]  # fmt: skip


def test_replies_come_back_within_a_pull_of_their_arrival_and_are_counted() -> None:
    inner = SlowGrid({1: 0.3, 2: 0.5})
    grid = MeteredGrid(inner, prompt=True)
    sent = _messages([1, 2])
    started = time.monotonic()
    replies = list(grid.send_and_receive(sent, timeout=30.0))
    took = time.monotonic() - started
    assert sorted(r.metadata.src_node_id for r in replies) == [1, 2]
    # within a pull of 0.5 s (0.67 s here), with room for a loaded CI machine; Flower's
    # HttpGrid: 3 s at least
    assert 0.5 <= took < 2.5, took
    assert inner.slow_calls == 0 and inner.pulls >= 2
    assert grid.down[1] == message_bytes(sent[0]) > 0
    assert grid.up == {r.metadata.src_node_id: message_bytes(r) for r in replies}
    assert (grid.sent, grid.received) == (2, 2)


def test_the_timeout_ends_the_wait_with_the_replies_that_came() -> None:
    grid = MeteredGrid(SlowGrid({1: 0.1}), prompt=True)  # node 2 never answers
    started = time.monotonic()
    replies = list(grid.send_and_receive(_messages([1, 2]), timeout=0.6))
    took = time.monotonic() - started
    assert [r.metadata.src_node_id for r in replies] == [1]
    assert 0.6 <= took < 2.5, took  # room for a loaded CI machine


def test_only_flowers_deployment_grid_is_pulled_promptly_by_default() -> None:
    assert MeteredGrid(HttpGrid(token="t")).pull_s == PULL_S
    inner = SlowGrid({1: 0.0})
    grid = MeteredGrid(inner)  # another grid keeps its own pace (the simulation's: 0.1 s)
    assert grid.pull_s is None
    assert [r.metadata.src_node_id for r in grid.send_and_receive(_messages([1]))] == [1]
    assert inner.slow_calls == 1 and grid.received == 1
    assert MeteredGrid(HttpGrid(token="t"), prompt=False).pull_s is None
