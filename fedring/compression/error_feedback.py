"""Error feedback: what compression leaves out this step is added back next step.

With a residual e, each step sends C(g + e) and keeps e <- (g + e) - C(g + e).
Nothing is dropped, only delayed, which is why top-k at 1% still converges like
dense SGD (Stich et al. 2018; Karimireddy et al. 2019). Error feedback is on by
default everywhere in fedring; turning it off is only useful to measure its effect.

Optional DGC momentum correction (Lin et al. 2018): with momentum m, accumulate
u <- m u + g and v <- v + u, compress v, and clear both u and v where entries
were sent ("momentum factor masking"). The optimizer must then run without its
own momentum, since the momentum is already applied here.

Invariant, bit for bit: ``payload.decompress() + residual == compensated``.

    >>> import torch
    >>> from fedring.compression.group_topk import GroupTopK
    >>> ef, topk = ErrorFeedback(4), GroupTopK(group_size=4, k=1)
    >>> g = ef.compensate(torch.tensor([1., 2., 3., 4.]))
    >>> sent = topk.compress(g); ef.update(sent)
    >>> ef.residual.tolist()
    [1.0, 2.0, 3.0, 0.0]
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from fedring.compression.payload import Payload


class ErrorFeedback:
    """Residual memory for one flat vector of `numel` float32 entries."""

    def __init__(self, numel: int, momentum: float = 0.0) -> None:
        if numel < 1:
            raise ValueError(f"numel={numel} must be >= 1")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum} must be in [0, 1)")
        self.numel = numel
        self.momentum = momentum
        self.residual = torch.zeros(numel, dtype=torch.float32)
        self.velocity = torch.zeros(numel, dtype=torch.float32) if momentum else None

    def part(self, start: int, end: int) -> ErrorFeedback:
        """Error feedback for entries ``[start, end)`` only, sharing this one's memory:
        what the part compensates, sends and keeps lands in this residual."""
        if not 0 <= start < end <= self.numel:
            raise ValueError(f"part [{start}, {end}) is not inside [0, {self.numel})")
        part = copy.copy(self)
        part.numel = end - start
        part.residual = self.residual[start:end]
        part.velocity = None if self.velocity is None else self.velocity[start:end]
        return part

    def compensate(self, grad: torch.Tensor) -> torch.Tensor:
        """Fold `grad` into the residual and return it: the vector to compress.

        The returned tensor *is* the residual buffer; call `update` with what was
        sent from it before the next `compensate`.
        """
        g = grad.reshape(-1)
        if g.numel() != self.numel:
            raise ValueError(f"gradient has {g.numel()} entries, error feedback holds {self.numel}")
        if self.velocity is not None:
            self.velocity.mul_(self.momentum).add_(g)
            self.residual.add_(self.velocity)
        else:
            self.residual.add_(g)
        return self.residual

    def update(self, sent: Payload) -> None:
        """Subtract what was sent; what remains is carried to the next step."""
        sent.add_to(self.residual, alpha=-1.0)
        if self.velocity is not None:
            self.velocity.masked_fill_(sent.decompress() != 0, 0.0)

    def keep(self, dropped: torch.Tensor) -> None:
        """Add mass dropped elsewhere (a bounded ring hop) to the residual."""
        self.residual.add_(dropped)

    def reset(self) -> None:
        self.residual.zero_()
        if self.velocity is not None:
            self.velocity.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Plain tensors only, so checkpoints load with ``weights_only=True``."""
        state = {
            "residual": self.residual.clone(),
            "momentum": torch.tensor(self.momentum, dtype=torch.float64),
        }
        if self.velocity is not None:
            state["velocity"] = self.velocity.clone()
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        residual = state["residual"]
        if residual.shape != (self.numel,) or residual.dtype != torch.float32:
            raise ValueError(
                f"residual of shape {tuple(residual.shape)} {residual.dtype}, "
                f"expected ({self.numel},) float32"
            )
        if float(state["momentum"]) != self.momentum:
            raise ValueError(f"checkpoint momentum {float(state['momentum'])} != {self.momentum}")
        if self.velocity is not None:
            velocity = state.get("velocity")
            if (
                velocity is None
                or velocity.shape != (self.numel,)
                or velocity.dtype != torch.float32
            ):
                raise ValueError(
                    f"velocity must be ({self.numel},) float32 with momentum {self.momentum}"
                )
            self.velocity.copy_(velocity)
        self.residual.copy_(residual)
