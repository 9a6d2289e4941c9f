"""Stage frames: refused when they do not fit, counted; a failing stage never hangs the grid."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedring.collective.channel import CollectiveTimeout, PeerChannel
from fedring.compression.quantize import DenseCodec
from fedring.counters import Counters
from fedring.engine.group import LOCAL_KEY
from fedring.engine.reducer import ReducerSettings
from fedring.pipeline.grid import PipelineSettings, assembled, build_grid, run_steps
from fedring.pipeline.stage import ACT, NonFiniteActivation, Stage, WireSettings
from fedring.transport.base import Deadline
from fedring.transport.inproc import InprocTransport
from tests.pipeline.test_equivalence import model_of, plan_for


def test_an_activation_of_the_wrong_size_is_refused_counted_and_the_right_one_taken() -> None:
    hub, counters = InprocTransport(), Counters()
    prev = PeerChannel(hub.connect("prev"), "j", key=LOCAL_KEY, counters=counters)
    own = PeerChannel(hub.connect("me"), "j", key=LOCAL_KEY, counters=counters)
    stage = Stage(1, 2, nn.Linear(4, 3), own, "prev", None, (4,), F.cross_entropy,
                  WireSettings(timeout_s=5.0))  # fmt: skip
    deadline = Deadline.after(5.0)
    prev.send("me", DenseCodec().compress(torch.ones(2 * 5)), round=0, step=0, phase=ACT,
              deadline=deadline)  # fmt: skip
    good = torch.arange(8, dtype=torch.float32)
    prev.send("me", DenseCodec().compress(good), round=0, step=0, phase=ACT, deadline=deadline)
    stage.forward(0, 0, rows=2)
    torch.testing.assert_close(stage._saved[0][0].detach(), good.view(2, 4))
    assert counters.get("frame_shape_mismatch") == 1


def test_a_silent_neighbour_ends_the_wait_at_the_deadline_with_a_typed_error() -> None:
    hub = InprocTransport()
    hub.connect("prev")
    stage = Stage(1, 2, nn.Linear(4, 3), PeerChannel(hub.connect("me"), "j", key=LOCAL_KEY),
                  "prev", None, (4,), F.cross_entropy, WireSettings(timeout_s=0.3))  # fmt: skip
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="pp-act step 0 of round 3 from 'prev'"):
        stage.forward(3, 0, rows=2)
    assert time.monotonic() - start < 5.0  # a loaded machine: still far from a hang


def test_a_stage_that_fails_mid_run_stops_the_whole_grid_promptly() -> None:
    model = model_of(6, 1)
    calls = {"n": 0}

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] > 5:
            raise RuntimeError("board 3 ran out of memory")
        return F.cross_entropy(out, y)

    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    hub = InprocTransport(cooperative=True)
    settings = PipelineSettings(2, "1f1b", WireSettings(timeout_s=120.0))
    grid = build_grid(
        list(model), plan_for(model, [0, 2, 4], 2, "1f1b"), 2, settings, loss_fn=loss,
        make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        reducer_settings=ReducerSettings(), data=lambda d: lambda: (x, y), hub=hub,
    )  # fmt: skip
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="board 3 ran out of memory"):
        run_steps(grid, start=0, steps=10, lr_at=lambda s: 0.1, hub=hub)
    assert time.monotonic() - start < 30.0  # neighbours saw it leave, not their 120 s deadline


def test_a_step_trains_in_train_mode_after_an_evaluation_of_the_assembled_model() -> None:
    model = model_of(4, 2)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    hub = InprocTransport(cooperative=True)
    grid = build_grid(
        list(model), plan_for(model, [0, 2], 2, "gpipe"), 1, PipelineSettings(2, "gpipe"),
        loss_fn=F.cross_entropy, make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        reducer_settings=ReducerSettings(), data=lambda d: lambda: (x, y), hub=hub,
    )  # fmt: skip
    assembled(grid).eval()  # what task.evaluate does between chunks of steps
    run_steps(grid, start=0, steps=1, lr_at=lambda s: 0.1, hub=hub)
    assert all(m.training for row in grid for m in row[0].stage.module.modules())


def test_a_nan_stops_the_sender_saying_where_and_fp16_clamping_is_counted() -> None:
    hub, counters = InprocTransport(), Counters()
    hub.connect("next")
    layer = nn.Linear(4, 3)
    with torch.no_grad():
        layer.weight.fill_(1e5)  # outputs far beyond fp16's 65504
    own = PeerChannel(hub.connect("me"), "j", key=LOCAL_KEY, counters=counters)
    stage = Stage(0, 2, layer, own, None, "next", (), None, WireSettings("fp16", timeout_s=5.0))
    stage.forward(2, 0, rows=2, x=torch.ones(2, 4))
    assert counters.get("pp-act_fp16_clamped") == 1 and counters.get("pp-act_sent") == 1
    with pytest.raises(NonFiniteActivation, match=r"stage 0: the pp-act of micro-batch 1, step 2"):
        stage.forward(2, 1, rows=2, x=torch.full((2, 4), float("nan")))
    assert counters.get("pp-act_sent") == 1
