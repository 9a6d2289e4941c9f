"""What a Flower job adds to a `JobSpec`, and how the spec travels to the nodes.

The ServerApp is the coordinator: it plans the shards and the initial model and
sends each node the job as plain values (a Flower `ConfigRecord` holds str, int,
float and bool), so nodes need no job file of their own. Nodes rebuild the spec
with `JobSpec.from_mapping`, which refuses unknown fields and bad types.

Over Flower a job runs as a star (`topology = "star"`: nodes send compressed
updates, the ServerApp aggregates) or as a ring relayed by the ServerApp
(`topology = "ring"`). `sync` sends one compressed gradient a round (EF-SGD on
the server), `local` sends the compressed parameter delta after `local_steps`
local steps (FedAvg with compressed uplinks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedring.aggregation.rules import Aggregation
from fedring.config import JobSpec, SpecError

FLOWER_SYNC = ("sync", "local")
FLOWER_TOPOLOGIES = ("star", "ring")
DOWNLINKS = ("dense", "group-topk")


@dataclass(frozen=True)
class FlowerJob:
    spec: JobSpec
    downlink: str = "dense"  # dense fp32 delta | group-topk (with server-side error feedback)
    round_timeout_s: float = 120.0  # how long the ServerApp waits for one round's replies
    # local mode: the ServerApp applies the combined delta with this momentum (FedAvgM).
    # Error feedback delays what compression leaves out; momentum 0.5 makes up for
    # the delay within 20 rounds (digits, 8 clients: 0.9666 vs 0.9554 without).
    server_momentum: float = 0.5
    # How long the ServerApp waits for the nodes and their enrolment: a node's first
    # message starts a ClientApp process that imports torch and plans the shards
    # (seconds on a Pi, longer on a loaded machine), so more than one round's wait.
    enrol_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        spec = self.spec
        if self.downlink not in DOWNLINKS:
            raise SpecError(f"field 'downlink'={self.downlink!r} must be one of dense, group-topk")
        if not 0.1 <= self.round_timeout_s <= 86400:
            raise SpecError(f"field 'round_timeout_s'={self.round_timeout_s!r} not in [0.1, 86400]")
        if not 0.1 <= self.enrol_timeout_s <= 86400:
            raise SpecError(f"field 'enrol_timeout_s'={self.enrol_timeout_s!r} not in [0.1, 86400]")
        if not 0.0 <= self.server_momentum < 1.0:
            raise SpecError(f"field 'server_momentum'={self.server_momentum!r} not in [0, 1)")
        if spec.sync not in FLOWER_SYNC:
            raise SpecError(
                f"field 'sync'={spec.sync!r}: over Flower use one of {', '.join(FLOWER_SYNC)}"
            )
        if spec.topology not in FLOWER_TOPOLOGIES:
            raise SpecError(f"field 'topology'={spec.topology!r}: over Flower use star or ring")
        if spec.collective != "ring":
            raise SpecError(f"field 'collective'={spec.collective!r}: the Flower relay has no "
                            "broadcast; over Flower use ring")  # fmt: skip
        for name in ("bucket_kb", "update_delay"):  # the relay applies whole rounds
            if getattr(spec, name):
                raise SpecError(f"field {name!r}={getattr(spec, name)!r}: the Flower relay "
                                "exchanges one whole gradient a round; set it to 0 over Flower")
        kind = Aggregation.parse(spec.aggregation).kind
        if spec.topology == "ring" and kind not in ("mean", "weighted"):
            raise SpecError(
                f"field 'aggregation'={spec.aggregation!r}: the relayed ring sums, so it takes "
                "mean or weighted; use topology='star' for vote, median and trimmed"
            )


def spec_to_config(spec: JobSpec) -> dict[str, Any]:
    """The spec as ConfigRecord-ready values."""
    return dict(spec.resolved())


def spec_from_config(values: Mapping[str, Any]) -> JobSpec:
    """Rebuild a spec sent by the ServerApp; SpecError names a bad field."""
    return JobSpec.from_mapping(dict(values))


def initial_bytes(params: torch.Tensor) -> bytes:
    """The plan's initial parameters as the enrol message carries them: float32, little-endian."""
    return params.detach().to(torch.float32).numpy().astype("<f4").tobytes()


def initial_params(blob: bytes) -> torch.Tensor:
    """`initial_bytes` back to a flat float32 tensor (the sha256 check is `prepare`'s)."""
    if not isinstance(blob, bytes) or len(blob) % 4:
        raise ValueError(f"enrol 'initial.params': {type(blob).__name__} of {len(blob)} bytes")
    return torch.from_numpy(np.frombuffer(blob, dtype="<f4").astype(np.float32))


def job_from_run_config(values: dict[str, Any]) -> tuple[FlowerJob, Path | None]:
    """A FlowerJob from `flwr run --run-config` values; SpecError names a bad field."""
    fields = dict(values)
    out = fields.pop("out", None)
    downlink = str(fields.pop("downlink", "dense"))
    timeout = _number(fields.pop("round_timeout_s", 120.0), "round_timeout_s")
    momentum = _number(fields.pop("server_momentum", 0.5), "server_momentum")
    enrol_s = _number(fields.pop("enrol_timeout_s", 300.0), "enrol_timeout_s")
    fields.setdefault("topology", "star")
    job = FlowerJob(JobSpec.from_mapping(fields), downlink, timeout, momentum, enrol_s)
    return job, Path(str(out)) if out else None


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(f"field {name!r}={value!r} must be a number")
    return float(value)
