"""make_shards partitions exactly and skews as asked; manifests catch any changed shard."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedring.training.datasets import Dataset, load_dataset
from fedring.training.sharding import (
    ShardEntry,
    ShardError,
    ShardManifest,
    build_manifest,
    make_shards,
    shard_data,
    shard_digest,
    verify_shard,
)

schemes = st.one_of(
    st.just("iid"),
    st.floats(0.1, 10).map(lambda a: f"dirichlet:{a}"),
    st.floats(0.5, 5).map(lambda b: f"quantity:{b}"),
)


@given(
    n_agents=st.integers(1, 16),
    extra=st.integers(0, 200),
    n_classes=st.integers(1, 10),
    scheme=schemes,
    seed=st.integers(0, 2**32 - 1),
)
def test_shards_partition_every_index_once(
    n_agents: int, extra: int, n_classes: int, scheme: str, seed: int
) -> None:
    n = n_agents + extra
    labels = np.random.default_rng(seed).integers(0, n_classes, n)
    shards = make_shards(labels, n_agents, scheme, seed)
    assert len(shards) == n_agents
    assert all(s.dtype == np.int64 and len(s) >= 1 for s in shards)
    assert all(np.array_equal(s, np.sort(s)) for s in shards)
    assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(n))  # no gaps, no repeats
    again = make_shards(labels, n_agents, scheme, seed)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again, strict=True))


def test_one_sample_per_agent_even_with_extreme_skew() -> None:
    labels = np.zeros(12, dtype=np.int64)
    for scheme in ("dirichlet:0.01", "quantity:0.01", "iid"):
        assert [len(s) for s in make_shards(labels, 12, scheme, seed=0)] == [1] * 12


def test_different_seeds_give_different_shards() -> None:
    labels = np.arange(100) % 5
    a, b = make_shards(labels, 4, "iid", 0), make_shards(labels, 4, "iid", 1)
    assert not np.array_equal(a[0], b[0])


def _label_skew(labels: np.ndarray, shards: list[np.ndarray], n_classes: int) -> float:
    """Mean total-variation distance of each agent's label histogram from the global one."""
    overall = np.bincount(labels, minlength=n_classes) / len(labels)
    per_agent = [np.bincount(labels[s], minlength=n_classes) / len(s) for s in shards]
    return float(np.mean([0.5 * np.abs(p - overall).sum() for p in per_agent]))


def test_small_alpha_skews_labels_far_more_than_iid() -> None:
    labels = np.arange(5000) % 10
    skew = {
        scheme: _label_skew(labels, make_shards(labels, 10, scheme, seed=0), 10)
        for scheme in ("iid", "dirichlet:100", "dirichlet:10", "dirichlet:1", "dirichlet:0.1")
    }  # measured at seed 0: 0.05, 0.04, 0.12, 0.32, 0.73
    assert skew["iid"] < 0.1 and skew["dirichlet:100"] < 0.1
    assert skew["dirichlet:10"] < skew["dirichlet:1"] < skew["dirichlet:0.1"]
    assert skew["dirichlet:0.1"] > 0.5


def test_quantity_skews_sizes_iid_does_not() -> None:
    labels = np.arange(5000) % 10
    iid = [len(s) for s in make_shards(labels, 10, "iid", seed=0)]
    skewed = [len(s) for s in make_shards(labels, 10, "quantity:0.5", seed=0)]
    assert max(iid) - min(iid) <= 1
    assert max(skewed) > 5 * min(skewed)
    assert (
        _label_skew(labels, make_shards(labels, 10, "quantity:0.5", seed=0), 10) < 0.2
    )  # labels stay mixed


@pytest.mark.parametrize(
    "scheme",
    ["", "IID", "iid:2", "zipf:1", "dirichlet", "dirichlet:", "dirichlet:abc", "dirichlet:0",
     "dirichlet:-1", "quantity:nan", "quantity:inf", "quantity:0.5:1"],
)  # fmt: skip
def test_bad_schemes_are_named(scheme: str) -> None:
    with pytest.raises(ShardError, match="scheme") as info:
        make_shards(np.zeros(10, dtype=np.int64), 2, scheme, seed=0)
    assert repr(scheme) in str(info.value)


