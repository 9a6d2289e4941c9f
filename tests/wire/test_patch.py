"""Checkpoint patches (`wire.patch`): exact to the bit, never bigger than dense, and a
malformed one refused by name before it changes anything."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.patch import apply_patch, encode_patch


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), moved=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_a_patch_turns_the_old_slice_into_the_new_bit_for_bit(
    n: int, moved: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    old = rng.standard_normal(n).astype(np.float32)
    new = old.copy()
    at = rng.random(n) < moved
    new[at] = rng.standard_normal(int(at.sum())).astype(np.float32)
    new[at & (rng.random(n) < 0.1)] = -0.0  # a sign flip of zero is a change too
    doc, blob = encode_patch(old, new, lo=7)
    assert len(blob) <= 4 * n  # never more than the dense slice
    target = np.zeros(n + 20, dtype=np.float32)
    target[7 : 7 + n] = old
    apply_patch(target, doc, blob)
    assert target[7 : 7 + n].tobytes() == new.tobytes()
    assert not target[:7].any() and not target[7 + n :].any()


def test_each_patch_takes_its_smallest_form() -> None:
    old = np.zeros(1000, dtype=np.float32)
    new = old.copy()
    new[[3, 500]] = 1.0  # two entries: 2-byte indices beat a count for each of 4 groups
    doc, blob = encode_patch(old, new, lo=0)
    assert (doc["index"], doc["n"], len(blob)) == ("u2", 2, 12)
    new[::20] = 2.0  # 50 entries: a byte a group and a byte an entry, 4 + 5 x 50
    doc, blob = encode_patch(old, new, lo=0)
    assert (doc["index"], doc["n"], len(blob)) == ("g1", 51, 4 + 5 * 51)
    doc, blob = encode_patch(old, old + 1.0, lo=0)
    assert (doc["index"], len(blob)) == ("dense", 4000)
    big = np.zeros(70_000, dtype=np.float32)
    moved = big.copy()
    moved[:256] = 1.0  # a whole group moved: its count (256) does not fit a byte
    doc, blob = encode_patch(big, moved, lo=0)
    assert (doc["index"], len(blob)) == ("i4", 256 * 8)  # indices past 65535: int32


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("lo", -1, FrameReason.SHAPE_MISMATCH),
        ("hi", 99, FrameReason.SHAPE_MISMATCH),
        ("n", 5, FrameReason.SHAPE_MISMATCH),
        ("index", "u8", FrameReason.BAD_DTYPE),
    ],
)
def test_a_malformed_patch_is_refused_by_name_and_changes_nothing(
    field: str, value: object, reason: FrameReason
) -> None:
    old = np.zeros(8, dtype=np.float32)
    new = old.copy()
    new[2] = 3.0
    doc, blob = encode_patch(old, new, lo=0)
    target = np.zeros(10, dtype=np.float32)
    with pytest.raises(FrameError, match=field) as info:
        apply_patch(target, {**doc, field: value}, blob)
    assert info.value.reason is reason
    assert not target.any()


def test_grouped_counts_that_do_not_add_up_are_refused() -> None:
    old = np.zeros(600, dtype=np.float32)
    new = old.copy()
    new[::10] = 1.0
    doc, blob = encode_patch(old, new, lo=0)
    assert doc["index"] == "g1"
    target = np.zeros(600, dtype=np.float32)
    bad = bytes([blob[0] + 1]) + blob[1:]  # the first group claims one more
    with pytest.raises(FrameError, match="counts sum"):
        apply_patch(target, doc, bad)
    with pytest.raises(FrameError, match="g1 patch of"):
        apply_patch(target, doc, blob[:-1])
    assert not target.any()


def test_indices_out_of_order_or_past_the_slice_are_refused() -> None:
    target = np.zeros(10, dtype=np.float32)
    values = np.ones(2, dtype="<f4").tobytes()
    for at in ([5, 3], [1, 8]):
        blob = np.array(at, dtype="<u2").tobytes() + values
        with pytest.raises(FrameError) as info:
            apply_patch(target, {"lo": 0, "hi": 6, "n": 2, "index": "u2"}, blob)
        assert info.value.reason is FrameReason.INDEX_OUT_OF_RANGE
    assert not target.any()
