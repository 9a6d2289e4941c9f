"""How `fedring coordinator run` runs a job: its command line's options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedring.monitor import JobFeed


@dataclass
class Options:
    out: Path
    min_agents: int = 0  # 0: the job's `agents`
    enrol_timeout_s: float = 120.0
    ack_timeout_s: float = 60.0
    halt_timeout_s: float = 10.0
    stall_s: float = 0.0  # 0: 3 x the job's timeout_s
    max_epochs: int = 50
    resume: bool = False
    export_onnx: bool = True  # OUT/model.onnx from the final checkpoint, checked with ORT
    on_round: Callable[[int, dict[str, Any]], None] | None = None  # (0-based round, its row)
    feed: JobFeed | None = None  # what the progress line, metrics and dashboard read