@pytest.mark.parametrize("n_agents", [0, -1, 11])
def test_n_agents_out_of_range(n_agents: int) -> None:
    with pytest.raises(ShardError, match=f"n_agents={n_agents}"):
        make_shards(np.zeros(10, dtype=np.int64), n_agents, "iid", seed=0)


def test_digest_covers_dtype_shape_and_every_byte() -> None:
    x, y = torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64)
    base = shard_digest(x, y)
    assert len(base) == 64 and base == shard_digest(x.clone(), y.clone())
    assert base != shard_digest(x.reshape(3, 2), y.reshape(2))  # same bytes, other shape
    assert base != shard_digest(x.to(torch.int32), y)  # same bytes, other dtype
    assert base != shard_digest(x, y.to(torch.float64))
    assert shard_digest(x.t().contiguous(), y) == shard_digest(x.t(), y)  # layout-independent
    assert shard_digest(x.bfloat16(), y) != shard_digest(x.half(), y)


Planned = tuple[Dataset, list[np.ndarray], ShardManifest]


@pytest.fixture(scope="module")
def planned() -> Planned:
    dataset = load_dataset("synthetic:200:4:3", seed=0)
    shards = make_shards(dataset.y_train.numpy(), 4, "iid", seed=1)
    return dataset, shards, build_manifest(dataset, shards, "iid", seed=1)


def test_manifest_records_plan_and_round_trips(planned: Planned) -> None:
    manifest = planned[2]
    assert manifest.sizes == (40, 40, 40, 40) and manifest.dataset == "synthetic:200:4:3"
    assert (manifest.scheme, manifest.seed, manifest.n_agents) == ("iid", 1, 4)
    assert len(set(manifest.digests)) == 4
    assert ShardManifest.from_dict(manifest.to_dict()) == manifest
    assert ShardManifest.from_dict(json.loads(json.dumps(manifest.to_dict()))) == manifest


def test_verify_accepts_the_planned_data(planned: Planned) -> None:
    dataset, shards, manifest = planned
    for rank, index in enumerate(shards):
        x, y = shard_data(dataset, index)
        assert torch.equal(x, dataset.x_train[torch.from_numpy(index)])
        verify_shard(manifest, rank, x, y)


def test_verify_refuses_one_changed_value(planned: Planned) -> None:
    dataset, shards, manifest = planned
    x, y = shard_data(dataset, shards[2])
    x[7, 1] = torch.nextafter(x[7, 1], torch.tensor(np.inf))  # smallest possible change
    with pytest.raises(ShardError, match=r"shard 2: sha256 \w{12}… != manifest \w{12}…; refusing"):
        verify_shard(manifest, 2, x, y)
    x, y = shard_data(dataset, shards[2])
    y[0] = (y[0] + 1) % 3
    with pytest.raises(ShardError, match="shard 2: sha256"):
        verify_shard(manifest, 2, x, y)


def test_verify_refuses_swapped_shard_and_bad_rank(planned: Planned) -> None:
    dataset, shards, manifest = planned
    x, y = shard_data(dataset, shards[1])
    with pytest.raises(ShardError, match="shard 0: sha256"):
        verify_shard(manifest, 0, x, y)  # same size, other agent's data
    for rank in (-1, 4):
        with pytest.raises(ShardError, match=rf"rank {rank} out of range 0\.\.3"):
            verify_shard(manifest, rank, x, y)
    with pytest.raises(ShardError, match="shard 1: 39 samples / 39 labels != manifest size 40"):
        verify_shard(manifest, 1, x[:-1], y[:-1])


def test_an_entry_is_one_row_the_same_size_at_any_n_and_checks_like_the_table() -> None:
    """Enrolment stays O(1) per agent: an agent is sent its own row and the table's hash."""
    dataset = load_dataset("synthetic:400:4:3", seed=0)
    sizes = []
    for n in (4, 40, 100):
        shards = make_shards(dataset.y_train.numpy(), n, "iid", seed=1)
        manifest = build_manifest(dataset, shards, "iid", seed=1)
        entry = manifest.entry(n - 1)
        sizes.append(len(json.dumps(entry.to_dict())))
        assert ShardEntry.from_dict(json.loads(json.dumps(entry.to_dict()))) == entry
        assert entry.table == manifest.sha256() and entry.digest == manifest.digests[n - 1]
        x, y = shard_data(dataset, shards[n - 1])
        verify_shard(entry, n - 1, x, y)
        with pytest.raises(ShardError, match=f"shard {n - 2}: the entry sent is shard {n - 1}'s"):
            verify_shard(entry, n - 2, x, y)
        with pytest.raises(ShardError, match=f"shard {n - 1}: .* != manifest size"):
            verify_shard(entry, n - 1, x[:-1], y[:-1])
    assert max(sizes) - min(sizes) <= 4  # the digits of n and rank, nothing per agent


