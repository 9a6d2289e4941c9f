"""The Flower star: node and ServerApp logic on small inputs, then the CLI on the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedring.aggregation.rules import Aggregation
from fedring.compression.quantize import DenseCodec
from fedring.compression.sparse import SparseGroups
from fedring.config import JobSpec, SpecError
from fedring.flower.job import FlowerJob, initial_bytes, initial_params
from fedring.flower.node import OutOfSync, apply_downlink, enrol, train_round
from fedring.flower.server_app import job_from_run_config
from fedring.flower.star import GlobalModel, combine
from fedring.sim.runner import plan
from fedring.training.sharding import ShardError
from tests.flower.deployment import session_members

SPEC = JobSpec(
    agents=2, dataset="digits", topology="star", sync="local", local_steps=2, lr=0.05, rounds=2
)


def test_rules_on_hand_written_updates() -> None:
    u = {0: torch.tensor([1.0, -2.0]), 1: torch.tensor([3.0, 0.0]), 2: torch.tensor([100.0, 1.0])}
    sizes = {0: 10, 1: 10, 2: 20}
    assert combine(Aggregation.parse("mean"), u, sizes, 2.0).tolist() == pytest.approx(
        [104 / 3, -1 / 3]
    )
    assert combine(Aggregation.parse("median"), u, sizes, 2.0).tolist() == [3.0, 0.0]
    assert combine(Aggregation.parse("vote"), u, sizes, 2.0).tolist() == [1.0, 0.0]
    assert combine(Aggregation.parse("weighted"), u, sizes, 2.0).tolist() == pytest.approx(
        [(1 * 10 + 3 * 10 + 100 * 20) / 40, (-2 * 10 + 1 * 20) / 40]
    )
    # only the nodes that replied count: a missing node's weight is shared by the rest
    partial = {0: u[0], 2: u[2]}
    assert combine(Aggregation.parse("weighted"), partial, sizes, 2.0).tolist() == pytest.approx(
        [(1 * 10 + 100 * 20) / 30, (-2 * 10 + 1 * 20) / 30]
    )


def test_enrol_refuses_another_start_partition_or_shard_table() -> None:
    p = plan(SPEC)
    table = p.manifest.sha256()
    with pytest.raises(ValueError, match="initial parameters received hash"):
        enrol(SPEC, 0, table, "0" * 64, p.initial)
    with pytest.raises(ValueError, match="'partition-id'=2"):
        enrol(SPEC, 2, table, p.model_sha256, p.initial)
    with pytest.raises(ShardError, match=r"its shard table hashes to .* the dataset or its"):
        enrol(SPEC, 0, "0" * 64, p.model_sha256, p.initial)


def test_enrol_starts_from_the_sent_parameters_not_its_own_build() -> None:
    """SEEDS A: the start is sent (an ARM node's own He-normal init differs from x86's)."""
    p = plan(SPEC)
    table = p.manifest.sha256()
    sent = initial_params(initial_bytes(p.initial))
    assert torch.equal(enrol(SPEC, 0, table, p.model_sha256, sent).params, p.initial)
    corrupted = sent.clone()
    corrupted[7] += 1e-7  # one parameter off by what two architectures' init differ by
    with pytest.raises(ValueError, match="initial parameters received hash"):
        enrol(SPEC, 0, table, p.model_sha256, corrupted)
    with pytest.raises(ValueError, match="carries no initial parameters"):
        enrol(SPEC, 0, table, p.model_sha256)
    derived = SPEC.replace(init="derived")  # opts back into re-deriving it from the seed
    assert torch.equal(enrol(derived, 0, table, p.model_sha256).params, p.initial)
    with pytest.raises(ValueError, match="3 bytes"):
        initial_params(b"abc")


def test_residual_carries_over_rounds_and_the_model_moves_only_by_the_downlink() -> None:
    p = plan(SPEC)
    state = enrol(SPEC, 1, p.manifest.sha256(), p.model_sha256, p.initial)
    start = state.params.clone()
    state, first = train_round(SPEC, state, lr=0.05)
    assert torch.equal(state.params, start)  # local steps never leak into the held model
    assert float(state.residual.norm()) > 0  # what group-top-k left out is kept
    spike = int(state.residual.abs().argmin())
    state.residual[spike] = 1e3  # a residual that must be sent next round
    _, second = train_round(SPEC, state, lr=0.05)
    assert float(second.payload.decompress()[spike]) == pytest.approx(1e3, rel=0.05)
    assert first.samples == second.samples == 2 * SPEC.batch_size


def test_downlink_is_checked_by_sha256() -> None:
    p = plan(SPEC)
    job = FlowerJob(SPEC)
    model = GlobalModel(job, p)
    state = enrol(SPEC, 0, p.manifest.sha256(), p.model_sha256, p.initial)
    state, res = train_round(SPEC, state, lr=0.05)
    down = model.step(0, {0: res.payload})
    apply_downlink(state, down, None, model.sha256)  # the node now holds the ServerApp's bits
    assert torch.equal(state.params, model.params)
    with pytest.raises(OutOfSync):
        apply_downlink(state, down, None, model.sha256)  # applied twice: detected


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"sync": "async"}, "sync"),
        ({"topology": "ring", "aggregation": "hybrid:0.5"}, "aggregation"),
        ({"topology": "torus"}, "topology"),
        ({"topology": "ring", "aggregation": "median"}, "aggregation"),
    ],
)
def test_jobs_flower_cannot_run_are_refused_by_field(changes: dict[str, str], field: str) -> None:
    with pytest.raises(SpecError, match=f"'{field}'"):
        FlowerJob(SPEC.replace(**changes))
    with pytest.raises(SpecError, match="'downlink'"):
        FlowerJob(SPEC, downlink="gzip")


def _fedring(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("fedring")
    return subprocess.run(
        [str(exe), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_cli_simulate_on_the_engine(tmp_path: Path) -> None:
    """4 SuperNodes on Ray (1 CPU each, 2 in all), compressed star, 4 rounds."""
    r = _fedring(
        "flower",
        "simulate",
        "--clients",
        "4",
        "--rounds",
        "4",
        "--eval-every",
        "2",
        "--cpus",
        "2",
        "--timeout",
        "240",
        "--json",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    assert s["status"] == "completed" and s["rounds"] == 4 and s["failures"] == []
    assert s["evals"][-1]["accuracy"] > s["evals"][0]["accuracy"] > 0.3  # initial model: ~0.07
    # every client sent 4 compressed updates: density auto gives a 4-round job 37% of the
    # groups' entries (at 1%: over 30x fewer), headers included
    assert 0 < s["uplink_bytes_per_client"] * 2.5 < s["dense_equivalent_uplink_bytes_per_client"]
    assert s["downlink_bytes_per_client"] > s["uplink_bytes_per_client"]  # dense deltas down
    assert (tmp_path / "summary.json").exists()


def test_cli_bad_flag_names_the_field() -> None:
    r = _fedring("flower", "simulate", "--sync", "adaptive", "--json")
    assert r.returncode == 2
    assert "'sync'" in r.stderr


def test_cli_deadline_stops_every_process(tmp_path: Path) -> None:
    r = _fedring(
        "flower",
        "simulate",
        "--clients",
        "2",
        "--cpus",
        "2",
        "--timeout",
        "3",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 1
    assert "deadline" in r.stderr
    sid = int((tmp_path / "flower.pid").read_text())
    assert session_members(sid) == []


def test_compressed_downlink_moves_the_model_by_exactly_what_is_sent() -> None:
    spec = SPEC.replace(density=0.01)  # k = 3 a group: sums of fp16 values exact in fp32
    p = plan(spec)
    model = GlobalModel(FlowerJob(spec, downlink="group-topk"), p)
    before = model.params.clone()
    update = torch.randn(model.numel, generator=torch.Generator().manual_seed(3))
    down = model.step(0, {0: DenseCodec("fp32").compress(update)})
    assert isinstance(down, SparseGroups)  # group-top-k, k per group of G
    assert torch.equal(model.params - before, down.decompress())
    # FedAvgM's first step moves by the update itself; what was not sent stays in the
    # ServerApp's error feedback, to be sent in later rounds
    assert model.down_ef is not None
    assert torch.allclose(model.down_ef.residual + down.decompress(), update, atol=1e-6)


def test_run_config_of_flwr_run_is_checked_by_field() -> None:
    job, out = job_from_run_config({"agents": 2, "rounds": 3, "out": "", "downlink": "dense"})
    assert job.spec.rounds == 3 and job.spec.topology == "star" and out is None
    with pytest.raises(SpecError, match="'round_timeout_s'"):
        job_from_run_config({"round_timeout_s": "soon"})
    with pytest.raises(SpecError, match="'rounds'"):
        job_from_run_config({"rounds": "many"})
    with pytest.raises(SpecError, match="unknown field 'epochs'"):
        job_from_run_config({"epochs": 3})


def test_the_servers_robust_rules_resist_an_outlier_clip_included() -> None:
    """`clip` is a robust rule at Flower's ServerApp too, not the mean it fell back to."""
    from fedring.aggregation.rules import Aggregation
    from fedring.flower.star import combine

    ups = {0: torch.tensor([1.0, 2.0]), 1: torch.tensor([3.0, 4.0]),
           2: torch.tensor([100.0, -50.0])}  # fmt: skip
    sizes = dict.fromkeys(ups, 1)
    mean = combine(Aggregation.parse("mean"), ups, sizes, 2.0)
    for rule in ("median", "trimmed:0.34", "clip"):
        got = combine(Aggregation.parse(rule), ups, sizes, 2.0)
        assert float(got.abs().max()) < 5.0 < float(mean.abs().max()), rule
