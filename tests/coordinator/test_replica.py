"""The coordinator's copy of the ring's model, patched (`coordinator.replica`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedring.coordinator.replica import MAX_PENDING, Replica
from fedring.training.models import flat_sha256
from fedring.wire.control import ControlMessage
from fedring.wire.patch import encode_patch

MEMBERS = ["a", "b"]  # the patchers; the head "h" sends none


def _patches(old: torch.Tensor, new: torch.Tensor, rnd: int, since: int,
             sha: str = "") -> list[ControlMessage]:  # fmt: skip
    out = []
    for i, src in enumerate(MEMBERS):
        lo, hi = i * len(old) // 2, (i + 1) * len(old) // 2
        doc, blob = encode_patch(old[lo:hi].numpy(), new[lo:hi].numpy(), lo=lo)
        full: dict[str, Any] = {"from": since, "sha256": sha or flat_sha256(new), **doc}
        out.append(ControlMessage("model", "j", src, rnd, full, blob, True))
    return out


def test_every_members_patch_makes_the_next_checkpoint_exactly() -> None:
    r = Replica()
    old = torch.randn(10)
    r.reset(old, 4)
    new = old.clone()
    new[[0, 9]] += 1.0
    a, b = _patches(old, new, 5, 4)
    assert r.take(a, MEMBERS) is None  # waiting for b
    assert r.take(a, MEMBERS) is None  # a doubled patch changes nothing
    taken = r.take(b, MEMBERS)
    assert taken is not None and taken.params is not None and taken.round == 5
    assert flat_sha256(taken.params) == flat_sha256(new) and r.round == 5
    assert flat_sha256(old) != flat_sha256(new)  # the checkpoint before is untouched
    assert r.take(a, MEMBERS) is None  # stale now


def test_a_copy_that_hashes_otherwise_asks_for_the_whole_model() -> None:
    r = Replica()
    old = torch.zeros(10)
    r.reset(old, 0)
    new = old + 1.0
    a, b = _patches(old, new, 1, 0, sha="f" * 64)
    r.take(a, MEMBERS)
    taken = r.take(b, MEMBERS)
    assert taken is not None and taken.params is None and "hashes to" in taken.why
    assert r.round == 0 and np.array_equal(r.params, old)  # type: ignore[arg-type]


def test_no_base_or_another_base_asks_for_the_whole_model() -> None:
    old, new = torch.zeros(4), torch.ones(4)
    r = Replica()
    for p in _patches(old, new, 3, 2):
        taken = r.take(p, MEMBERS)
    assert taken is not None and taken.params is None and "copy is of -1" in taken.why
    r.reset(old, 1)
    for p in _patches(old, new, 3, 2):
        taken = r.take(p, MEMBERS)
    assert taken is not None and taken.params is None


def test_strangers_are_ignored_and_incomplete_rounds_do_not_pile_up() -> None:
    r = Replica()
    r.reset(torch.zeros(4), 0)
    a, _ = _patches(torch.zeros(4), torch.ones(4), 1, 0)
    stranger = ControlMessage("model", "j", "z", 1, a.doc, a.blob, True)
    assert r.take(stranger, MEMBERS) is None and not r.pending
    for rnd in range(1, 20):
        r.take(ControlMessage("model", "j", "a", rnd, a.doc, a.blob, True), MEMBERS)
    assert len(r.pending) == MAX_PENDING
