"""One check shared by the overlap and update-delay tests: a `DistributedOptimizer`
that refuses its settings raises naming them and leaves no backward hooks behind
(they would start comm threads that nobody collects on every later backward)."""

from __future__ import annotations

import pytest
import torch

from fedring.collective.channel import PeerChannel
from fedring.collective.ring import Ring
from fedring.engine.optimizer import DistributedOptimizer, SyncSettings
from fedring.engine.reducer import Reducer, ReducerSettings
from fedring.transport.inproc import InprocTransport


def assert_refused(settings: SyncSettings, match: str) -> None:
    model = torch.nn.Linear(8, 3)
    numel = sum(p.numel() for p in model.parameters())
    ring = Ring(PeerChannel(InprocTransport().connect("solo"), "t"), ("solo",))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=match):
        DistributedOptimizer(inner, Reducer(ring, numel, ReducerSettings()), settings, model=None)
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
