"""Split a training set among agents, and pin each agent's shard by content hash.

`make_shards` partitions ``range(len(labels))`` deterministically by scheme:

- ``iid``: a shuffled equal split (sizes differ by at most one).
- ``dirichlet:ALPHA``: label skew, the usual FL recipe: each class's samples are split
  among agents in proportions drawn from Dirichlet(ALPHA). Small ALPHA (0.1) gives most
  agents only a few classes; large ALPHA (100) approaches iid.
- ``quantity:BETA``: size skew: agent sizes follow Dirichlet(BETA) proportions of a
  shuffled index list, labels stay mixed.

Every agent gets at least one sample. A `ShardManifest` records each shard's size and
sha256 so an agent can refuse to train on data that is not what the job planned.

    >>> shards = make_shards(np.array([0, 0, 1, 1, 2]), n_agents=2, scheme="iid", seed=0)
    >>> sorted(np.concatenate(shards).tolist())
    [0, 1, 2, 3, 4]
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from fedring.training.datasets import Dataset

_DIGEST_HEX = frozenset("0123456789abcdef")


class ShardError(ValueError):
    """A bad scheme or shard, or data that does not match its manifest."""


def make_shards(labels: np.ndarray, n_agents: int, scheme: str, seed: int) -> list[np.ndarray]:
    """Partition sample indices among agents.

    Parameters
    ----------
    labels : np.ndarray
        Integer class labels, shape ``[n]`` (only ``dirichlet`` looks at the values).
    n_agents : int
        Number of shards, ``1 <= n_agents <= n``.
    scheme : str
        ``iid``, ``dirichlet:ALPHA`` or ``quantity:BETA`` with ALPHA, BETA > 0.
    seed : int
        Same ``(labels, n_agents, scheme, seed)`` gives the same shards.

    Returns
    -------
    list of np.ndarray
        ``n_agents`` sorted int64 index arrays, each non-empty, together covering every
        index exactly once.

    Raises
    ------
    ShardError
        Malformed scheme, non-positive parameter, or ``n_agents`` out of range.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ShardError(f"labels: expected shape [n], got {labels.shape}")
    if isinstance(n_agents, bool) or not isinstance(n_agents, int):
        raise ShardError(f"n_agents: expected an int, got {n_agents!r}")
    if not 1 <= n_agents <= len(labels):
        raise ShardError(f"n_agents={n_agents} must be in 1..{len(labels)} (number of samples)")
    split, param = _parse_scheme(scheme)
    shards = split(labels, n_agents, param, np.random.default_rng(seed))
    _fill_empty(shards)
    return [np.sort(s).astype(np.int64) for s in shards]


