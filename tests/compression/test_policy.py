"""``density = "auto"``: the plan `compression.policy` chooses, and that every runner's
settings take it (jobs, the library's `ReducerSettings`, the Flower mod's k)."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord

from fedring.compression.policy import FLOOR, cap_for, choose_density
from fedring.compression.schedule import DensitySchedule
from fedring.compression.settings import SettingsError
from fedring.config import JobSpec, SpecError
from fedring.engine.reducer import ReducerSettings
from fedring.flower.mod import _auto_k


def test_a_long_sync_job_keeps_the_tuned_one_percent_with_its_warm_up() -> None:
    plan = choose_density(rounds=600)
    assert (plan.density, plan.warmup, plan.flush) == (0.01, 10, 0)
    assert "no closing flush (sync gradients)" in plan.reason


def test_a_short_job_is_denser_so_error_feedback_delivers_within_it() -> None:
    plan = choose_density(rounds=40, local=True)
    assert plan.density == 0.075 and plan.density * 40 == pytest.approx(3.0)
    assert (plan.warmup, plan.flush) == (0, 1)
    assert "40 rounds trained a member" in plan.reason


def test_sampling_counts_the_rounds_each_member_trains() -> None:
    every = choose_density(rounds=400, local=True)
    fifth = choose_density(rounds=400, local=True, participation=0.2)
    assert every.density == FLOOR and fifth.density == pytest.approx(3 / 80, abs=1e-4)


@pytest.mark.parametrize("saving", [2.0, 10.0, 50.0])
def test_the_byte_budget_caps_the_density(saving: float) -> None:
    plan = choose_density(rounds=3, local=True, saving=saving)
    assert plan.density == pytest.approx(max(FLOOR, cap_for(saving)), abs=1e-4)
    # kept fp16 values with one-byte indices: 3 bytes against 4, with 20% headroom
    assert 4 / (3 * plan.density) >= saving * 1.19 or plan.density == FLOOR


def test_the_flush_comes_only_where_a_dense_round_fits_the_budget() -> None:
    assert choose_density(rounds=4, local=True).flush == 0
    assert choose_density(rounds=40, local=True, participation=0.5).flush == 0  # sampled
    assert choose_density(rounds=40, local=True).flush == 1
    assert choose_density(rounds=40, local=True, saving=50).flush == 0
    assert choose_density(rounds=40, local=False).flush == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"rounds": 0}, "rounds"), ({"rounds": 5, "participation": 0.0}, "participation"),
     ({"rounds": 5, "saving": 0.5}, "saving")],
)  # fmt: skip
def test_bad_inputs_are_refused_by_name(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        choose_density(**kwargs)  # type: ignore[arg-type]


def test_the_schedule_flushes_the_last_rounds_only() -> None:
    s = DensitySchedule(target=0.075, steps_per_stage=0, rounds=40, flush=2)
    assert [s.density(r) for r in (0, 37, 38, 39)] == [0.075, 0.075, 1.0, 1.0]
    with pytest.raises(ValueError, match="flush"):
        DensitySchedule(target=0.1, flush=1)


def test_a_job_resolves_auto_and_keeps_a_given_density() -> None:
    auto = JobSpec(rounds=40, sync="local", local_steps=1)
    assert (auto.density, auto.density_warmup, auto.density_flush) == (0.075, 0, 1)
    assert auto.codec_choice()["density_auto"].startswith("40 rounds trained a member")
    fixed = JobSpec(rounds=40, density=0.01)
    assert (fixed.density, fixed.density_warmup, fixed.density_auto) == (0.01, 10, "")
    assert JobSpec.from_mapping({"density": "auto", "rounds": 600}).density == 0.01
    sampled = JobSpec(agents=50, topology="star", sample=10, sync="local", rounds=40,
                      local_steps=1)
    assert sampled.density == pytest.approx(cap_for(3.0), abs=1e-4)  # 8 rounds a member
    with pytest.raises(SpecError, match="density"):
        JobSpec.from_mapping({"density": "dense"})


def test_the_library_settings_resolve_auto_from_their_rounds() -> None:
    s = ReducerSettings(density="auto", rounds=40, local=True)
    assert (s.density, s.density_warmup, s.density_flush) == (0.075, 0, 1)
    assert s.density_auto and s.k == 19
    assert ReducerSettings(density="auto", compression="none").density == 0.01
    with pytest.raises(SettingsError, match="rounds"):
        ReducerSettings(density="auto")


def test_the_flower_mod_takes_rounds_and_participation_from_the_stamp() -> None:
    stamp = ConfigRecord({"key": "arrays", "rounds": 40, "participation": 1.0})
    assert _auto_k(stamp, 1, 256, 10.0) == 19  # 7.5% of 256
    assert _auto_k(stamp, 40, 256, 10.0) == 256  # the closing flush (server rounds from 1)
    sampled = ConfigRecord({"key": "arrays", "rounds": 40, "participation": 0.2})
    assert _auto_k(sampled, 40, 256, 10.0) == round(cap_for(10.0) * 256)  # no room to flush
    assert _auto_k(ConfigRecord({"key": "arrays"}), 3, 256, 10.0) == 3  # no rounds: 1%


def test_more_local_steps_a_round_need_fewer_turns() -> None:
    one, twelve = (choose_density(rounds=40, local=True, local_steps=h) for h in (1, 12))
    assert twelve.density == pytest.approx(3 / (40 * 12**0.5), abs=1e-4)
    assert twelve.density < one.density
    assert "of 12 local steps" in twelve.reason
    assert choose_density(rounds=40, local=False, local_steps=12).density == one.density  # sync
    assert JobSpec(rounds=40, sync="local", local_steps=12).density == twelve.density
    assert ReducerSettings(density="auto", rounds=40, local=True, local_steps=12).density == (
        twelve.density
    )
    with pytest.raises(ValueError, match="local_steps"):
        choose_density(rounds=40, local=True, local_steps=0)


def test_the_ddp_hook_takes_auto_with_its_steps() -> None:
    from fedring.engine.ddp_hook import GroupTopKState

    assert GroupTopKState(density="auto", steps=40).compressor.k == 19  # 7.5% of 256
    assert GroupTopKState(density="auto", steps=1000).compressor.k == 3  # 1%
    with pytest.raises(SettingsError, match="steps"):
        GroupTopKState(density="auto")
