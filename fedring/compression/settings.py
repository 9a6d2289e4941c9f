"""One check of a codec's settings, shared by every place a user names them.

`ReducerSettings` (the library), `JobSpec` (job files and flags), the Flower mod
and the DDP hook's `GroupTopKState` all call `check_codec`, so a typo such as
``compression="topk"`` or a density of 0, -0.1 or 1.5 is refused the same way
everywhere, with the field, the bad value and what would be accepted, instead of
running dense or being clamped to k = 1 or k = G without a word.

    >>> check_codec(compression="gtopk")
    Traceback (most recent call last):
    ...
    fedring.compression.settings.SettingsError: compression='gtopk' must be one of none, group-topk
"""

from __future__ import annotations

import math
from typing import Any

from fedring.compression.sparse import MAX_GROUP_SIZE
from fedring.compression.values import VALUE_DTYPES, ValueDtype

COMPRESSIONS = ("none", "group-topk")
POLICIES = ("bounded", "exact")  # how the sparse ring re-selects on the way
# Kept values travel as fp16 by default, in the reducer, jobs, the Flower mod and the
# DDP hook alike: half of fp32's value bytes, and `exactify` keeps error feedback exact.
DEFAULT_VALUE_DTYPE: ValueDtype = "fp16"
RING_VALUE_DTYPES: tuple[ValueDtype, ...] = ("fp32", "fp16", "bf16", "int8")  # sign: hook only


class SettingsError(ValueError):
    """A codec setting with a bad value; `field`, `value` and `rule` name it."""

    def __init__(self, field: str, value: Any, rule: str) -> None:
        super().__init__(f"{field}={value!r} must be {rule}")
        self.field, self.value, self.rule = field, value, rule


def check_codec(
    *,
    compression: object = "group-topk",
    density: object = 0.01,
    group_size: object = 256,
    value_dtype: object = DEFAULT_VALUE_DTYPE,
    policy: object = "bounded",
    value_dtypes: tuple[str, ...] = RING_VALUE_DTYPES,
) -> None:
    """Refuse any codec setting out of its range.

    Parameters
    ----------
    compression : {"none", "group-topk"}
        The codec's name; any other spelling is refused (it never falls back to dense).
    density : float
        Fraction kept in every group, in (0, 1]. ``k = max(1, round(density * G))``,
        so a density below ``1 / group_size`` still keeps one entry per group.
    group_size : int
        Entries per group, 1 to 65536 (up to 256 gives one-byte indices).
    value_dtype : str
        How kept values travel, one of `value_dtypes`.
    policy : {"bounded", "exact"}
        The sparse ring's policy.
    value_dtypes : tuple of str
        The dtypes this caller can send (the DDP hook also takes "sign").

    Raises
    ------
    SettingsError
        Naming the first bad field, its value and what it must be.
    """
    if compression not in COMPRESSIONS:
        raise SettingsError("compression", compression, f"one of {', '.join(COMPRESSIONS)}")
    if (
        isinstance(density, bool)
        or not isinstance(density, (int, float))
        or not math.isfinite(density)
        or not 0.0 < density <= 1.0
    ):
        raise SettingsError("density", density, "a number in (0, 1]: the fraction kept per group")
    if type(group_size) is not int or not 1 <= group_size <= MAX_GROUP_SIZE:
        raise SettingsError("group_size", group_size, f"an integer in [1, {MAX_GROUP_SIZE}]")
    if value_dtype not in value_dtypes or value_dtype not in VALUE_DTYPES:
        raise SettingsError("value_dtype", value_dtype, f"one of {', '.join(value_dtypes)}")
    if policy not in POLICIES:
        raise SettingsError("policy", policy, f"one of {', '.join(POLICIES)}")
