"""Board profiles: every file loads, bad files are refused naming the field, detection, CLI."""

from __future__ import annotations

import json
import tomllib
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedring.cli import app
from fedring.firmware_profiles.detect import detect
from fedring.firmware_profiles.schema import (
    ProfileError,
    builtin_profiles,
    load_builtin,
    load_profile,
    parse_profile,
)

runner = CliRunner()
BOARDS = {
    "rpi3b-plus", "rpi4-2gb", "rpi4-4gb", "rpi4-8gb", "rpi5", "rpi-zero-2w", "jetson-nano",
    "jetson-xavier-nx", "jetson-orin-nano", "generic-x86_64",
}  # fmt: skip
DATA = resources.files("fedring.firmware_profiles") / "data"


def _table(name: str) -> dict:
    return tomllib.loads((DATA / f"{name}.toml").read_text())


def test_every_board_loads_with_sane_figures() -> None:
    profiles = builtin_profiles()
    assert set(profiles) == BOARDS
    for p in profiles.values():
        assert 0 < p.ram_budget_mb < p.ram_mb and p.gflops > 0
        assert p.default_link in p.links
    pi4 = load_builtin("rpi4")
    assert pi4.name == "rpi4-4gb" and set(pi4.links) == {"wifi", "ethernet"}
    assert pi4.link("wifi").bandwidth_mbps < pi4.link("ethernet").bandwidth_mbps
    assert load_builtin("jetson-orin-nano").gflops > pi4.gflops > load_builtin("rpi-zero-2w").gflops


def test_every_file_says_where_its_compute_figure_comes_from() -> None:
    for name in BOARDS:
        comments = "\n".join(
            line for line in (DATA / f"{name}.toml").read_text().splitlines()
            if line.startswith("#")
        )  # fmt: skip
        assert "gflops" in comments and "ram_budget_mb" in comments, name
        assert "github.com" in comments or "product" in comments or "data sheet" in comments, name


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        (("compute", "gflop"), 8.0, "unknown field 'compute.gflop'"),
        (("colour",), "red", "unknown field 'colour'"),
        (("links", "wifi", "jitter_ms"), 1.0, "unknown field 'links.wifi.jitter_ms'"),
        (("links", "wifi", "bandwidth_mbps"), -5.0, "'links.wifi.bandwidth_mbps'=-5.0"),
        (("links", "ethernet", "latency_ms"), -1, "'links.ethernet.latency_ms'=-1"),
        (("compute", "cores"), 2.5, "'compute.cores'=2.5 must be int"),
        (("training", "dtype"), "fp8", "'training.dtype'='fp8'"),
        (("compute", "ram_budget_mb"), 999999, "'compute.ram_budget_mb'=999999 exceeds"),
        (("default_link",), "lte", "'default_link'='lte'"),
        (("training", "batch_size"), True, "'training.batch_size'=True"),
        (("detect", "ram_mb"), [5000, 2600], "'detect.ram_mb'=[5000, 2600] must be [low, high]"),
    ],
)
def test_a_bad_field_is_refused_by_name(path: tuple, value: object, needle: str) -> None:
    table = _table("rpi4-4gb")
    node = table
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ProfileError) as info:
        parse_profile(table, "test.toml")
    assert needle in str(info.value) and "test.toml" in str(info.value)


def test_a_missing_field_is_named() -> None:
    table = _table("rpi5")
    del table["runtime"]["keepalive_s"]
    with pytest.raises(ProfileError, match=r"missing field 'runtime\.keepalive_s'"):
        parse_profile(table, "x")


def _write_bad(tmp_path: Path) -> Path:
    text = (
        (DATA / "rpi4-4gb.toml")
        .read_text()
        .replace("bandwidth_mbps = 100.0", "bandwidth_mbps = -100.0")
    )
    bad = tmp_path / "BAD.toml"
    bad.write_text(text)
    return bad


def test_cli_check_exits_2_naming_the_field(tmp_path: Path) -> None:
    result = runner.invoke(app, ["profile", "check", str(_write_bad(tmp_path))])
    assert result.exit_code == 2 and "links.wifi.bandwidth_mbps" in result.output
    good = tmp_path / "good.toml"
    good.write_text((DATA / "rpi4-4gb.toml").read_text())
    result = runner.invoke(app, ["profile", "check", str(good)])
    assert result.exit_code == 0 and "ok" in result.output
    assert load_profile(good) == load_builtin("rpi4-4gb")
    result = runner.invoke(app, ["profile", "check", str(tmp_path / "none.toml")])
    assert result.exit_code == 2 and "does not exist" in result.output
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe name = 1")
    for unreadable in (tmp_path, binary):  # a folder, and a file that is not text
        result = runner.invoke(app, ["profile", "check", str(unreadable)])
        assert result.exit_code == 2 and "cannot be read" in result.output, result.output


