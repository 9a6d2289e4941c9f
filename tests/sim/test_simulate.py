"""fedring simulate end to end: every mode trains, agents agree, bad inputs are refused."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from fedring.build import plan
from fedring.cli import app
from fedring.config import JobSpec, SpecError
from fedring.engine.plan import ModelMismatch
from fedring.sim.runner import prepare_model, simulate
from fedring.training.models import flat_params, flat_sha256
from fedring.training.sharding import ShardError

QUICK = {"rounds": 100, "eval_every": 25}


def test_compressed_sync_training_learns_and_agents_end_identical() -> None:
    s = simulate(JobSpec(agents=4, rounds=150, eval_every=50))
    assert s["final_accuracy"] > 0.6  # chance is 0.1
    assert s["identical_models"] and len(s["model_hashes"]) == 1
    assert s["bytes_sent_per_agent"] < s["dense_equivalent_bytes"] / 10
    assert s["evals"][-1]["accuracy"] == s["final_accuracy"]


def test_same_seed_same_model_hash_other_seed_other_hash() -> None:
    a = simulate(JobSpec(agents=3, rounds=20, eval_every=20, seed=1))
    b = simulate(JobSpec(agents=3, rounds=20, eval_every=20, seed=1))
    c = simulate(JobSpec(agents=3, rounds=20, eval_every=20, seed=2))
    assert a["model_hashes"] == b["model_hashes"] != c["model_hashes"]


@pytest.mark.parametrize("aggregation", ["mean", "vote"])
def test_nine_agents_take_the_torus_and_still_agree(aggregation: str) -> None:
    changes = {"lr": 0.002} if aggregation == "vote" else {}  # the default is plain EF-SGD
    spec = JobSpec(agents=9, aggregation=aggregation, rounds=60, eval_every=30, **changes)
    s = simulate(spec)
    assert s["layout"] == "torus 3x3"
    assert s["identical_models"]
    assert s["final_accuracy"] > 0.5, s["evals"]


@pytest.mark.parametrize(
    "changes",
    [
        {"compression": "none"},
        {"policy": "exact"},
        {"sync": "local", "local_steps": 4},
        {"sync": "adaptive", "local_steps": 8},
        {"aggregation": "weighted", "sharding": "quantity:1.0"},
        {"aggregation": "vote", "compression": "none", "lr": 0.002},
        {"aggregation": "hybrid:0.9-0.5"},
        {"aggregation": "median", "topology": "star"},
        {"aggregation": "trimmed:0.25", "topology": "star"},
        {"sync": "async", "slow": "3:0", "async_wait": 2},
        {"sync": "async", "aggregation": "median", "async_wait": 4},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_every_mode_and_aggregation_learns(changes: dict) -> None:
    s = simulate(JobSpec(agents=4, **{**QUICK, **changes}))
    assert s["final_accuracy"] > 0.5, s["evals"]


def test_a_corrupted_shard_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    p = plan(JobSpec(agents=2, rounds=1))
    p.dataset.x_train[p.shards[1][0]] += 1.0  # one sample of agent 1 changed after the manifest
    spec = JobSpec(agents=2, rounds=1)
    prepare_model(spec, p, 0)
    with pytest.raises(ShardError, match="shard 1: sha256"):
        prepare_model(spec, p, 1)


def test_a_corrupted_initial_model_is_refused() -> None:
    spec = JobSpec(agents=2, rounds=1)
    p = plan(spec)
    p.initial[0] += 1.0  # the parameters sent no longer match the manifest's hash
    with pytest.raises(ModelMismatch, match="member 0: initial parameters received hash"):
        prepare_model(spec, p, 0)


def test_a_derived_initial_model_that_differs_is_refused() -> None:
    spec = JobSpec(agents=2, rounds=1, init="derived")
    p = plan(spec)
    p.model_sha256 = "0" * 64  # as if this board's torch drew other initial values
    with pytest.raises(ModelMismatch, match="member 0: initial model sha256"):
        prepare_model(spec, p, 0)


def test_members_start_from_the_sent_parameters_not_their_own_init() -> None:
    spec = JobSpec(agents=2, rounds=1)
    p = plan(spec)
    p.initial.mul_(0.5)  # a start no local build would derive
    p.model_sha256 = flat_sha256(p.initial)
    model, _, _ = prepare_model(spec, p, 1)
    assert torch.equal(flat_params(model), p.initial)


def test_median_needs_a_star() -> None:
    with pytest.raises(SpecError, match="needs every update in one place"):
        JobSpec(aggregation="median")


def test_compressed_sync_runs_plain_ef_sgd_unless_momentum_correction_is_asked() -> None:
    assert JobSpec().lr == 0.1 and JobSpec(compression="none").lr == 0.025
    assert JobSpec(momentum_correction=True).lr == 0.025 and JobSpec(lr=0.3).lr == 0.3
    plain = simulate(JobSpec(agents=2, rounds=3, eval_every=3))
    dgc = simulate(JobSpec(agents=2, rounds=3, eval_every=3, momentum_correction=True, lr=0.1))
    assert plain["model_hashes"] != dgc["model_hashes"]  # the flag reaches the exchange


def test_divergence_rolls_back_and_halves_the_rate() -> None:
    s = simulate(
        JobSpec(agents=2, rounds=40, eval_every=5, lr=50.0, compression="none", warmup_steps=0)
    )
    assert s["rollbacks"] >= 1
    # after a rollback the run recovers: the last evaluation is finite and accepted
    last = s["evals"][-1]
    assert last["verdict"] == "ok" and torch.isfinite(torch.tensor(last["test_loss"]))


def test_cli_json_out_and_config_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cli = CliRunner()
    args = [
        "simulate",
        "--agents",
        "2",
        "--rounds",
        "20",
        "--eval-every",
        "10",
        "--json",
        "--out",
        str(tmp_path),
    ]
    result = cli.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    for key in (
        "final_accuracy",
        "rounds",
        "bytes_sent_per_agent",
        "dense_equivalent_bytes",
        "wall_seconds",
    ):
        assert key in summary
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 20 and json.loads(rows[-1])["round"] == 20
    again = cli.invoke(app, ["simulate", "--config", str(tmp_path / "config.toml"), "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["model_hashes"] == summary["model_hashes"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--agents", "0"], "'agents'=0"), (["--sync", "sometimes"], "'sync'='sometimes'"),
     (["--dataset", "npz:/no/such.npz"], "/no/such.npz"),
     (["--sharding", "dirichlet:-1"], "dirichlet:-1"),
     (["--model", "nosuchmodule:f"], "nosuchmodule")],
)  # fmt: skip
def test_cli_bad_input_exits_2_naming_the_field(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, ["simulate", "--rounds", "1", *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output


def test_toml_job_with_an_unknown_key_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    job = tmp_path / "job.toml"
    job.write_text("[job]\nagents = 2\nlearning_rate = 0.1\n")
    result = CliRunner().invoke(app, ["simulate", "--config", str(job)])
    assert result.exit_code == 2 and "unknown field 'learning_rate'" in result.output


def test_vote_is_refused_outside_sync_mode() -> None:
    with pytest.raises(SpecError, match="'vote' is signSGD"):
        JobSpec(aggregation="vote", sync="local")
