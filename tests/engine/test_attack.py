"""The attack harness (`engine.attack`): specs, each transform, the label flip, and an
attacker's reducer; in `simulate`, one scaled attacker ruins a plain mean."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fedring.config import JobSpec
from fedring.counters import Counters
from fedring.engine.attack import Attack, AttackingReducer, flip_labels
from fedring.engine.group import local_group
from fedring.engine.reducer import Reducer, ReducerSettings
from fedring.sim.runner import simulate


@pytest.mark.parametrize(
    ("spec", "kind", "arg", "text"),
    [
        ("sign-flip", "sign-flip", None, "sign-flip"),
        ("scale", "scale", -10.0, "scale:-10"),
        ("scale:-2.5", "scale", -2.5, "scale:-2.5"),
        ("noise", "noise", 10.0, "noise:10"),
        ("noise:3", "noise", 3.0, "noise:3"),
        ("label-flip", "label-flip", None, "label-flip"),
    ],
)
def test_specs_parse_with_their_defaults_and_print_back(
    spec: str, kind: str, arg: float | None, text: str
) -> None:
    a = Attack.parse(spec)
    assert (a.kind, a.arg, str(a)) == (kind, arg, text)
    assert Attack.parse(str(a)) == a
    assert a.to_dict() == {"kind": kind, "arg": arg, "spec": text}


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("flip", "'flip'"),
        ("", "expected one of"),
        ("scale:x", "'x' is not a number"),
        ("scale:inf", "finite"),
        ("noise:0", "SIGMA 0.0 must be > 0"),
        ("noise:-1", "must be > 0"),
        ("sign-flip:2", "'sign-flip' takes no argument"),
        ("label-flip:1", "'label-flip' takes no argument"),
        ("bogus:3", "'bogus'"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_value(spec: str, needle: str) -> None:
    with pytest.raises(ValueError, match="attack") as err:
        Attack.parse(spec)
    assert needle in str(err.value)


def test_sign_flip_and_scale_transform_the_update_and_keep_the_original() -> None:
    v = torch.tensor([1.0, -2.0, 0.5])
    assert torch.equal(Attack.parse("sign-flip").update(v), -v)
    assert torch.equal(Attack.parse("scale").update(v), v * -10)
    assert torch.equal(Attack.parse("scale:3").update(v), v * 3)
    assert torch.equal(Attack.parse("label-flip").update(v), v)  # data-level: sent as is
    assert v.tolist() == [1.0, -2.0, 0.5]


def test_noise_replaces_the_update_sized_by_its_rms_and_seeded() -> None:
    v = torch.randn(20_000, generator=torch.Generator().manual_seed(1)) * 0.01
    a = Attack.parse("noise:5")
    n1, n2, other = a.update(v, seed=7), a.update(v, seed=7), a.update(v, seed=8)
    assert torch.equal(n1, n2) and not torch.equal(n1, other)
    rms = float(v.norm()) / v.numel() ** 0.5
    assert float(n1.std()) == pytest.approx(5 * rms, rel=0.05)
    assert abs(float(torch.nn.functional.cosine_similarity(n1, v, dim=0))) < 0.05  # no signal
    assert torch.equal(Attack.parse("noise").update(torch.zeros(4)), torch.zeros(4))


def test_label_flip_maps_y_to_c_minus_1_minus_y() -> None:
    y = torch.arange(10)
    assert flip_labels(y, 10).tolist() == list(range(9, -1, -1))
    assert Attack.parse("label-flip").labels(y, 10).tolist() == list(range(9, -1, -1))
    assert Attack.parse("sign-flip").labels(y, 10) is y  # only label-flip touches data
    with pytest.raises(ValueError, match="num_classes"):
        flip_labels(torch.tensor([0.5]), 0)  # a regression target has no classes
    with pytest.raises(ValueError, match=r"outside 0\.\.2"):
        flip_labels(torch.tensor([0, 3]), 3)


def test_an_attacking_reducer_poisons_what_it_sends_and_counts_it() -> None:
    groups = local_group(1, job="attack", timeout_s=5.0)
    settings = ReducerSettings(compression="none")
    counters = Counters()
    bad = AttackingReducer(groups[0].collective, 3, settings, attack=Attack.parse("scale:-2"),
                           counters=counters)  # fmt: skip
    assert isinstance(bad, Reducer)
    v = torch.tensor([1.0, 2.0, 3.0])
    assert bad.allreduce(v, scale=1.0, round=0).tolist() == [-2.0, -4.0, -6.0]
    part = bad.allreduce_bucket(v[:2], span=(0, 2), scale=1.0, round=1, bucket=0)
    rest = bad.allreduce_bucket(v[2:], span=(2, 3), scale=1.0, round=1, bucket=1)
    assert torch.cat([part, rest]).tolist() == [-2.0, -4.0, -6.0]
    assert bad.attacked == 2 and counters.get("attack_updates") == 2  # buckets count once
    assert bad.allreduce_dense(v, round=2, bucket=9).tolist() == v.tolist()  # not an update


def _star(attack: Attack | None) -> dict:
    spec = JobSpec(agents=4, topology="star", aggregation="mean", compression="none",
                   rounds=60, eval_every=30)  # fmt: skip
    return simulate(spec, attack=attack)


def test_one_scaled_attacker_ruins_a_plain_mean_in_simulate() -> None:
    honest = _star(None)
    attacked = _star(Attack.parse("scale:-10"))
    assert "attack" not in honest
    assert attacked["attack"] == {"kind": "scale", "arg": -10.0, "spec": "scale:-10",
                                  "attackers": [3], "attack_updates": 60}  # fmt: skip
    assert honest["final_accuracy"] > 0.85
    assert attacked["final_accuracy"] < honest["final_accuracy"] - 0.3


def test_simulate_refuses_more_attackers_than_agents_and_async_jobs() -> None:
    with pytest.raises(ValueError, match="attackers=5"):
        simulate(JobSpec(agents=4, rounds=2), attack=Attack.parse("sign-flip"), attackers=5)
    with pytest.raises(ValueError, match="sync = async"):
        simulate(JobSpec(agents=2, rounds=2, sync="async"), attack=Attack.parse("sign-flip"))


def test_simulate_takes_the_attacking_ranks_as_a_list() -> None:
    s = simulate(JobSpec(agents=3, rounds=2, eval_every=2), attack=Attack.parse("noise"),
                 attackers=[0, 2])  # fmt: skip
    assert s["attack"]["attackers"] == [0, 2] and s["attack"]["attack_updates"] == 4
    with pytest.raises(ValueError, match=r"attackers=\[3\]"):
        simulate(JobSpec(agents=3, rounds=2), attack=Attack.parse("noise"), attackers=[3])


def test_an_agent_daemon_worker_attacks_through_its_member_and_its_async_deltas() -> None:
    from fedring.build import plan
    from fedring.edge_agent.worker import JobWorker
    from fedring.engine.group import Group
    from fedring.transport.inproc import InprocTransport

    spec = JobSpec(agents=2, rounds=4, compression="none")
    p = plan(spec)
    counters = Counters()

    def member(attack: Attack | None) -> tuple[JobWorker, Any]:
        w = JobWorker("a0", "job-1", spec, 0, p.manifest.entry(0).to_dict(), p.model_sha256)
        w.attack = attack
        solo = Group.on(InprocTransport().connect("a0"), ("a0",), job="job-1", key=None)
        return w, w.bind(solo, counters=counters)

    w, honest = member(None)
    _, flipped = member(Attack.parse("label-flip"))
    assert not isinstance(honest.state.optimizer.reducer, AttackingReducer)
    assert isinstance(flipped.state.optimizer.reducer, AttackingReducer)
    for _ in range(3):  # the same batches, the labels flipped
        (x, y), (fx, fy) = honest.next_batch(), flipped.next_batch()
        assert torch.equal(x, fx) and torch.equal(fy, 9 - y)
    w.attack = Attack.parse("scale:-10")
    compress = w._async_compress(None, None, counters)
    assert compress(torch.ones(3)).decompress().tolist() == [-10.0] * 3
    assert counters.get("attack_updates") == 1


AGENT = ["agent", "--broker", "mqtt://127.0.0.1:1", "--id", "a0"]


@pytest.mark.parametrize("command", [["simulate", "--rounds", "1"], AGENT])
def test_the_clis_refuse_a_bad_attack_naming_it(command: list[str]) -> None:
    from typer.testing import CliRunner

    from fedring.cli import app

    result = CliRunner(env={"COLUMNS": "240"}).invoke(app, [*command, "--attack", "scale:big"])
    assert result.exit_code == 2
    assert "'big' is not a number" in " ".join(result.output.split())
