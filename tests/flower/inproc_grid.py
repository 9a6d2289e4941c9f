"""A Flower `Grid` whose nodes are ClientApps called in this process, for fast failure tests.

Messages and replies are real `flwr.app.Message`s and every node keeps its own
`Context` (its state persists across messages, as on a SuperNode); a node can be
made to die when a chosen message reaches it, after which it never answers again,
or to lose one reply.
The simulation and deployment engines are tested elsewhere; this grid checks the
ServerApp's reactions to failures in seconds.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

RUN_ID = 7


class StubGrid(Grid):
    """What a test's grid needs no more of than Flower's abstract methods ask: no run,
    and messages built as they are."""

    def set_run(self, run: Run) -> None:
        raise NotImplementedError

    @property
    def run(self) -> Run:
        raise NotImplementedError

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:  # fmt: skip
        return Message(content, dst_node_id=dst_node_id, message_type=message_type,
                       group_id=group_id, ttl=ttl)  # fmt: skip


class InProcessGrid(StubGrid):
    def __init__(self, app: ClientApp, n: int) -> None:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, 0, 1
        self.app = app
        self.contexts = {
            100 + i: Context(RUN_ID, 100 + i, {"partition-id": i, "num-partitions": n},
                             RecordDict(), {})
            for i in range(n)
        }  # fmt: skip
        self.dead: set[int] = set()
        self.dies_on: dict[int, Callable[[Message], bool]] = {}
        self.loses_reply: dict[int, Callable[[Message], bool]] = {}
        self.delivered: list[Message] = []

    def die_when(self, node: int, predicate: Callable[[Message], bool]) -> None:
        self.dies_on[node] = predicate

    def lose_reply_when(self, node: int, predicate: Callable[[Message], bool]) -> None:
        """The node handles the message (its state moves on) but its reply is lost."""
        self.loses_reply[node] = predicate

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.contexts if n not in self.dead]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node in self.dies_on and self.dies_on[node](msg):
                self.dead.add(node)
            if node in self.dead:
                continue  # a dead node never answers: the caller's deadline passes
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.delivered.append(msg)
            reply = self.app(msg, self.contexts[node])
            if not (node in self.loses_reply and self.loses_reply[node](msg)):
                replies.append(reply)
        return replies
