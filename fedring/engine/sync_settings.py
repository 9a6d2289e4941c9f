"""When and how a group agrees: `SyncSettings`, and the combinations it refuses.

Modes (`SyncSettings.mode`):

- ``sync``: every `DistributedOptimizer.step` is agreed. On the gradient (the
  ``gradient`` agreement, below), it all-reduces the flat gradient (compressed by
  the reducer, with error feedback), writes the agreed mean into every ``.grad``
  and lets the wrapped optimizer step. Every member applies the same bits, so
  every member holds the same parameters after every step.
- ``local``: the wrapped optimizer steps on the local gradient; every
  `local_steps` steps the *parameter deltas* since the last sync are agreed and
  every member moves the synced model by the agreed delta (Local SGD; SEEDS A's
  incremental updates). `correction` adds ``mu * (p - p_sync)`` to each local
  gradient so that local steps do not drift far from the global model (SEEDS D).

Aggregation: ``mean`` and ``weighted`` sum ``weight * vec`` around the ring (or
at the centre of a star, `SyncSettings.star`); ``vote`` is signSGD's majority;
``median`` and ``trimmed`` go through a star's centre; ``hybrid:L`` mixes the
global mean with the local vector (SEEDS A).

What a sync step agrees on (`SyncSettings.agree`, resolved by `agreement`):

- ``gradient``: the flat gradient, as above; the wrapped optimizer steps on the
  agreed mean.
- ``update``: each member's wrapped optimizer steps on its own gradient and the
  group agrees on the parameter delta of that step (local mode with H = 1):
  momentum and Adam's moments see uncompressed local gradients and error feedback
  works in parameter space. Each member takes its gradient at its *view*, the
  agreed model plus its own update still waiting in error feedback
  (`DistributedOptimizer.view`): at the agreed model alone, momentum keeps
  pushing toward where the model stood while its update waited for its turn in
  the top-k, and collapsed. Between steps every member holds the agreed model,
  bit for bit, as under ``gradient``; each keeps its own optimizer state (moments
  of its own gradients: alike in expectation over iid shards, not bit for bit).
- ``auto`` (default): ``update`` where the reducer compresses with error feedback
  and the wrapped optimizer is anything but plain SGD; ``gradient`` for plain SGD
  and every dense ring, bit for bit as before. Jobs (`fedring.build`) pin
  ``gradient``: Flower's relayed ring and node send gradients.

Measured by ``python bench/optimizers.py --seeds 0,1,2`` (4 agents, iid shards,
group-top-k 1% + EF, 66x / 49x fewer bytes than dense; mean of 3 seeds; digits MLP
300 rounds, MNIST-1D CNN 600 rounds), dense / top-k ``gradient`` / top-k ``update``
(``update`` over the dense ring, its dense twin, in brackets):

- SGD momentum 0.9: digits 0.972 / 0.701 / 0.972 (0.972), MNIST-1D 0.909 /
  0.228 / 0.938 (0.906).
- AdamW, base lr 6e-3 (sqrt-scaled): digits 0.974 / 0.940 / 0.977 (0.974),
  MNIST-1D 0.906 / 0.601 / 0.895 (0.893; seeds 0.884-0.903 vs dense 0.894-0.918).
- AdamW, base lr 3e-3: digits 0.977 / 0.880 / 0.977 (0.975), MNIST-1D 0.870 /
  0.581 / 0.832 (0.844): most of the gap is the dense twin's, not compression's.
  A member's Adam normalises by the moments of its own batch, noisier than the
  group's mean gradient, and steps shorter. Give Adam under ``update`` a higher rate (linear
  rather than sqrt scaling: the 6e-3 row's peak, 1.2e-2, is 3e-3 x 4).
- Plain SGD (``auto``: ``gradient``): digits 0.970 / 0.968, MNIST-1D 0.873 / 0.863.

DGC momentum correction (`ReducerSettings.momentum_correction`, with SGD momentum
0, on the gradient) recovers only part: 0.955 and 0.669. Local mode
(``python bench/optimizers.py --local-steps 4``, seed 0, as many steps) lags dense
at 1% on MNIST-1D for every optimizer (plain SGD 0.750 vs 0.880, with 4x fewer
bytes than sync); ``agree="update"`` there (the view) lifts momentum SGD (0.617 to
0.835, dense 0.904) but not AdamW (0.780 to 0.683, dense 0.821), so ``auto``
leaves local mode as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedring.aggregation.rules import Aggregation

AGREEMENTS = ("auto", "gradient", "update")
Agreement = Literal["gradient", "update"]


def plain_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """`torch.optim.SGD` without momentum in any group: the optimizer that stays on
    the agreed gradient under compression (plain EF-SGD)."""
    return isinstance(optimizer, torch.optim.SGD) and not any(
        g.get("momentum", 0.0) for g in optimizer.param_groups
    )


@dataclass(frozen=True)
class SyncSettings:
    """When and how the group agrees (see `engine.sync_settings`)."""

    mode: Literal["sync", "local"] = "sync"
    local_steps: int = 4  # H: local steps between syncs (local mode)
    aggregation: str = "mean"  # mean | weighted | vote | hybrid:L[-L2] | median | trimmed:B
    rounds: int = 0  # total rounds, for a scheduled hybrid lambda
    correction: float = 0.0  # local mode: pull toward the synced model
    reset_state_at_sync: bool = False  # local mode: clear the optimizer's state at each sync
    update_delay: int = 0  # sync: apply each agreed gradient one round late (0 or 1)
    bucket_kb: int = 0  # sync: all-reduce buckets of this many KB during backward; 0 = off
    star: bool = False  # every agreement but the sign vote goes through the group's centre
    sample: float = 1.0  # star: members trained per round (`participation.sampled`)
    seed: int = 0  # with the round, picks the sample
    sit_out: str = "keep"  # the residual of a member back from sitting out (`SitOut`)
    agree: str = "auto"  # sync: auto | gradient | update (see `agreement`)

    @property
    def rule(self) -> Aggregation:
        return Aggregation.parse(self.aggregation)

    def agreement(
        self, optimizer: torch.optim.Optimizer, compressed: bool, *, viewable: bool = True
    ) -> Agreement:
        """What a sync step agrees on (local mode always agrees on updates).

        ``auto`` picks ``update`` where the reducer compresses with error feedback
        (`compressed`), the wrapped optimizer is anything but plain SGD (momentum SGD,
        Adam, AdamW, ...), the rule is ``mean`` or ``weighted``, nothing else needs
        a gradient (bucket overlap, the delayed update, client sampling) and the
        optimizer has a model to take to the member's view (`viewable`: ``model=``
        given); ``gradient`` otherwise, so plain EF-SGD and every dense ring run as
        before.
        """
        if self.agree != "auto" or self.mode == "local":
            return "update" if self.mode == "local" else self.agree  # type: ignore[return-value]
        plain = self.bucket_kb == 0 and self.update_delay == 0 and self.sample == 1.0
        if compressed and viewable and plain and self.rule.kind in ("mean", "weighted"):
            return "gradient" if plain_sgd(optimizer) else "update"
        return "gradient"

    def ahead(
        self, optimizer: torch.optim.Optimizer, compressed: bool, *, viewable: bool = True
    ) -> bool:
        """Whether a member computes its gradients at its *view*: the agreed model
        plus its own update still waiting in error feedback (`DistributedOptimizer.view`).
        Sync mode: with the ``update`` agreement. Local mode: only with
        ``agree="update"`` (``auto`` keeps local mode as it was)."""
        if not viewable:
            return False
        if self.mode == "sync":
            return self.agreement(optimizer, compressed, viewable=viewable) == "update"
        return self.agree == "update"

    def check(self) -> None:
        """Raise `ValueError` for a combination no optimizer runs; a
        `DistributedOptimizer` calls it when it is built."""
        kind = self.rule.kind
        if self.agree not in AGREEMENTS:
            raise ValueError(f"agree={self.agree!r} must be one of {', '.join(AGREEMENTS)}")
        if self.agree == "gradient" and self.mode == "local":
            raise ValueError("agree='gradient' needs sync mode: local mode agrees on updates")
        if self.agree == "update" and self.mode == "sync" and (
            self.bucket_kb or self.update_delay or self.sample != 1.0
            or kind not in ("mean", "weighted")
        ):  # fmt: skip
            raise ValueError(
                "agree='update' needs aggregation mean or weighted, no bucket_kb, no "
                f"update_delay and no client sampling, not aggregation={kind!r}, "
                f"bucket_kb={self.bucket_kb}, update_delay={self.update_delay}, "
                f"sample={self.sample}"
            )
        if self.sample != 1.0 and (not self.star or kind in ("vote", "hybrid", "weighted")):
            raise ValueError(
                f"client sampling (sample={self.sample}) needs a star and aggregation mean, "
                f"median or trimmed, not star={self.star}, aggregation={kind!r}"
            )
        if (self.bucket_kb or self.update_delay) and kind not in ("mean", "weighted"):
            raise ValueError(f"overlap needs aggregation mean or weighted, not {kind}")
        delay, mode, bucket_kb = self.update_delay, self.mode, self.bucket_kb
        if delay not in (0, 1) or (delay and (mode != "sync" or bucket_kb)):
            raise ValueError(
                f"update_delay={delay} needs 0 or 1, sync mode and bucket_kb=0, "
                f"not mode={mode!r}, bucket_kb={bucket_kb}"
            )
