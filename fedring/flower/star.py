"""The ServerApp's side of a star round, without Flower: aggregate, step, downlink.

The ServerApp holds the one global model. Each round it collects the nodes'
compressed updates, combines them with the job's rule (`mean`, `weighted` by the
manifest's shard sizes, `vote` = signSGD majority, `median`, `trimmed`, `clip`), and moves
the global model: `sync` takes an SGD step with the scaled learning rate (plain
EF-SGD when the gradients are compressed, momentum SGD when dense), `local` adds
the combined delta. The move is sent back as a delta: dense fp32, or group-top-k
with the ServerApp's own error feedback (`downlink = "group-topk"`). The global
model moves by exactly what is sent, so every node that applies it holds the same
bits, which the sha256 in every message proves.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedring import build
from fedring.aggregation.rules import (
    Aggregation,
    capped_weights,
    robust,
    sign_vote,
    weighted,
)
from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK
from fedring.compression.payload import Payload
from fedring.compression.quantize import DenseCodec
from fedring.engine.plan import Plan
from fedring.engine.reducer import compress_update
from fedring.flower.job import FlowerJob
from fedring.training.models import flat_sha256, set_flat_params


def combine(agg: Aggregation, updates: Mapping[int, torch.Tensor], sizes: Mapping[int, int],
            weight_cap: float) -> torch.Tensor:  # fmt: skip
    """The rule applied to the updates that arrived (rank -> flat vector)."""
    ranks = sorted(updates)
    stacked = torch.stack([updates[r] for r in ranks])
    if agg.kind == "weighted":
        w = capped_weights([sizes[r] for r in ranks], weight_cap)
        return weighted(stacked, w)
    if agg.kind == "vote":
        return sign_vote(stacked)
    if agg.robust:  # median, trimmed, clip (on each node's own top-k: no consensus support)
        return robust(stacked, agg)
    return stacked.mean(dim=0)


class GlobalModel:
    """The ServerApp's model, optimizer state and downlink compressor."""

    def __init__(self, job: FlowerJob, plan: Plan) -> None:
        spec = job.spec
        self.spec, self.plan = spec, plan
        self.agg = Aggregation.parse(spec.aggregation)
        self.model = plan.task.model(plan.dataset, spec.seed)
        self.params = plan.initial.clone()  # what every node starts from
        self.velocity = torch.zeros_like(self.params)
        self.schedule = build.lr_schedule(spec)
        self.server_momentum = job.server_momentum
        self.down_topk: GroupTopK | None = None
        self.down_ef: ErrorFeedback | None = None
        if job.downlink == "group-topk":
            self.down_topk = GroupTopK(spec.group_size, spec.k, spec.value_dtype)  # type: ignore[arg-type]
            self.down_ef = ErrorFeedback(self.params.numel())

    @property
    def numel(self) -> int:
        return self.params.numel()

    @property
    def sha256(self) -> str:
        return flat_sha256(self.params)

    def lr(self, round: int) -> float:
        return self.schedule.lr_at(round)

    def step(self, round: int, updates: Mapping[int, Payload]) -> Payload:
        """Combine the updates, move the model; return the downlink delta it moved by."""
        dense = {r: p.decompress() for r, p in updates.items()}
        combined = combine(self.agg, dense, dict(enumerate(self.plan.manifest.sizes)),
                           self.spec.weight_cap)  # fmt: skip
        if self.spec.sync == "sync":
            momentum = 0.0 if self.spec.compressed_sync else self.spec.momentum
            self.velocity.mul_(momentum).add_(combined)
            move = self.velocity * -self.lr(round)
        else:  # FedAvgM: the combined delta through the ServerApp's momentum
            self.velocity.mul_(self.server_momentum).add_(combined)
            move = self.velocity.clone()
        down, _ = compress_update(move, self.down_topk, self.down_ef)
        if self.down_topk is None:
            down = DenseCodec("fp32").compress(move)
        down.add_to(self.params)  # exactly what the nodes will add
        return down

    def whole(self) -> Payload:
        """The whole model, for a node that missed a round."""
        return DenseCodec("fp32").compress(self.params)

    def evaluate(self) -> tuple[float, float]:
        set_flat_params(self.model, self.params)
        return self.plan.task.evaluate(self.model, self.plan.dataset)
