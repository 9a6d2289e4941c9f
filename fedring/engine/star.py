"""A member's link to a star's centre: the channel, the centre's name, one round trip.

With ``topology = "star"`` (and for median and trimmed mean) a member sends its
compressed update up to the centre and waits for the one reply every member gets;
a member that sits a round out (client sampling) only takes the reply. This module
is that link and nothing more: `Reducer.star` compresses and hands the payload to
a `Centre`, and what the centre does with it (`engine.centre.serve`, the MQTT
coordinator) is the layer above, which the reducer never imports.

    link = Centre(channel)              # `STAR` on the member's own channel
    agreed = link.exchange(payload, round=r, numel=d, timeout_s=60.0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedring.collective.channel import PeerChannel
from fedring.compression.payload import Payload, PayloadLimits
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

    def _reply(self, round: int, numel: int, deadline: Deadline) -> torch.Tensor:
        result = self.channel.recv(
            self.name, round=round, step=0, phase="down", deadline=deadline,
            limits=PayloadLimits(max_numel=numel),
        )  # fmt: skip
        return result.decompress()
