"""load_dataset: shapes and dtypes per spec, seeded splits, and npz validation errors."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedring.training import datasets
from fedring.training.datasets import Dataset, DatasetError, load_dataset


def _check_well_formed(ds: Dataset) -> None:
    assert ds.x_train.dtype == ds.x_test.dtype == torch.float32
    assert ds.y_train.dtype == ds.y_test.dtype == torch.int64
    assert ds.feature_shape == tuple(ds.x_test.shape[1:])
    assert len(ds.x_train) == len(ds.y_train) and len(ds.x_test) == len(ds.y_test)
    labels = torch.cat([ds.y_train, ds.y_test])
    assert labels.min() >= 0 and labels.max() < ds.num_classes
    assert torch.isfinite(ds.x_train).all() and torch.isfinite(ds.x_test).all()


@pytest.mark.parametrize(
    ("spec", "feature_shape", "n_train", "n_test", "num_classes"),
    [
        ("digits", (1, 8, 8), 1438, 359, 10),
        ("synthetic", (64,), 16000, 4000, 10),
        ("synthetic:50:3:4", (3,), 40, 10, 4),
    ],
)
def test_shapes_dtypes_and_classes(
    spec: str, feature_shape: tuple[int, ...], n_train: int, n_test: int, num_classes: int
) -> None:
    ds = load_dataset(spec, seed=3)
    _check_well_formed(ds)
    assert ds.name == spec
    assert ds.feature_shape == feature_shape
    assert (len(ds.y_train), len(ds.y_test), ds.num_classes) == (n_train, n_test, num_classes)
    assert set(ds.y_train.tolist()) == set(range(num_classes))


def test_digits_scaled_to_unit_interval() -> None:
    ds = load_dataset("digits")
    assert ds.x_train.min() == 0.0 and ds.x_train.max() == 1.0


def test_digits_split_is_fixed_by_seed() -> None:
    a, b, c = (
        load_dataset("digits", seed=1),
        load_dataset("digits", seed=1),
        load_dataset("digits", seed=2),
    )
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)
    # Same 1797 images either way, only partitioned differently.
    assert torch.equal(
        torch.cat([a.x_train, a.x_test]).sum(0), torch.cat([c.x_train, c.x_test]).sum(0)
    )


def test_mnist1d_shapes_generated_once_seed_ignored_global_rngs_untouched() -> None:
    datasets._mnist1d_arrays.cache_clear()
    np.random.seed(7)
    random.seed(7)
    expected = (np.random.rand(), random.random())
    np.random.seed(7)
    random.seed(7)
    a = load_dataset("mnist1d", seed=0)
    assert (np.random.rand(), random.random()) == expected  # make_dataset reseeds both
    _check_well_formed(a)
    assert (a.feature_shape, a.num_classes, len(a.y_train), len(a.y_test)) == (
        (1, 40),
        10,
        4000,
        1000,
    )
    b = load_dataset("mnist1d", seed=99)
    assert datasets._mnist1d_arrays.cache_info().hits >= 1
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert abs(a.x_train.mean().item()) < 1e-4 and abs(a.x_train.std().item() - 1) < 1e-3
    a.x_train.zero_()  # callers own their tensors: the cache must not change
    assert torch.equal(load_dataset("mnist1d").x_train, b.x_train)


def test_synthetic_is_learnable_but_not_trivial() -> None:
    ds = load_dataset("synthetic", seed=0)
    means = torch.stack([ds.x_train[ds.y_train == k].mean(0) for k in range(ds.num_classes)])
    accuracy = (torch.cdist(ds.x_test, means).argmin(1) == ds.y_test).float().mean().item()
    assert 0.8 < accuracy < 0.97  # nearest class mean, a linear classifier


def test_synthetic_seed_changes_the_data() -> None:
    a, b = load_dataset("synthetic:100:5:3", seed=0), load_dataset("synthetic:100:5:3", seed=1)
    assert torch.equal(a.x_train, load_dataset("synthetic:100:5:3", seed=0).x_train)
    assert not torch.equal(a.x_train, b.x_train)


@given(n=st.integers(2, 60), d=st.integers(1, 6), c=st.integers(2, 5), seed=st.integers(0, 99))
def test_synthetic_any_size_is_well_formed(n: int, d: int, c: int, seed: int) -> None:
    ds = load_dataset(f"synthetic:{n}:{d}:{c}", seed=seed)
    _check_well_formed(ds)
    assert ds.feature_shape == (d,) and len(ds.y_train) + len(ds.y_test) == n
    assert len(ds.y_train) >= 1 and len(ds.y_test) >= 1


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("mnist", "valid: digits, mnist1d, synthetic"),
        ("", "unknown dataset spec ''"),
        ("digits:3", "takes no arguments"),
        ("synthetic:10:3", "synthetic:N:D:C"),
        ("synthetic:10:x:3", "D='x'"),
        ("synthetic:1:3:2", "N=1"),
        ("synthetic:10:3:1", "C=1"),
        ("synthetic:10:0:2", "D=0"),
    ],
)
def test_bad_specs_are_named(spec: str, fragment: str) -> None:
    with pytest.raises(DatasetError, match=fragment):
        load_dataset(spec)


def test_npz_round_trip_with_seeded_split(tmp_path: Path) -> None:
    x = np.arange(30 * 2, dtype=np.int16).reshape(30, 2)
    y = np.arange(30) % 4
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=y)
    ds = load_dataset(f"npz:{path}", seed=5)
    _check_well_formed(ds)
    assert (ds.feature_shape, ds.num_classes, len(ds.y_train), len(ds.y_test)) == ((2,), 4, 24, 6)
    rows = torch.cat([ds.x_train, ds.x_test])
    assert sorted(rows[:, 0].tolist()) == x[:, 0].astype(float).tolist()
    assert torch.equal(rows[:, 0].long() // 2 % 4, torch.cat([ds.y_train, ds.y_test]))
    assert torch.equal(ds.y_train, load_dataset(f"npz:{path}", seed=5).y_train)


def test_npz_with_own_test_split(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    x, x_test = np.random.default_rng(0).random((2, 5, 1, 3))
    np.savez(path, x=x, y=np.array([0, 1, 0, 1, 0]), x_test=x_test, y_test=np.array([2] * 5))
    ds = load_dataset(f"npz:{path}")
    assert torch.equal(ds.x_train, torch.from_numpy(x.astype(np.float32)))
    assert ds.y_test.tolist() == [2] * 5 and ds.num_classes == 3


def _write(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


_X, _Y = np.zeros((4, 2)), np.array([0, 1, 1, 0])


@pytest.mark.parametrize(
    ("arrays", "fragment"),
    [
        ({"y": _Y}, "missing field 'x'"),
        ({"x": _X}, "missing field 'y'"),
        ({"x": _X, "y": _Y[:3]}, "field 'y' shape"),
        ({"x": _X, "y": _Y.astype(float)}, "field 'y' dtype float64"),
        ({"x": _X, "y": _Y - 1}, "field 'y' has negative label -1"),
        ({"x": np.array([[0.0], [np.nan]]), "y": _Y[:2]}, "field 'x' has non-finite"),
        ({"x": np.full((4, 1), 1e300), "y": _Y}, "field 'x' has non-finite"),
        ({"x": _X.astype(object), "y": _Y}, "field 'x' is unreadable.*[Oo]bject"),
        ({"x": _X.astype(str), "y": _Y}, "field 'x' dtype <U32 is not numeric"),
        ({"x": _X[:1], "y": _Y[:1]}, "field 'x' shape"),
        ({"x": _X[:, 0], "y": _Y}, "field 'x' shape"),
        ({"x": _X, "y": _Y, "x_test": _X}, "x_test and y_test must be given together"),
        ({"x": _X, "y": _Y, "x_test": _X[:, :1], "y_test": _Y}, "x_test shape"),
        ({"x": _X, "y": _Y, "x_test": _X, "y_test": -_Y - 1}, "field 'y_test' has negative"),
    ],
)
def test_npz_field_errors_name_file_and_field(
    tmp_path: Path, arrays: dict[str, np.ndarray], fragment: str
) -> None:
    path = _write(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DatasetError, match=fragment) as info:
        load_dataset(f"npz:{path}")
    assert str(path) in str(info.value)


def test_npz_file_errors_name_the_file(tmp_path: Path) -> None:
    text, npy = tmp_path / "notes.npz", tmp_path / "single.npy"
    text.write_text("not an archive")
    np.save(npy, _X)
    cases = [(tmp_path / "absent.npz", "not found"), (text, "not a readable"), (npy, "not .npz")]
    for path, fragment in cases:
        with pytest.raises(DatasetError, match=fragment) as info:
            load_dataset(f"npz:{path}")
        assert str(path) in str(info.value)
    with pytest.raises(DatasetError, match="not found"):
        load_dataset("npz:")