def test_cli_list_shows_every_board_and_show_refuses_unknown_names() -> None:
    result = runner.invoke(app, ["profile", "list", "--json"])
    assert result.exit_code == 0 and set(json.loads(result.stdout)) == BOARDS
    result = runner.invoke(app, ["profile", "list"], env={"COLUMNS": "150"})
    assert result.exit_code == 0 and all(name in result.output for name in BOARDS)
    result = runner.invoke(app, ["profile", "show", "orin-nano", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["name"] == "jetson-orin-nano"
    result = runner.invoke(app, ["profile", "show", "rpi9"])
    assert result.exit_code == 2 and "unknown profile 'rpi9'" in result.output


def _fake(tmp_path: Path, model: str | None, tegra: str | None, mem_kb: int | None) -> tuple:
    paths = (tmp_path / "model", tmp_path / "tegra", tmp_path / "meminfo")
    if model is not None:
        paths[0].write_bytes(model.encode() + b"\x00")  # the device tree ends with NUL
    if tegra is not None:
        paths[1].write_text(tegra)
    if mem_kb is not None:
        paths[2].write_text(f"MemTotal:       {mem_kb} kB\nMemFree:        1000 kB\n")
    return paths


@pytest.mark.parametrize(
    ("model", "tegra", "mem_kb", "want"),
    [
        ("Raspberry Pi 4 Model B Rev 1.4", None, 1_893_000, "rpi4-2gb"),
        ("Raspberry Pi 4 Model B Rev 1.4", None, 3_884_000, "rpi4-4gb"),
        ("Raspberry Pi 4 Model B Rev 1.5", None, 7_999_000, "rpi4-8gb"),
        ("Raspberry Pi 4 Model B Rev 1.4", None, None, "rpi4-2gb"),  # unknown RAM: tightest
        ("Raspberry Pi 5 Model B Rev 1.0", None, 8_000_000, "rpi5"),
        ("Raspberry Pi Zero 2 W Rev 1.0", None, 437_000, "rpi-zero-2w"),
        ("Raspberry Pi 3 Model B Plus Rev 1.3", None, 948_000, "rpi3b-plus"),
        ("NVIDIA Jetson Nano Developer Kit", None, None, "jetson-nano"),
        ("NVIDIA Jetson Xavier NX Developer Kit", None, None, "jetson-xavier-nx"),
        ("NVIDIA Jetson Orin Nano Developer Kit", None, None, "jetson-orin-nano"),
        (None, "# R32 (release), REVISION: 7.1, GCID: 1, BOARD: t210ref, EABI: aarch64",
         None, "jetson-nano"),
        (None, "# R36 (release), REVISION: 4.0, GCID: 2, BOARD: generic, EABI: aarch64",
         None, "jetson-orin-nano"),
        (None, "# R35 (release), REVISION: 4.1, GCID: 3, BOARD: t186ref, EABI: aarch64",
         None, "jetson-xavier-nx"),  # JetPack 5 on a Xavier is not an Orin
        # Family members without a profile of their own: the nearest by RAM.
        ("Raspberry Pi 400 Rev 1.0", None, 3_884_000, "rpi4-4gb"),
        ("Raspberry Pi Compute Module 4 Rev 1.0", None, 7_999_000, "rpi4-8gb"),
        ("Raspberry Pi 3 Model B Rev 1.2", None, 944_000, "rpi3b-plus"),
        ("Raspberry Pi 400 Rev 1.0", None, None, "rpi-zero-2w"),  # unknown RAM: tightest
        ("Some Other Board", None, None, "generic-x86_64"),
        (None, None, None, "generic-x86_64"),
    ],
)  # fmt: skip
def test_detection_from_fake_files(
    tmp_path: Path, model: str | None, tegra: str | None, mem_kb: int | None, want: str
) -> None:
    found = detect(*_fake(tmp_path, model, tegra, mem_kb))
    assert found.profile.name == want, found.reason


def test_cli_detect_reads_the_given_files(tmp_path: Path) -> None:
    m, t, mem = _fake(tmp_path, "Raspberry Pi 4 Model B Rev 1.4", None, 7_999_000)
    result = runner.invoke(app, ["profile", "detect", "--model-file", str(m), "--tegra-file",
                                 str(t), "--meminfo", str(mem), "--json"])  # fmt: skip
    assert result.exit_code == 0
    got = json.loads(result.stdout)
    assert got["profile"] == "rpi4-8gb" and "Raspberry Pi 4 Model B" in got["reason"]


@pytest.mark.parametrize(
    ("machine", "mem_kb", "want"),
    [
        ("aarch64", 24_000_000, "rpi4-8gb"),  # an emulated arm64 root on a big host
        ("aarch64", 3_884_000, "jetson-nano"),  # the slowest of the 4 GB ARM boards
        ("armv7l", None, "rpi-zero-2w"),  # unknown RAM: the tightest budget
        ("x86_64", 24_000_000, "generic-x86_64"),
    ],
)
def test_an_unknown_arm_board_never_gets_the_x86_profile(
    tmp_path: Path, machine: str, mem_kb: int | None, want: str
) -> None:
    found = detect(*_fake(tmp_path, None, None, mem_kb), machine=machine)
    assert found.profile.name == want, found.reason
    assert ("ARM" in found.reason) == (machine != "x86_64")
