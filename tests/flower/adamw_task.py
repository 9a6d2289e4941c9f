"""A user's own optimizer: the built-in digits MLP, trained with AdamW (the task's
``optimizer``), named in a job as ``task = "tests.flower.adamw_task:AdamWDigits"``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedring.engine.task import ClassificationTask


@dataclass(frozen=True)
class AdamWDigits(ClassificationTask):
    @property
    def name(self) -> str:
        return "tests:adamw-digits"

    def optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