@pytest.mark.parametrize(
    ("change", "fragment"),
    [({"rank": 9}, "rank 9 out of range 0..3"), ({"digest": "x"}, "entry.digest='x'"),
     ({"size": "3"}, "entry.size: expected int"), ({"table": None}, "entry.table: expected str")],
)  # fmt: skip
def test_a_bad_entry_names_its_field(
    planned: Planned, change: dict[str, object], fragment: str
) -> None:
    good = planned[2].entry(0).to_dict()
    with pytest.raises(ShardError, match=re.escape(fragment)):
        ShardEntry.from_dict({**good, **change})
    with pytest.raises(ShardError, match="missing field 'table'"):
        ShardEntry.from_dict({k: v for k, v in good.items() if k != "table"})


def test_the_table_hash_names_its_content(planned: Planned) -> None:
    manifest = planned[2]
    assert manifest.sha256() == ShardManifest.from_dict(manifest.to_dict()).sha256()
    other = ShardManifest.from_dict({**manifest.to_dict(), "seed": 2})
    assert other.sha256() != manifest.sha256()


def test_shard_data_rejects_bad_index(planned: Planned) -> None:
    dataset = planned[0]
    with pytest.raises(ShardError, match=r"outside 0\.\.159"):
        shard_data(dataset, np.array([0, 160]))
    with pytest.raises(ShardError, match="index"):
        shard_data(dataset, np.array([0.0, 1.0]))


_GOOD = {
    "dataset": "digits",
    "scheme": "iid",
    "seed": 0,
    "n_agents": 2,
    "sizes": [3, 4],
    "digests": ["a" * 64, "b" * 64],
}


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"dataset": None}, "manifest.dataset: expected str"),
        ({"seed": "0"}, "manifest.seed: expected int"),
        ({"seed": True}, "manifest.seed: expected int, got True"),
        ({"n_agents": 2.0}, "manifest.n_agents"),
        ({"sizes": "3,4"}, "manifest.sizes: expected a list"),
        ({"sizes": [3, "4"]}, r"manifest.sizes\[1\]"),
        ({"digests": ["a" * 64, 5]}, r"manifest.digests\[1\]"),
        ({"digests": ["a" * 64, "B" * 64]}, r"digests\[1\]='B+' is not a sha256"),
        ({"digests": ["a" * 64]}, "n_agents=2 but 2 sizes, 1 digests"),
    ],
)
def test_manifest_from_dict_names_the_bad_field(change: dict[str, object], fragment: str) -> None:
    with pytest.raises(ShardError, match=fragment):
        ShardManifest.from_dict({**_GOOD, **change})


def test_manifest_from_dict_missing_field() -> None:
    assert ShardManifest.from_dict(_GOOD).sizes == (3, 4)
    with pytest.raises(ShardError, match="missing field 'digests'"):
        ShardManifest.from_dict({k: v for k, v in _GOOD.items() if k != "digests"})


def test_n_entries_hash_the_table_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`entry` per rank is O(N) in all, not O(N^2): the table's hash is computed once,
    and it is still the sha256 of the table's canonical JSON."""
    import fedring.training.sharding as sharding

    n = 50
    manifest = ShardManifest("synthetic:400:4:3", "iid", 1, n, (8,) * n,
                             tuple(f"{i:064x}" for i in range(n)))  # fmt: skip
    text = json.dumps(manifest.to_dict(), sort_keys=True, separators=(",", ":"))
    table = sharding.hashlib.sha256(text.encode()).hexdigest()
    calls: list[int] = []
    real = sharding.hashlib.sha256

    def counted(data: bytes = b"") -> object:
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(sharding.hashlib, "sha256", counted)
    entries = [manifest.entry(r) for r in range(n)]
    assert len(calls) == 1  # not n
    assert entries == [ShardEntry("synthetic:400:4:3", "iid", 1, n, r, 8, f"{r:064x}", table)
                       for r in range(n)]  # fmt: skip
    assert manifest.sha256() == table and len(calls) == 1
