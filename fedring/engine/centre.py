"""The centre of a star: every member's update in one place, a rule applied, one reply.

With ``topology = "star"`` a member's `Reducer.star` sends its compressed update
(error feedback and group-top-k as on the ring) to the centre and waits for the
reply; the centre here collects one update per member for the round, combines
them, and sends every member the same result, so the members stay identical.

- ``mean``, ``weighted`` and ``hybrid``: members send ``weight * update`` (their
  manifest weight, 1/N for the mean), the centre sums;
- ``median`` and ``trimmed:B``: members send the update unscaled; the centre takes
  the coordinate-wise median or B-trimmed mean, which need all N in one place
  (a ring never has them);
- the sign vote stays on the ring (it is already a majority of 1-bit uplinks).

The reply is dense (a median of sparse vectors is not sparse) in `down_dtype`,
fp16 by default. `fedring simulate` runs the centre on a thread over the
in-process transport; the MQTT coordinator runs it over the broker (`STAR` is
then the coordinator's id).

    settings = CentreSettings(aggregation="median", rounds=100)
    served = serve(channel, members=("agent-0", "agent-1", "agent-2"), numel=d,
                   settings=settings)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedring.aggregation.rules import Aggregation, median, trimmed_mean
from fedring.collective.channel import PeerChannel
from fedring.compression.payload import PayloadLimits
from fedring.compression.quantize import DenseCodec
from fedring.transport.base import Deadline

STAR = "aggregator"  # the centre's endpoint name in-process


@dataclass(frozen=True)
class Centre:
    """Where a member's star exchanges go: a channel and the centre's name on it."""

    channel: PeerChannel
    name: str = STAR


@dataclass(frozen=True)
class CentreSettings:
    aggregation: str = "mean"  # mean | weighted | hybrid:L | median | trimmed:B
    rounds: int = 1  # serve rounds [start_round, rounds)
    start_round: int = 0
    timeout_s: float = 60.0  # wait for one round's updates
    down_dtype: Literal["fp32", "fp16", "bf16"] = "fp16"


def combine(updates: torch.Tensor, rule: Aggregation) -> torch.Tensor:
    """One round's result from the stacked updates ``[N, D]`` (see the module docstring)."""
    if rule.kind == "median":
        return median(updates)
    if rule.kind == "trimmed":
        return trimmed_mean(updates, rule.beta)
    if rule.kind == "vote":
        raise ValueError("the sign vote runs on the ring, not through a star's centre")
    return updates.sum(dim=0)  # members sent their weighted share


def serve(
    channel: PeerChannel, members: tuple[str, ...], numel: int, settings: CentreSettings
) -> int:
    """Serve rounds until `settings.rounds`; return the rounds served.

    A member that stops sending ends the service: before any round is served that
    is an error (raised), afterwards it is how a job that reached its target
    early ends (the members report it to their runner).
    """
    rule = Aggregation.parse(settings.aggregation)
    limits = PayloadLimits(max_numel=numel)
    codec = DenseCodec(settings.down_dtype)
    served = 0
    for r in range(settings.start_round, settings.rounds):
        deadline = Deadline.after(settings.timeout_s)
        try:
            ups = [
                channel.recv(m, round=r, step=0, phase="up", deadline=deadline, limits=limits)
                for m in members
            ]
        except Exception:
            if served == 0:
                raise
            return served
        down = codec.compress(combine(torch.stack([u.decompress() for u in ups]), rule))
        for m in members:
            channel.send(m, down, round=r, step=0, phase="down", deadline=deadline)
        served += 1
    return served
