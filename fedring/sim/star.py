"""The centre of a star: collect every agent's update, apply a robust rule, send it back.

Median and trimmed mean need all N updates in one place, which a ring never has.
Uplinks are the agents' compressed payloads; the downlink is the aggregated
update as fp16 (dense: a median of sparse vectors is not sparse).
"""

from __future__ import annotations

import torch

from fedring.aggregation.rules import Aggregation, median, trimmed_mean
from fedring.collective.channel import PeerChannel
from fedring.compression.payload import PayloadLimits
from fedring.compression.quantize import DenseCodec
from fedring.config import JobSpec
from fedring.transport.base import Deadline


def serve_star(channel: PeerChannel, spec: JobSpec, agents: tuple[str, ...], numel: int) -> int:
    """Serve rounds until every agent stopped sending; return the rounds served."""
    agg = Aggregation.parse(spec.aggregation)
    limits = PayloadLimits(max_numel=numel)
    served = 0
    for r in range(spec.rounds):
        deadline = Deadline.after(spec.timeout_s)
        try:
            ups = [
                channel.recv(a, round=r, step=0, phase="up", deadline=deadline, limits=limits)
                for a in agents
            ]
        except Exception:
            if r == 0:
                raise
            return served  # the agents stopped early (target reached) or failed: they report it
        stacked = torch.stack([u.decompress() for u in ups])
        result = median(stacked) if agg.kind == "median" else trimmed_mean(stacked, agg.beta)
        down = DenseCodec("fp16").compress(result)
        for a in agents:
            channel.send(a, down, round=r, step=0, phase="down", deadline=deadline)
        served += 1
    return served
