"""The alpha-beta model behind ``collective = "auto"`` (`collective.cost`) and the
choice a job gets from it (`choose`)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedring.choose import candidates, choose_collective, payload_bytes, workload
from fedring.collective.cost import ALGORITHMS, Probe, Workload, choose, hop_units, predict
from fedring.compression.group_topk import GroupTopK
from fedring.compression.probe import _fit, codec_cost
from fedring.config import JobSpec
from fedring.coordinator.membership import Fleet

CPU = ((2e-5, 1e-9), (5e-6, 2e-10))  # encode, decode: fixed s + s per entry


def probes(n: int, rtt: float, mbit: float) -> list[Probe]:
    bps = mbit * 1e6 / 8
    return [Probe(rtt, bps, bps, *CPU)] * n


def work(numel: int, payload: float | None = None) -> Workload:
    return Workload(numel, payload if payload is not None else numel * 0.035, 4.0 * numel)


def test_a_broker_far_away_makes_one_step_collectives_win() -> None:
    far = choose(probes(4, rtt=0.04, mbit=10), work(301_066))
    assert far.algorithm == "fanout"
    # the ring pays 2(N-1) = 6 round trips, fanout one, the hub two
    assert far.predicted_s["ring"] > 6 * 0.04 > far.predicted_s["hub"] > 2 * 0.04
    assert far.predicted_s["fanout"] > 0.04


def test_a_near_broker_and_a_slow_link_make_the_ring_win_for_a_large_payload() -> None:
    """Fan-out's downlink carries N-1 payloads, the ring's 2(N-1)/N of one."""
    near = choose(probes(8, rtt=0.0005, mbit=1), work(1_100_000))
    assert near.algorithm == "ring"
    assert near.predicted_s["fanout"] > 2 * near.predicted_s["ring"]


def test_the_hub_sends_at_most_the_dense_vector() -> None:
    n, p = 1000, 3000.0  # 8 payloads of 3 KB sum to more than the 4 KB dense vector
    capped = predict("hub", probes(8, 0.0, 1), Workload(n, p, 4000.0))
    uncapped = predict("hub", probes(8, 0.0, 1), Workload(n, p, 8 * p))
    assert capped < uncapped


def test_a_torus_layout_takes_fewer_steps_than_the_flat_ring() -> None:
    flat = predict("ring", probes(9, 0.01, 100), Workload(10_000, 1000.0, 40_000.0, "ring"))
    grid = predict("ring", probes(9, 0.01, 100), Workload(10_000, 1000.0, 40_000.0, "auto"))
    assert grid < flat  # 3x3: 8 steps against 16
    assert math.isclose(flat // 0.01, 16, abs_tol=1) and math.isclose(grid // 0.01, 8, abs_tol=1)


def test_the_slowest_member_sets_the_pace() -> None:
    fast = probes(4, 0.001, 100)
    slow = [*fast[:3], Probe(0.05, 1e5, 1e5, *CPU)]
    for algorithm in ALGORITHMS:
        assert predict(algorithm, slow, work(17_226)) > predict(algorithm, fast, work(17_226))


@given(st.floats(0, 0.1), st.floats(0.1, 1000), st.integers(1000, 2_000_000),
       st.integers(2, 32))  # fmt: skip
def test_choose_takes_the_smallest_prediction(rtt: float, mbit: float, numel: int,
                                               n: int) -> None:  # fmt: skip
    choice = choose(probes(n, rtt, mbit), work(numel))
    assert choice.predicted_s[choice.algorithm] == min(choice.predicted_s.values())
    assert all(v >= 0 for v in choice.predicted_s.values())


def test_ties_and_unknown_links_go_to_the_first_candidate() -> None:
    assert choose([Probe()] * 4, work(1000)).algorithm == "ring"  # all predict 0
    assert choose(probes(4, 0.04, 10), work(1000), ("ring",)).algorithm == "ring"


def test_payload_bytes_are_the_codecs_wire_bytes() -> None:
    spec = JobSpec.from_mapping({"density": 0.01, "group_size": 256, "value_dtype": "fp16"})
    numel = 256 * 1000
    import torch

    exact = GroupTopK.from_density(0.01, 256, "fp16").compress(torch.randn(numel)).wire_nbytes
    assert payload_bytes(spec, numel) == pytest.approx(exact + 64)
    dense = spec.replace(compression="none")
    assert payload_bytes(dense, numel) == 4 * numel + 64
    assert workload(spec, numel).dense_bytes == 4 * numel + 64


def test_only_a_synchronous_mean_on_a_flat_layout_may_leave_the_ring() -> None:
    base = JobSpec.from_mapping({"collective": "auto"})
    assert candidates(base) == ALGORITHMS
    for change in ({"topology": "torus"}, {"topology": "star", "aggregation": "median"},
                   {"sync": "async"}, {"aggregation": "vote"}, {"pipeline_stages": 2}):  # fmt: skip
        spec = JobSpec.from_mapping({"collective": "auto", **change})
        assert candidates(spec) == ("ring",), change
        far = choose_collective(spec, 301_066, probes(spec.agents, 0.04, 10))
        assert far.algorithm == "ring"


def test_a_fixed_collective_is_kept_and_still_predicted() -> None:
    spec = JobSpec.from_mapping({"collective": "hub"})
    choice = choose_collective(spec, 17_226, probes(4, 0.04, 10))
    assert choice.algorithm == "hub" and set(choice.predicted_s) == {"hub"}


def test_the_codec_probe_fits_a_non_negative_line() -> None:
    assert _fit((10, 110), (1.0, 2.0)) == pytest.approx((0.9, 0.01))
    assert _fit((10, 110), (2.0, 1.0)) == (2.0, 0.0)  # a noisy fall: no negative slope
    (e0, e1), (d0, d1) = codec_cost(sizes=(1024, 65536), repeats=2)
    assert min(e0, e1, d0, d1) >= 0 and e0 + e1 * 65536 > 0


def test_the_fleet_reads_each_agents_probe_from_its_hello() -> None:
    fleet = Fleet(hellos={
        "new": {"rtt_s": 0.04, "up_bps": 1e6, "down_bps": 2e6, "link_bps": 5e5,
                "encode_s": [1e-5, 1e-9], "decode_s": [2e-6, 1e-10]},
        "old": {"link_bps": 5e5},  # an agent from before the probe: the round trip only
        "bad": {"rtt_s": "far", "up_bps": -1, "encode_s": [1, 2, 3], "decode_s": "x"},
    })  # fmt: skip
    assert fleet.cost_probe("new") == Probe(0.04, 1e6, 2e6, (1e-5, 1e-9), (2e-6, 1e-10))
    assert fleet.cost_probe("old") == Probe(0.0, 5e5, 5e5)
    assert fleet.cost_probe("bad") == Probe()
    assert fleet.cost_probe("nobody") == Probe()


def test_auto_is_a_valid_collective_anywhere_and_never_reaches_a_group() -> None:
    from fedring.edge_agent.daemon import _collective
    from fedring.edge_agent.worker import JobRefused, Segment, segment_collective

    JobSpec(collective="auto", topology="star", aggregation="median")  # keeps the ring there
    seg = Segment(job="j", epoch=0, members=["a"], start_round=0, params_sha256="", head="a")
    assert segment_collective(seg, JobSpec(collective="auto")) == "ring"  # never planned
    seg.collective = "hub"
    assert segment_collective(seg, JobSpec(collective="auto")) == "hub"
    assert _collective({"collective": "fanout"}) == "fanout" and _collective({}) == ""
    with pytest.raises(JobRefused, match=r"'collective'='auto'"):
        _collective({"collective": "auto"})  # the coordinator sends what it planned


def test_the_manifest_names_the_planned_collective_and_its_contacts() -> None:
    from fedring.coordinator.manifest import segment_docs
    from tests.coordinator.checkpoints import first_checkpoint

    members = [f"a{i}" for i in range(4)]
    ck = first_checkpoint(JobSpec.from_mapping({"agents": 4, "collective": "auto"}), members)
    planned = segment_docs(ck, members, 0, 0, 0, collective="fanout")
    assert {d["collective"] for d in planned.values()} == {"fanout"}
    assert all(len(d["peers"]) == 4 for d in planned.values())  # every member hears all
    unplanned = segment_docs(ck, members, 0, 0, 0)
    assert {d["collective"] for d in unplanned.values()} == {"ring"}
    assert len(unplanned["a0"]["peers"]) == 3  # itself and its two neighbours
    # a re-plan's start every member holds says so; a checkpoint's does not
    from fedring.edge_agent.manifest import read_segment

    held = segment_docs(ck, members, 1, 30, 0, held="ab" * 32)
    assert held["a1"]["params_sha256"] == "ab" * 32 and read_segment(held["a1"], "a1").held
    assert "held" not in unplanned["a1"] and not read_segment(unplanned["a1"], "a1").held


def test_simulate_plans_auto_from_in_process_probes() -> None:
    from fedring.sim.runner import simulate

    spec = JobSpec.from_mapping({"agents": 3, "rounds": 4, "eval_every": 2,
                                 "collective": "auto"})  # fmt: skip
    summary = simulate(spec)
    [plan] = summary["collective"]
    assert set(plan["predicted_s"]) == set(ALGORITHMS)
    assert summary["layout"] == (f"{plan['chosen']} of 3" if plan["chosen"] != "ring"
                                 else "ring of 3")  # fmt: skip
    fixed = simulate(spec.replace(collective=plan["chosen"]))
    assert summary["model_hashes"] == fixed["model_hashes"]


def test_members_sharing_cores_pay_for_their_frames_together() -> None:
    """Eight members on a fast link near their broker, each frame taken in costing 0.7 ms
    (the edge lab's N = 8 fan-out, `docs/lab.md`, "Shared cores"). On eight boards fan-out's
    one step (seven frames a member, all at once) beats the hub's two; on one machine of
    two cores (four members a core) its 56 frames a round cost four times as long, while
    the hub takes its seven alone and each member one: the hub wins, as the lab measured."""
    boards = [replace(p, hop_s=7e-4) for p in probes(8, rtt=0.0005, mbit=50)]
    shared = [replace(p, share=4.0) for p in boards]
    payload = work(17_226)
    assert choose(boards, payload).algorithm == "fanout"
    assert choose(shared, payload).algorithm == "hub"
    assert hop_units("fanout", shared) == 28 and hop_units("hub", shared) == 11
    assert hop_units("ring", shared) == 14 * 4 and hop_units("ring", boards) == 14
    assert hop_units("fanout", boards[:1]) == 0
    # the frames' cost is what the units say; the codec's grows with the share as well
    for plan in ALGORITHMS:
        bare = [replace(p, hop_s=0.0) for p in boards]
        extra = predict(plan, boards, payload) - predict(plan, bare, payload)
        assert extra == pytest.approx(hop_units(plan, boards) * 7e-4)
    assert predict("ring", [replace(p, hop_s=0.0, share=4.0) for p in boards], payload) > (
        predict("ring", [replace(p, hop_s=0.0) for p in boards], payload))  # fmt: skip


def test_a_share_below_one_counts_as_one() -> None:
    alone = probes(4, 0.001, 10)
    assert predict("fanout", [replace(p, share=0.25) for p in alone], work(17_226)) == (
        predict("fanout", alone, work(17_226)))  # fmt: skip


def test_the_fleet_tells_members_sharing_a_machine_by_their_hellos() -> None:
    hello = {"rtt_s": 0.001, "up_bps": 1e6, "down_bps": 1e6}
    fleet = Fleet(hellos={
        "a0": {**hello, "host": "h1", "cores": 2}, "a1": {**hello, "host": "h1", "cores": 2},
        "a2": {**hello, "host": "h1", "cores": 2}, "a3": {**hello, "host": "h1", "cores": 2},
        "b0": {**hello, "host": "h2", "cores": 4}, "b1": {**hello, "host": "h2", "cores": 4},
        "c0": {**hello, "host": "h3"},  # no cores said: alone
        "d0": {**hello, "host": "h4", "cores": 0}, "d1": {**hello, "host": "h4", "cores": "2"},
        "e0": dict(hello),  # an older agent's hello: no host
    })  # fmt: skip
    members = ["a0", "a1", "a2", "a3", "b0", "b1", "c0", "d0", "d1", "e0"]
    share = {a: p.share for a, p in zip(members, fleet.cost_probes(members), strict=True)}
    assert share == {"a0": 2.0, "a1": 2.0, "a2": 2.0, "a3": 2.0, "b0": 1.0, "b1": 1.0,
                     "c0": 1.0, "d0": 1.0, "d1": 1.0, "e0": 1.0}  # fmt: skip
    # only the members of the ring count: two of host h1's four are one a core
    assert [p.share for p in fleet.cost_probes(["a0", "a1"])] == [1.0, 1.0]
    assert fleet.cost_probes(["a0"])[0] == replace(fleet.cost_probe("a0"), share=1.0)
