"""How the coordinator orders the ring and sizes its patience from the agents' probes."""

from __future__ import annotations

from pathlib import Path

import torch

from fedring.config import JobSpec
from fedring.coordinator.membership import Fleet
from fedring.coordinator.service import Coordinator, Options
from fedring.edge_agent.worker import probe_step
from fedring.training.models import build_model
from fedring.transport.mqtt import BrokerConfig


def test_fastest_link_first_then_the_faster_board() -> None:
    f = Fleet(hellos={
        "slow-link": {"link_bps": 1e6, "step_s": 0.001},
        "fast-a": {"link_bps": 5e6, "step_s": 0.001},
        "fast-b": {"link_bps": 5e6, "step_s": 0.002},
    })  # fmt: skip
    assert f.order(set(f.hellos)) == ["fast-a", "fast-b", "slow-link"]
    f.on_ack("fast-a", {"step_s": 0.3, "numel": 10})  # the job's own model: b is faster
    f.on_ack("fast-b", {"step_s": 0.01, "numel": 10})
    assert f.order(set(f.hellos)) == ["fast-b", "fast-a", "slow-link"]


def test_patience_grows_with_a_slow_probed_round() -> None:
    f = Fleet(hellos={a: {"link_bps": 1e5} for a in ("a", "b")})
    assert f.round_estimate(["a", "b"]) == 0.0  # no ack yet: the model size is unknown
    f.on_ack("a", {"step_s": 0.5, "numel": 250_000})
    f.on_ack("b", {"step_s": 2.0, "numel": 250_000})
    # 2.0 s of compute + 1 MB x 2(N-1)/N = 1 MB over 100 kB/s = 10 s
    assert abs(f.round_estimate(["a", "b"]) - 12.0) < 1e-9
    assert f.stall(["a", "b"], step_timeout_s=1.0) == 240.0  # 20 rounds, above 3 x 1 s
    fast = Fleet(hellos={a: {"link_bps": 1e9} for a in ("a", "b")})
    assert fast.stall(["a", "b"], step_timeout_s=1.0) == 3.0  # 3 ring-step deadlines


def test_the_coordinator_takes_stall_s_when_given(tmp_path: Path) -> None:
    cfg = BrokerConfig.parse("mqtt://127.0.0.1:1883")
    spec = JobSpec(agents=2, timeout_s=1.0)
    assert Coordinator(spec, cfg, Options(out=tmp_path))._stall(["a"]) == 3.0
    assert Coordinator(spec, cfg, Options(out=tmp_path, stall_s=7.0))._stall(["a"]) == 7.0


def test_probe_step_measures_without_touching_the_model() -> None:
    model = build_model("mlp", (64,), 10, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(40, 64), torch.randint(0, 10, (40,))
    step = probe_step(model, x, y, batch=32)
    assert 0 < step < 5
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_the_smallest_board_frame_size_and_the_slowest_deadline_rule() -> None:
    f = Fleet(hellos={
        "pi": {"profile": {"max_frame_bytes": 65536, "round_deadline_s": 90.0}},
        "x86": {"profile": {"max_frame_bytes": 262144, "round_deadline_s": 30.0}},
        "old": {"profile": {"max_frame_bytes": "garbage"}},  # ignored, not trusted
    })  # fmt: skip
    assert f.frame_bytes(["pi", "x86", "old"]) == 65536
    assert f.frame_bytes(["old"]) == 0  # no usable figure: the default
    assert f.stall(["pi", "x86"], step_timeout_s=1.0) == 90.0  # the Pi's round deadline


def test_announced_figures_that_are_not_finite_numbers_count_as_unknown() -> None:
    f = Fleet(hellos={
        "a": {"link_bps": "fast", "step_s": float("nan"), "profile": ["not", "a", "dict"]},
        "b": {"link_bps": float("inf"), "step_s": -1, "profile": {"round_deadline_s": True}},
        "c": {"link_bps": 1e6, "step_s": 0.01, "profile": {"round_deadline_s": 5.0}},
    })  # fmt: skip
    assert f.order(set(f.hellos)) == ["c", "a", "b"]
    assert f.stall(["a", "b", "c"], step_timeout_s=1.0) == 5.0
    f.on_ack("a", {"step_s": float("inf"), "numel": "many"})
    assert f.step_s["a"] == 0.0 and f.numel == 0
