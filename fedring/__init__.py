"""fedring: collaborative training across edge boards.

Agents compress what they send with group-top-k sparsification and error
feedback, and exchange the pieces in a ring (reduce-scatter, then all-gather)
over an MQTT broker, Flower, or in-process queues. See README.md.

The library API (imported on first use, so ``import fedring`` stays light)::

    groups = fedring.local_group(4)                       # or a group from a manifest
    reducer = fedring.Reducer(groups[rank].collective, numel, fedring.ReducerSettings())
    opt = fedring.DistributedOptimizer(torch.optim.AdamW(model.parameters()), reducer,
                                       model=model)   # rank 0's start, sent to every member
    groups[rank].stats()                                  # bytes and frames, sent and received

With torch.distributed instead: ``ddp.register_comm_hook(fedring.GroupTopKState(),
fedring.group_topk_hook)``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_API = {
    "local_group": "fedring.engine.group",
    "connect": "fedring.rendezvous",  # a module named fedring.connect would shadow it
    "Group": "fedring.engine.group",
    "Reducer": "fedring.engine.reducer",
    "ReducerSettings": "fedring.engine.reducer",
    "DistributedOptimizer": "fedring.engine.optimizer",
    "SyncSettings": "fedring.engine.sync_settings",
    "LinearScaling": "fedring.engine.lr",
    "ShardSampler": "fedring.engine.sampler",
    "TrainerState": "fedring.engine.state",
    "Task": "fedring.engine.task",
    "ClassificationTask": "fedring.engine.task",
    "plan": "fedring.engine.plan",
    "Plan": "fedring.engine.plan",
    "prepare": "fedring.engine.plan",
    "GroupStats": "fedring.engine.group",
    "InitialModelMismatch": "fedring.engine.initial",
    "DirectStepError": "fedring.engine.steps",
    "StepMismatch": "fedring.engine.steps",
    "SettingsError": "fedring.compression.settings",
    # The DDP communication hook (fedring.engine.ddp_hook), for torch.distributed users:
    # ddp.register_comm_hook(fedring.GroupTopKState(density=0.01), fedring.group_topk_hook)
    "GroupTopKState": "fedring.engine.ddp_hook",
    "group_topk_hook": "fedring.engine.ddp_hook",
}
__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'fedring' has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)
