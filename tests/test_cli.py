"""The `fedring` command: JSON output with the promised keys, exit 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from fedring.cli import app

runner = CliRunner()


def test_bench_compress_json_has_the_promised_fields() -> None:
    result = runner.invoke(
        app,
        ["bench", "compress", "--numel", "200000", "--density", "0.01", "--repeats", "1", "--json"],
    )
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    for key in (
        "numel",
        "density",
        "group_size",
        "group_topk_ms",
        "global_topk_ms",
        "speedup_vs_global_topk",
        "bytes_dense_fp32",
        "bytes_compressed",
        "compression_ratio",
    ):
        assert key in r
    assert r["numel"] == 200000 and r["bytes_dense_fp32"] == 800000
    assert r["compression_ratio"] == r["bytes_dense_fp32"] / r["bytes_compressed"]
    assert r["compression_ratio"] > 50


def test_bench_ring_json_reports_every_scheme_for_every_size() -> None:
    result = runner.invoke(
        app, ["bench", "ring", "--agents", "3", "--sweep", "2", "--numel", "20000", "--json"]
    )
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert [row["agents"] for row in r["results"]] == [2, 3]
    for row in r["results"]:
        for scheme in ("dense", "exact", "bounded", "allgather_dgc"):
            assert row[scheme]["bytes_per_agent"] > 0
            assert row[scheme]["refused_frames"] == 0
        assert row["dense"]["ratio_vs_dense"] == 1.0
        assert row["bounded"]["ratio_vs_dense"] > 20


def test_bad_input_exits_2_and_names_the_option() -> None:
    result = runner.invoke(app, ["bench", "compress", "--value-dtype", "fp8"])
    assert result.exit_code == 2 and "--value-dtype" in result.output
    result = runner.invoke(app, ["bench", "ring", "--sweep", "2,x"])
    assert result.exit_code == 2 and "--sweep" in result.output
    result = runner.invoke(app, ["bench", "compress", "--density", "2"])
    assert result.exit_code == 2 and "--density" in result.output


def test_console_script_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fedring", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.startswith("fedring ")


def test_coordinator_given_a_directory_exits_2_naming_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = runner.invoke(app, ["coordinator", "run", str(tmp_path), "--broker", "mqtt://x:1"])
    assert result.exit_code == 2, result.output
    assert "is a directory, not a TOML file" in " ".join(result.output.split())  # wrapped
    assert "Traceback" not in result.output


def test_resume_from_a_garbage_checkpoint_exits_2_before_any_broker(tmp_path) -> None:  # type: ignore[no-untyped-def]
    job = tmp_path / "job.toml"
    job.write_text("[job]\nagents = 2\n")
    (tmp_path / "checkpoint.pt").write_bytes(bytes(range(256)) * 4)  # not a torch file
    args = ["coordinator", "run", str(job), "--broker", "mqtt://127.0.0.1:1", "--resume",
            "--out", str(tmp_path)]  # fmt: skip
    result = runner.invoke(app, args)  # port 1: had it connected first, it would say so
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "unreadable: not a fedring checkpoint" in text and "weights_only=False" not in text
    export = runner.invoke(app, ["export", "onnx", str(tmp_path), "--out", str(tmp_path / "m")])
    assert export.exit_code == 2 and "not a fedring checkpoint" in " ".join(export.output.split())


def test_profile_list_never_cuts_a_name_or_alias_at_80_columns() -> None:
    from fedring.firmware_profiles.schema import builtin_profiles

    result = runner.invoke(app, ["profile", "list"], env={"COLUMNS": "80"})
    assert result.exit_code == 0 and "…" not in result.output, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    words = set(result.output.replace("│", " ").split())
    for p in builtin_profiles().values():
        assert p.name in words and set(p.aliases) <= words, p.name
