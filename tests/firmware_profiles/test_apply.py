"""Applying a profile: agent settings, the memory estimate, refusal before training."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedring.cli import app
from fedring.config import JobSpec
from fedring.edge_agent import worker
from fedring.edge_agent.worker import JobWorker
from fedring.firmware_profiles.apply import (
    MB,
    RETRY_STATES,
    RUNTIME_MB,
    OverBudget,
    activation_bytes,
    check_budget,
    copies_per_param,
    job_memory,
    resolve,
    runtime_rss,
    settings_for,
)
from fedring.firmware_profiles.schema import ProfileError, load_builtin
from fedring.sim.runner import plan
from fedring.training.models import build_model

runner = CliRunner()
BIG = JobSpec(agents=4, dataset="synthetic:500:20000:10")  # 2.57 M parameters


def test_retry_states_match_what_the_worker_keeps() -> None:
    assert RETRY_STATES == worker.KEEP_SNAPSHOTS


def test_settings_come_from_the_profile_and_flags_override_threads() -> None:
    s = settings_for(load_builtin("rpi4"), "ethernet")
    assert (s.profile, s.link, s.torch_threads, s.batch_size) == ("rpi4-4gb", "ethernet", 3, 32)
    assert settings_for(load_builtin("rpi4"), None, threads=1).torch_threads == 1
    assert json.loads(json.dumps(s.hello()))["max_frame_bytes"] == 262144
    assert resolve("rpi-zero-2w")[0].round_deadline_s == 300.0
    assert resolve("rpi4/ethernet")[1] == "ethernet"
    with pytest.raises(ProfileError, match="no 'ethernet' link"):
        resolve("rpi-zero-2w/ethernet")


def test_a_profile_file_is_checked_and_used(tmp_path: Path) -> None:
    data = resources.files("fedring.firmware_profiles") / "data"
    mine = tmp_path / "my-board.toml"
    mine.write_text((data / "rpi4-4gb.toml").read_text().replace("torch_threads = 3",
                                                                 "torch_threads = 2"))  # fmt: skip
    profile, link, _ = resolve(f"{mine}/ethernet")
    assert (profile.torch_threads, link) == (2, "ethernet")
    assert resolve(str(mine))[1] is None
    bad = tmp_path / "bad.toml"
    bad.write_text((data / "rpi4-4gb.toml").read_text().replace("cores = 4\n", "cores = -4\n"))
    with pytest.raises(ProfileError, match=r"compute\.cores"):
        resolve(str(bad))


def test_activation_bytes_count_every_layer_output_twice() -> None:
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    # Flatten 64, Linear 128, ReLU 128, Linear 64, ReLU 64, Linear 10 per example
    assert activation_bytes(model, (1, 8, 8), 32) == (64 + 128 + 128 + 64 + 64 + 10) * 32 * 4 * 2


def test_compression_keeps_more_copies_than_a_dense_ring() -> None:
    dense = copies_per_param(JobSpec(compression="none"))
    sparse = copies_per_param(JobSpec(compression="group-topk"))
    assert (dense, sparse) == (6 + 2 * (1 + RETRY_STATES), 9 + 3 * (1 + RETRY_STATES))


def test_a_job_too_large_for_a_zero_2w_is_refused_with_both_numbers() -> None:
    estimate = job_memory(BIG)
    assert estimate.params == 20000 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    with pytest.raises(OverBudget) as info:
        check_budget(load_builtin("rpi-zero-2w"), estimate)
    text = str(info.value)
    assert f"~{estimate.total_bytes / 2**20:.1f} MB" in text and "budget is 115 MB" in text
    assert "2,569,034 parameters" in text
    check_budget(load_builtin("rpi4-8gb"), estimate)  # fits there: no exception


def test_the_agent_worker_refuses_before_training() -> None:
    p = plan(BIG)
    args = ("a0", "job", BIG, 0, p.manifest.entry(0).to_dict(), p.model_sha256)
    with pytest.raises(OverBudget, match="rpi-zero-2w"):
        JobWorker(*args, budget=load_builtin("rpi-zero-2w"))
    assert JobWorker(*args, budget=load_builtin("rpi4-8gb")).numel == 2_569_034


def test_simulate_refuses_a_fleet_whose_board_is_too_small() -> None:
    args = ["simulate", "--fleet", "rpi-zero-2w:4", "--dataset", "synthetic:500:20000:10"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "budget is 115 MB" in result.output and "job needs ~" in result.output


def test_the_runtime_is_measured_in_this_process() -> None:
    rss = runtime_rss()  # torch is imported here: well above the interpreter alone
    assert 100 * MB < rss < 8192 * MB


def test_a_measured_runtime_counts_against_the_budget() -> None:
    """The digits job fits a Zero 2 W with the 220 MB runtime its budget assumes; an
    agent that measured a heavier runtime at start-up refuses it, saying so."""
    estimate = job_memory(JobSpec(agents=2))
    assert estimate.runtime == RUNTIME_MB * MB and "(assumed)" in estimate.describe()
    check_budget(load_builtin("rpi-zero-2w"), estimate)
    heavy = dataclasses.replace(estimate, runtime_bytes=(RUNTIME_MB + 120) * MB)
    assert heavy.total_bytes == estimate.total_bytes + 120 * MB
    with pytest.raises(OverBudget, match=r"runtime 340\.0 MB \(measured\)"):
        check_budget(load_builtin("rpi-zero-2w"), heavy)
    check_budget(load_builtin("rpi4-2gb"), heavy)


def test_the_agent_worker_counts_its_measured_runtime() -> None:
    small = JobSpec(agents=2)
    p = plan(small)
    args = ("a0", "job", small, 0, p.manifest.entry(0).to_dict(), p.model_sha256)
    zero = load_builtin("rpi-zero-2w")
    assert JobWorker(*args, budget=zero, runtime=lambda: 200 * MB).numel > 0
    with pytest.raises(OverBudget, match="measured"):
        JobWorker(*args, budget=zero, runtime=lambda: 400 * MB)