def _parse_scheme(scheme: str) -> tuple[_Splitter, float]:
    if not isinstance(scheme, str):
        raise ShardError(f"scheme: expected a string, got {scheme!r}")
    kind, sep, text = scheme.partition(":")
    if kind == "iid" and not sep:
        return _split_iid, 0.0
    if kind not in _PARAM_SCHEMES or not sep:
        raise ShardError(f"scheme {scheme!r}: expected iid, dirichlet:ALPHA or quantity:BETA")
    name = "ALPHA" if kind == "dirichlet" else "BETA"
    try:
        value = float(text)
    except ValueError:
        raise ShardError(f"scheme {scheme!r}: {name}={text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise ShardError(f"scheme {scheme!r}: {name}={text!r} must be a finite number > 0")
    return _PARAM_SCHEMES[kind], value


def _split_iid(labels: np.ndarray, n: int, _: float, rng: np.random.Generator) -> list[np.ndarray]:
    return list(np.array_split(rng.permutation(len(labels)), n))


def _split_by_proportions(index: np.ndarray, p: np.ndarray) -> list[np.ndarray]:
    cuts = np.floor(np.cumsum(p)[:-1] * len(index)).astype(np.int64)
    return list(np.split(index, cuts))


def _split_dirichlet(
    labels: np.ndarray, n: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        for agent, piece in enumerate(_split_by_proportions(members, rng.dirichlet([alpha] * n))):
            parts[agent].append(piece)
    return [np.concatenate(p) for p in parts]


def _split_quantity(
    labels: np.ndarray, n: int, beta: float, rng: np.random.Generator
) -> list[np.ndarray]:
    return _split_by_proportions(rng.permutation(len(labels)), rng.dirichlet([beta] * n))


def _fill_empty(shards: list[np.ndarray]) -> None:
    """Give every empty shard one sample from the currently largest shard (in place)."""
    for i in range(len(shards)):
        if len(shards[i]) == 0:
            donor = max(range(len(shards)), key=lambda j: len(shards[j]))
            shards[i], shards[donor] = shards[donor][-1:], shards[donor][:-1]


_Splitter = Callable[[np.ndarray, int, float, np.random.Generator], list[np.ndarray]]
_PARAM_SCHEMES: dict[str, _Splitter] = {"dirichlet": _split_dirichlet, "quantity": _split_quantity}


@dataclass(frozen=True)
class ShardManifest:
    """What each agent should hold: the sizes and sha256 digests of its shard."""

    dataset: str  # the dataset spec the shards index into
    scheme: str  # the sharding scheme, e.g. "dirichlet:0.5"
    seed: int  # the seed given to make_shards
    n_agents: int
    sizes: tuple[int, ...]  # samples per agent, by rank
    digests: tuple[str, ...]  # sha256 hex of each shard's (x, y), by rank

    def __post_init__(self) -> None:
        if len(self.sizes) != self.n_agents or len(self.digests) != self.n_agents:
            raise ShardError(
                f"n_agents={self.n_agents} but {len(self.sizes)} sizes, {len(self.digests)} digests"
            )
        for rank, digest in enumerate(self.digests):
            if len(digest) != 64 or not _DIGEST_HEX.issuperset(digest):
                raise ShardError(f"digests[{rank}]={digest!r} is not a sha256 hex string")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/TOML-ready form; `from_dict` reverses it."""
        return {
            "dataset": self.dataset,
            "scheme": self.scheme,
            "seed": self.seed,
            "n_agents": self.n_agents,
            "sizes": list(self.sizes),
            "digests": list(self.digests),
        }

    def sha256(self) -> str:
        """The table's content address: sha256 of its canonical JSON."""
        return self._table_sha256

    @cached_property
    def _table_sha256(self) -> str:
        # Once per table: `entry` is called per rank (the coordinator's grid, its
        # enrolment), and hashing the whole table each time made N entries O(N^2).
        # The fields are frozen, so the hash cannot go stale.
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def entry(self, rank: int) -> ShardEntry:
        """Shard `rank`'s row, all an agent needs to check its own shard: its size
        stays the same whatever the number of agents (the table is named by hash)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.n_agents:
            raise ShardError(f"rank {rank!r} out of range 0..{self.n_agents - 1}")
        return ShardEntry(self.dataset, self.scheme, self.seed, self.n_agents, rank,
                          self.sizes[rank], self.digests[rank], self.sha256())  # fmt: skip

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShardManifest:
        """Validate and rebuild a manifest; ShardError names the first bad field."""
        if not isinstance(d, Mapping):
            raise ShardError(f"manifest: expected a mapping, got {type(d).__name__}")
        fields = {"dataset": str, "scheme": str, "seed": int, "n_agents": int}
        for key in (*fields, "sizes", "digests"):
            if key not in d:
                raise ShardError(f"manifest: missing field {key!r}")
        for key, kind in fields.items():
            _check_type(key, d[key], kind)
        for key, kind in (("sizes", int), ("digests", str)):
            if not isinstance(d[key], list | tuple):
                raise ShardError(f"manifest.{key}: expected a list, got {d[key]!r}")
            for i, item in enumerate(d[key]):
                _check_type(f"{key}[{i}]", item, kind)
        return cls(
            d["dataset"],
            d["scheme"],
            d["seed"],
            d["n_agents"],
            tuple(d["sizes"]),
            tuple(d["digests"]),
        )


@dataclass(frozen=True)
class ShardEntry:
    """One agent's row of a `ShardManifest`, with the whole table's sha256."""

    dataset: str
    scheme: str
    seed: int
    n_agents: int
    rank: int
    size: int
    digest: str  # sha256 hex of this shard's (x, y)
    table: str  # sha256 of the manifest's canonical JSON (`ShardManifest.sha256`)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.n_agents:
            raise ShardError(f"entry: rank {self.rank} out of range 0..{self.n_agents - 1}")
        for name in ("digest", "table"):
            value = getattr(self, name)
            if len(value) != 64 or not _DIGEST_HEX.issuperset(value):
                raise ShardError(f"entry.{name}={value!r} is not a sha256 hex string")

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in _ENTRY_FIELDS}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShardEntry:
        """Validate and rebuild an entry; ShardError names the first bad field."""
        if not isinstance(d, Mapping):
            raise ShardError(f"shard entry: expected a mapping, got {type(d).__name__}")
        for key, kind in _ENTRY_FIELDS.items():
            if key not in d:
                raise ShardError(f"shard entry: missing field {key!r}")
            _check_type(key, d[key], kind, "entry")
        return cls(**{key: d[key] for key in _ENTRY_FIELDS})


_ENTRY_FIELDS: dict[str, type] = {
    "dataset": str, "scheme": str, "seed": int, "n_agents": int, "rank": int, "size": int,
    "digest": str, "table": str,
}  # fmt: skip


def _check_type(field: str, value: Any, kind: type, where: str = "manifest") -> None:
    # bool is an int subclass; a manifest saying seed=true is corrupt, not seed 1.
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ShardError(f"{where}.{field}: expected {kind.__name__}, got {value!r}")


def shard_digest(x: torch.Tensor, y: torch.Tensor) -> str:
    """sha256 hex of a shard: dtype names and shapes, then the contiguous bytes of x, then y.

    Bytes are in native order; every supported board is little-endian.

    >>> shard_digest(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64))[:12]
    'c1e859756201'
    """
    h = hashlib.sha256()
    for t in (x, y):
        header = f"{t.dtype}|{','.join(str(s) for s in t.shape)};"
        h.update(header.encode())
    for t in (x, y):
        # Viewing as bytes works for every dtype (bfloat16 has no numpy equivalent).
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def shard_data(dataset: Dataset, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(x_train[index], y_train[index])`` as fresh tensors."""
    index = np.asarray(index)
    if index.ndim != 1 or (index.size and index.dtype.kind not in "iu"):
        raise ShardError(f"index: expected a 1-D integer array, got {index.dtype} {index.shape}")
    n = len(dataset.y_train)
    if index.size and (index.min() < 0 or index.max() >= n):
        raise ShardError(f"index: values {index.min()}..{index.max()} outside 0..{n - 1}")
    idx = torch.from_numpy(index.astype(np.int64))
    return dataset.x_train[idx], dataset.y_train[idx]


def build_manifest(
    dataset: Dataset, shards: list[np.ndarray], scheme: str, seed: int
) -> ShardManifest:
    """Record the size and digest of each shard of ``dataset`` (shards as from make_shards)."""
    digests = tuple(shard_digest(*shard_data(dataset, s)) for s in shards)
    sizes = tuple(len(s) for s in shards)
    return ShardManifest(dataset.name, scheme, seed, len(shards), sizes, digests)


def verify_shard(
    manifest: ShardManifest | ShardEntry, rank: int, x: torch.Tensor, y: torch.Tensor
) -> None:
    """Check that ``(x, y)`` is exactly shard ``rank`` of ``manifest`` (the whole
    table, or the one row an agent is sent).

    Raises
    ------
    ShardError
        Rank out of range (or not the entry's), wrong number of samples, or a digest
        mismatch; the message names the shard and both values.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < manifest.n_agents:
        raise ShardError(f"rank {rank!r} out of range 0..{manifest.n_agents - 1}")
    if isinstance(manifest, ShardEntry):
        if rank != manifest.rank:
            raise ShardError(f"shard {rank}: the entry sent is shard {manifest.rank}'s")
        want_size, want = manifest.size, manifest.digest
    else:
        want_size, want = manifest.sizes[rank], manifest.digests[rank]
    if len(x) != want_size or len(y) != want_size:
        raise ShardError(
            f"shard {rank}: {len(x)} samples / {len(y)} labels != manifest size {want_size}"
        )
    got = shard_digest(x, y)
    if got != want:
        raise ShardError(
            f"shard {rank}: sha256 {got[:12]}… != manifest {want[:12]}…; refusing to train on it"
        )
