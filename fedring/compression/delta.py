"""Incremental updates: send parameters as the difference from the last synced version.

SEEDS A asks for "incremental updates": instead of the full parameters, an agent
sends ``params - reference`` (compressed), where `reference` is the version all
agents last agreed on. Deltas after a few local steps are small and sparse-friendly,
and the reference moves only when a new global version is committed, so every
agent reconstructs exactly the same parameters.

    >>> import torch
    >>> d = DeltaEncoder(torch.zeros(3))
    >>> d.delta(torch.tensor([1., 0., 2.])).tolist()
    [1.0, 0.0, 2.0]
    >>> _ = d.commit_delta(torch.tensor([0.5, 0., 1.])); d.reference.tolist()
    [0.5, 0.0, 1.0]
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


class DeltaEncoder:
    """Holds the last synchronised flat parameters and encodes against them."""

    def __init__(self, reference: torch.Tensor) -> None:
        self.reference = reference.detach().reshape(-1).to(torch.float32).clone()

    def delta(self, params: torch.Tensor) -> torch.Tensor:
        """``params - reference`` as a new flat float32 vector."""
        flat = params.detach().reshape(-1)
        if flat.numel() != self.reference.numel():
            raise ValueError(
                f"parameters have {flat.numel()} entries, reference {self.reference.numel()}"
            )
        return flat.to(torch.float32) - self.reference

    def commit_delta(self, agreed: torch.Tensor) -> torch.Tensor:
        """Advance the reference by the delta every agent agreed on; return it."""
        self.reference.add_(agreed.reshape(-1))
        return self.reference

    def digest(self) -> bytes:
        """sha256 of the reference's bytes: agents compare it to prove consensus."""
        return hashlib.sha256(self.reference.numpy().tobytes()).digest()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"reference": self.reference.clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        ref = state["reference"]
        if ref.shape != self.reference.shape or ref.dtype != torch.float32:
            raise ValueError(f"reference of shape {tuple(ref.shape)} {ref.dtype} does not fit")
        self.reference.copy_(ref)
