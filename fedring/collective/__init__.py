"""Collectives over a point-to-point channel: ring all-reduce (dense, sparse), sign vote."""

from fedring.collective.channel import CollectiveError, CollectiveTimeout, PeerChannel, PeerLost
from fedring.collective.local import LocalRun, run_local_ring
from fedring.collective.ring import Ring, SparsePolicy, chunk_bounds
from fedring.collective.vote import majority_vote

__all__ = [
    "CollectiveError",
    "CollectiveTimeout",
    "LocalRun",
    "PeerChannel",
    "PeerLost",
    "Ring",
    "SparsePolicy",
    "chunk_bounds",
    "majority_vote",
    "run_local_ring",
]
