"""``compression = "auto"`` over a real Mosquitto: the coordinator's plan names the
codec too, the manifests carry it, and a re-plan from group-top-k to the dense ring
mid-job keeps the members identical, flushes their error-feedback residuals and
trains the dense rounds with the dense job's rates."""

from __future__ import annotations

import json
from pathlib import Path

from fedring.collective.cost import ALGORITHMS, Choice
from fedring.config import AUTO_LR, AUTO_LR_EF_SGD, JobSpec
from fedring.coordinator.collectives import CollectivePlans
from fedring.coordinator.epoch import HELD_SPREAD
from fedring.coordinator.membership import Fleet as MemberFleet
from fedring.coordinator.service import Coordinator, Options
from fedring.transport.mosquitto import Mosquitto
from fedring.transport.mqtt import BrokerConfig
from tests.mqtt.conftest import Fleet, coordinator, finish, job_toml

SWITCH_AT = 20


class _DenseAt(CollectivePlans):
    """Group-top-k first, then one re-plan to the dense ring once the head's row of
    round `SWITCH_AT` arrives (when to re-plan is `tests/coordinator/test_replan.py`'s).
    At the re-plan the fleet's order turns round, as it does when the members' measured
    steps arrive with their acks: the re-formed ring must still go on from the round
    its members halted at."""

    def __init__(self, fleet: MemberFleet) -> None:
        super().__init__()
        self.fleet = fleet

    def observe(self, spec: JobSpec, rnd: int, row: dict) -> None:
        self.seen = rnd

    def replan(self, spec: JobSpec) -> str:
        if len(self.epochs) > 1 or getattr(self, "seen", 0) < SWITCH_AT:
            return ""
        ring = list(self.epochs[-1].members)
        self.fleet.order = lambda agents: [a for a in reversed(ring) if a in agents]  # type: ignore[method-assign]
        return "the test switches to dense"

    def plan(self, spec, epoch, members, fleet, numel, start):  # type: ignore[no-untyped-def]
        super().plan(spec, epoch, members, fleet, numel, start)
        chosen = "dense ring" if epoch > 0 else "ring"
        self.epochs[-1].choice = Choice(chosen, self.epochs[-1].choice.predicted_s)
        return "ring"


def test_a_switch_to_dense_mid_job_flushes_the_residual(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path
) -> None:
    spec = JobSpec.from_mapping({"agents": 4, "dataset": "digits", "eval_every": 10,
                                 "seed": 0, "timeout_s": 20.0, "rounds": 50,
                                 "compression": "auto", "density_warmup": 0,
                                 "checkpoint_every": 1000})  # fmt: skip
    coord = Coordinator(spec, BrokerConfig.parse(broker.url), Options(out=tmp_path / "run"))
    coord.collectives = _DenseAt(coord.fleet)
    summary = coord.run()
    sparse, dense = summary["collective"]
    # the same ring went on from where it halted, not from the checkpoint (round 0):
    # the newest round every member holds, and a member slower than the head may have
    # been halted before it committed round SWITCH_AT (seen once under load)
    assert SWITCH_AT - HELD_SPREAD <= dense["from_round"] <= SWITCH_AT + 4
    assert set(sparse["predicted_s"]) == {"dense ring", "ring"}
    assert (sparse["chosen"], sparse["codec"]) == ("ring", "group-topk")
    assert (dense["chosen"], dense["codec"]) == ("dense ring", "dense")
    assert summary["codec"]["compression"] == "auto"
    assert summary["identical_models"] and summary["rounds"] == 50
    assert summary["coordinator_counters"]["collective_replanned"] == 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]  # fmt: skip
    last = {r["round"]: r for r in rows}  # a round run again: its last row
    before = [last[r] for r in range(1, dense["from_round"])]
    after = [last[r] for r in range(dense["from_round"] + 1, 51)]
    assert {r["codec"] for r in before} == {"group-topk"} and {r["codec"] for r in after} == {
        "dense"
    }
    assert all(r["residual_norm"] > 0 for r in before)  # top-k held some back
    assert all(r["residual_norm"] == 0 for r in after)  # flushed, and nothing held since
    # the dense rounds train as a dense job: momentum SGD at its automatic rate, both
    # ramped x N = 4 over the 50 warm-up steps (`build.retune`)
    def ramp(r: dict) -> float:
        return 1 + 3 * min(r["round"] - 1, 50) / 50

    assert all(abs(r["lr"] - AUTO_LR_EF_SGD * ramp(r)) < 1e-9 for r in before)
    assert all(abs(r["lr"] - AUTO_LR * ramp(r)) < 1e-9 for r in after)
    # a dense all-reduce is the plain sum: every entry of the dense rounds goes out
    assert all(r["compression_error"] == 0 for r in after)


def test_compression_auto_runs_the_plan_it_chose_from_the_probes(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path
) -> None:
    """No stand-in: the daemons' probes (a loopback broker, this CPU's codec) decide;
    every row names the codec of the plan the summary says ran."""
    job = job_toml(tmp_path, compression="auto", collective="auto", rounds=30)
    out = tmp_path / "run"
    summary = finish(coordinator(broker.url, job, out))
    epochs = summary["collective"]  # one, or more where the in-job check tried another
    first = epochs[0]["predicted_s"]
    assert set(first) == {f"{d}{c}" for d in ("", "dense ") for c in ALGORITHMS}
    assert first[epochs[0]["chosen"]] <= first["dense ring"]
    # plans are compared by time to the target: group-top-k's extra rounds weigh on it
    weighed = epochs[0]["to_target_s"]
    assert set(weighed) == set(first)
    dense = first["dense ring"] + epochs[0]["compute_s"]
    assert abs(weighed["dense ring"] - dense) < 2e-6  # dense needs no extra rounds
    # 30 rounds at density "auto" run no warm-up: no stage plans (those are
    # `tests/coordinator/test_plan_horizon.py`'s), the plan of least time to target
    assert "stage_density" not in epochs[0] and "path_s" not in epochs[0]
    assert weighed[epochs[0]["chosen"]] == min(weighed.values())
    for e in epochs:
        assert e["codec"] == ("dense" if e["chosen"].startswith("dense ") else "group-topk")
    assert summary["identical_models"] and summary["rounds"] == 30
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["round"] for r in rows} == set(range(1, 31))
    assert {r["codec"] for r in rows} == {e["codec"] for e in epochs}
    assert {r["collective"] for r in rows} == {e["chosen"].removeprefix("dense ") for e in epochs}
