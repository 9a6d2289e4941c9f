"""A member's link to a star's centre: the channel, the centre's name, one round trip.

With ``topology = "star"`` (and for median and trimmed mean) a member sends its
compressed update up to the centre and waits for the one reply every member gets;
a member that sits a round out (client sampling) only takes the reply. This module
is that link and nothing more: `Reducer.star` compresses and hands the payload to
a `Centre`, and what the centre does with it (`engine.centre.serve`, the MQTT
coordinator) is the layer above, which the reducer never imports.

    link = Centre(channel)              # `STAR` on the member's own channel
    agreed = link.exchange(payload, round=r, numel=d, timeout_s=60.0)

With a consensus support (a robust rule over group-top-k, `compression.support`)
a sampled member's round is two round trips: its ``vote`` (the top-k indices of
its error-compensated update) up, the round's ``support`` (the most voted entries)
down, its ``up`` (its values on that support, in its order) up and the ``down``
reply; a member that sits the round out takes only the reply, as without one:

    link.vote(votes, round=r, deadline=deadline)
    support = link.support(round=r, numel=d, deadline=deadline)
    agreed = link.exchange_on(values, round=r, numel=d, deadline=deadline)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedring.collective.channel import PeerChannel
from fedring.compression.payload import Payload, PayloadLimits
from fedring.compression.support import GroupIndices
from fedring.transport.base import Deadline

STAR = "aggregator"  # the centre's endpoint name in-process


@dataclass(frozen=True)
class Centre:
    """Where a member's star exchanges go: a channel and the centre's name on it."""

    channel: PeerChannel
    name: str = STAR

    def exchange(self, sent: Payload, *, round: int, numel: int, timeout_s: float) -> torch.Tensor:
        """Send `sent` up for `round` and return the centre's reply, decompressed;
        one deadline of `timeout_s` covers the round trip."""
        deadline = Deadline.after(timeout_s)
        self.channel.send(self.name, sent, round=round, step=0, phase="up", deadline=deadline)
        return self._reply(round, numel, deadline)

    def result(self, *, round: int, numel: int, timeout_s: float) -> torch.Tensor:
        """Only the centre's reply for `round` (a member that sat it out)."""
        return self._reply(round, numel, Deadline.after(timeout_s))

    def vote(self, votes: GroupIndices, *, round: int, deadline: Deadline) -> None:
        """Send this member's votes for `round`'s consensus support."""
        self.channel.send(self.name, votes, round=round, step=0, phase="vote", deadline=deadline)

    def support(self, *, round: int, numel: int, deadline: Deadline) -> GroupIndices:
        """The consensus support the centre chose for `round`."""
        support = self.channel.recv(
            self.name, round=round, step=0, phase="support", deadline=deadline,
            limits=PayloadLimits(max_numel=numel),
        )  # fmt: skip
        if not isinstance(support, GroupIndices) or support.numel != numel:
            raise ValueError(f"round {round}: the centre's support is not {numel} entries' indices")
        return support

    def exchange_on(
        self, values: Payload, *, round: int, numel: int, deadline: Deadline
    ) -> torch.Tensor:
        """Send the values on `round`'s support; return the centre's reply."""
        self.channel.send(self.name, values, round=round, step=0, phase="up", deadline=deadline)
        return self._reply(round, numel, deadline)

    def _reply(self, round: int, numel: int, deadline: Deadline) -> torch.Tensor:
        result = self.channel.recv(
            self.name, round=round, step=0, phase="down", deadline=deadline,
            limits=PayloadLimits(max_numel=numel),
        )  # fmt: skip
        return result.decompress()
