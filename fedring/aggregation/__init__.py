"""Aggregation rules: how updates from many agents become one."""

from fedring.aggregation.rules import (
    Aggregation,
    capped_weights,
    centred_clip,
    hybrid,
    mean,
    median,
    robust,
    sign_vote,
    trimmed_mean,
    weighted,
)

__all__ = [
    "Aggregation",
    "capped_weights",
    "centred_clip",
    "hybrid",
    "mean",
    "median",
    "robust",
    "sign_vote",
    "trimmed_mean",
    "weighted",
]
