"""Aggregation rules: how updates from many agents become one."""

from fedring.aggregation.rules import (
    Aggregation,
    capped_weights,
    hybrid,
    mean,
    median,
    sign_vote,
    trimmed_mean,
    weighted,
)

__all__ = [
    "Aggregation",
    "capped_weights",
    "hybrid",
    "mean",
    "median",
    "sign_vote",
    "trimmed_mean",
    "weighted",
]
