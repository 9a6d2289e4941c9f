"""A plan whose longest step is predicted past the job's step deadline (``timeout_s``)
gets a longer one for its epoch, in its manifests, with a warning: in the edge lab a hub
of 8 members at 1 Mbit/s with the 1 M-parameter MLP never started, every epoch timing
out on the warm-up's payloads at the hub."""

from __future__ import annotations

import logging
import math

import pytest

from fedring.choose import longest_wait, workload
from fedring.collective.cost import Probe, predict, steps
from fedring.config import MAX_TIMEOUT_S, JobSpec
from fedring.coordinator.collectives import CollectivePlans
from fedring.coordinator.membership import Fleet
from fedring.edge_agent.manifest import read_segment
from fedring.edge_agent.worker import JobRefused
from tests.coordinator.checkpoints import first_checkpoint

MEMBERS = [f"a{i}" for i in range(8)]
NUMEL = 1_126_410  # the digits MLP 1024x1024
# 1 Mbit/s each way, as the edge lab shapes it
SLOW = {"rtt_s": 0.002, "up_bps": 125_000.0, "down_bps": 125_000.0,
        "encode_s": [1.8e-5, 9.8e-10], "decode_s": [3.6e-6, 1e-10]}  # fmt: skip


def spec(**fields: object) -> JobSpec:
    return JobSpec.from_mapping({"agents": 8, "dataset": "digits", "model": "mlp:1024x1024",
                                 "rounds": 300, "density": 0.01, **fields})  # fmt: skip


def probes() -> list[Probe]:
    return [Fleet(hellos={"a": dict(SLOW)}).cost_probe("a")] * 8


def test_the_longest_wait_is_a_ring_step_or_a_one_step_plans_whole_all_reduce() -> None:
    job, ps = spec(), probes()
    warm = workload(job.replace(density=0.25), NUMEL)  # round 0: the warm-up's first stage
    ring = longest_wait(job, NUMEL, ps, "ring", 0)
    assert ring == pytest.approx(predict("ring", ps, warm) / steps("ring", 8))
    assert longest_wait(job, NUMEL, ps, "hub", 0) == pytest.approx(predict("hub", ps, warm))
    assert longest_wait(job, NUMEL, ps, "fanout", 0) == pytest.approx(predict("fanout", ps, warm))
    # past the warm-up the payloads are the target's, 25x smaller
    assert longest_wait(job, NUMEL, ps, "hub", 200) < longest_wait(job, NUMEL, ps, "hub", 0) / 10


def test_a_hub_slower_than_the_step_deadline_gets_a_longer_one_and_a_warning_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    job = spec(collective="hub")
    fleet, plans = Fleet(hellos={a: dict(SLOW) for a in MEMBERS}), CollectivePlans()
    wait = longest_wait(job, NUMEL, probes(), "hub", 0)
    assert wait > job.timeout_s  # two minutes: the lab's hub never started
    with caplog.at_level(logging.WARNING, logger="fedring.coordinator.collectives"):
        assert plans.plan(job, 0, MEMBERS, fleet, NUMEL, 0) == "hub"
        assert plans.step_timeout_s == math.ceil(1.5 * wait)
        plans.plan(job, 1, MEMBERS, fleet, NUMEL, 0)  # the re-formed ring: the same deadline
        assert plans.step_timeout_s == math.ceil(1.5 * wait)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1  # not again at every re-formed ring
    assert "hub's longest step" in warned[0] and "timeout_s = 60" in warned[0]
    assert f"wait up to {math.ceil(1.5 * wait)} s" in warned[0]
    # past the warm-up the target's payloads fit the job's own deadline again
    plans.plan(job, 2, MEMBERS, fleet, NUMEL, 200)
    assert plans.step_timeout_s == 0.0
    # the job's summary says which epochs waited longer
    epochs = plans.summary(job, {}, fleet)
    assert [e.get("step_timeout_s") for e in epochs] == [math.ceil(1.5 * wait)] * 2 + [None]


def test_a_plan_within_the_deadline_keeps_the_jobs(caplog: pytest.LogCaptureFixture) -> None:
    """The ring's step carries an eighth of a payload; a longer deadline covers the hub."""
    fleet = Fleet(hellos={a: dict(SLOW) for a in MEMBERS})
    with caplog.at_level(logging.WARNING, logger="fedring.coordinator.collectives"):
        for job in (spec(collective="ring"), spec(collective="hub", timeout_s=600.0)):
            plans = CollectivePlans()
            plans.plan(job, 0, MEMBERS, fleet, NUMEL, 0)
            assert plans.step_timeout_s == 0.0
    assert not caplog.records


def test_the_longer_deadline_is_bounded() -> None:
    crawl = {**SLOW, "up_bps": 1_000.0, "down_bps": 1_000.0}  # 8 kbit/s
    plans = CollectivePlans()
    plans.plan(spec(collective="hub"), 0, MEMBERS, Fleet(hellos={a: dict(crawl) for a in MEMBERS}),
               NUMEL, 0)  # fmt: skip
    assert plans.step_timeout_s == MAX_TIMEOUT_S


def _manifests(timeout_s: float) -> dict[str, dict[str, object]]:
    from fedring.coordinator.manifest import segment_docs

    ck = first_checkpoint(JobSpec.from_mapping({"agents": 2}), ["a0", "a1"])
    return segment_docs(ck, ["a0", "a1"], 0, 0, 0, collective="hub", timeout_s=timeout_s)


def test_the_manifest_carries_the_longer_deadline_and_the_agent_checks_it() -> None:
    assert read_segment(_manifests(190.0)["a1"], "a1").timeout_s == 190.0
    plain = _manifests(0.0)["a1"]
    assert "timeout_s" not in plain and read_segment(plain, "a1").timeout_s == 0.0
    for bad in (-1.0, math.nan, math.inf, MAX_TIMEOUT_S + 1, True, "90"):
        doc = {**plain, "timeout_s": bad}
        with pytest.raises(JobRefused, match="manifest field 'timeout_s'"):
            read_segment(doc, "a1")


def test_a_step_predicted_close_to_the_deadline_gets_the_margin_too() -> None:
    """The lab's fan-out of 8 at 1 Mbit/s: predicted under 60 s, rounds of 58 s measured."""
    job, fleet = spec(collective="fanout"), Fleet(hellos={a: dict(SLOW) for a in MEMBERS})
    wait = longest_wait(job, NUMEL, probes(), "fanout", 0)
    assert job.timeout_s / 1.5 < wait < job.timeout_s
    plans = CollectivePlans()
    plans.plan(job, 0, MEMBERS, fleet, NUMEL, 0)
    assert plans.step_timeout_s == math.ceil(1.5 * wait) > job.timeout_s
