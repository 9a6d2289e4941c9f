"""The lean agent install: `fedring agent` imports none of the optional packages, and
a job that needs one fails with an error naming the extra to install."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedring.extras import EXTRAS, MissingExtra, require
from fedring.training.datasets import DatasetError, load_dataset

AGENT_MODULES = (
    "fedring.cli", "fedring.cli_mqtt", "fedring.edge_agent.daemon", "fedring.edge_agent.worker",
    "fedring.firmware_profiles.apply", "fedring.firmware_profiles.detect", "fedring.build",
    "fedring.training.datasets", "fedring.engine.resync",
)  # fmt: skip
OPTIONAL = ("sklearn", "scipy", "mnist1d", "onnx", "onnxruntime", "onnxscript", "matplotlib",
            "flwr", "ray")  # fmt: skip


def test_the_agent_imports_no_optional_package() -> None:
    code = (
        "import sys\n"
        f"for m in {AGENT_MODULES!r}: __import__(m)\n"
        "from typer.testing import CliRunner\n"
        "from fedring.cli import app\n"
        "assert CliRunner().invoke(app, ['agent', '--help']).exit_code == 0\n"
        f"print(__import__('json').dumps(sorted(m for m in {OPTIONAL!r} if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_a_missing_dataset_package_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("sklearn", "sklearn.datasets"):
        monkeypatch.setitem(sys.modules, name, None)  # import now fails as if not installed
    want = r"dataset 'digits' needs .*'sklearn'.*fedring\[digits\]"
    with pytest.raises(DatasetError, match=want):
        load_dataset("digits", seed=0)


def test_require_names_the_extra_of_each_optional_module(monkeypatch: pytest.MonkeyPatch) -> None:
    for module, extra in EXTRAS.items():
        monkeypatch.setitem(sys.modules, module, None)
        with pytest.raises(MissingExtra, match=rf"fedring\[{extra}\]"):
            require(module, "this test")
    assert require("json", "this test") is json



def test_a_command_whose_extra_is_missing_says_which(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from fedring import cli

    for name in [m for m in sys.modules if m.startswith(("onnx", "fedring.coordinator.onnx"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "onnx", None)  # ONNX not installed
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(b"")
    argv = ["fedring", "export", "onnx", str(checkpoint), "--out", str(tmp_path / "m.onnx")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == 2
    said = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "'onnx', which is not installed" in said and 'pip install "fedring[onnx]"' in said
