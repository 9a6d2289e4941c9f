"""Datasets by spec string: everything here is bundled or generated locally, never downloaded.

Specs (see `load_dataset`):

- ``digits``: scikit-learn's bundled 8x8 digits, x ``[n, 1, 8, 8]`` in [0, 1].
- ``mnist1d``: MNIST-1D generated in-process with its paper settings, x ``[n, 1, 40]``.
- ``synthetic`` or ``synthetic:N:D:C``: a seeded Gaussian mixture, x ``[n, D]``.
- ``npz:PATH``: arrays ``x``, ``y`` (and optionally ``x_test``, ``y_test``) from a file.

    >>> ds = load_dataset("synthetic:100:4:3", seed=1)
    >>> ds.feature_shape, ds.num_classes, len(ds.y_train), len(ds.y_test)
    ((4,), 3, 80, 20)
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedring.extras import MissingExtra, require
from fedring.training import data_cache

TEST_FRACTION = 0.2  # held-out share wherever the source has no split of its own
SYNTHETIC_DEFAULTS = (20000, 64, 10)  # N samples, D features, C classes
_Pair = tuple[np.ndarray, np.ndarray]  # (x, y)
_DIGITS_CSV = ("datasets", "data", "digits.csv.gz")  # in the sklearn package
_MNIST1D_FIELDS = ("x_train", "y_train", "x_test", "y_test")
# the cache key's version of `_mnist1d_generated`'s recipe (the standardization, the
# shapes): raise it with any change there, or processes would read the old arrays
_MNIST1D_RECIPE = 1
_SYNTHETIC_SEPARATION = 3.0  # mean spread * sqrt(D): nearest-mean accuracy ~90% at the defaults


class DatasetError(ValueError):
    """A dataset spec or file that cannot be loaded; the message names the field and value."""


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no single truth value
class Dataset:
    """A train/test pair of float32 features and int64 labels 0..num_classes-1, or, for a
    regression task, float32 targets with ``num_classes = 0``."""

    name: str  # the spec string it was loaded from, e.g. "digits"
    x_train: torch.Tensor  # float32 [n, *feature_shape]
    y_train: torch.Tensor  # int64 [n]
    x_test: torch.Tensor  # float32 [m, *feature_shape]
    y_test: torch.Tensor  # int64 [m]
    num_classes: int  # 0: regression targets

    def __post_init__(self) -> None:
        label = torch.int64 if self.num_classes else torch.float32
        for part in ("train", "test"):
            x, y = getattr(self, f"x_{part}"), getattr(self, f"y_{part}")
            if x.dtype != torch.float32 or y.dtype != label:
                raise DatasetError(
                    f"{self.name}: {part} dtypes {x.dtype}/{y.dtype} != float32/{label} "
                    f"(num_classes {self.num_classes})"
                )
            if y.ndim != 1 or x.ndim < 1 or len(x) != len(y):
                raise DatasetError(
                    f"{self.name}: x_{part} {tuple(x.shape)} vs y_{part} {tuple(y.shape)}"
                )
        if self.x_test.shape[1:] != self.x_train.shape[1:]:
            raise DatasetError(
                f"{self.name}: x_test features {tuple(self.x_test.shape[1:])} != train"
            )

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """Shape of one sample, ``x_train.shape[1:]``."""
        return tuple(self.x_train.shape[1:])


def load_dataset(spec: str, seed: int = 0) -> Dataset:
    """Load a dataset by spec string.

    Parameters
    ----------
    spec : str
        ``digits``, ``mnist1d``, ``synthetic``, ``synthetic:N:D:C`` or ``npz:PATH``.
    seed : int
        Fixes the train/test split (digits, synthetic, npz without ``x_test``) and the
        synthetic data itself. MNIST-1D ignores it: it is always the paper's data
        (generation seed 42) with its own 4000/1000 split, so results stay comparable.

    Returns
    -------
    Dataset
        With ``name == spec``.

    Raises
    ------
    DatasetError
        Unknown spec, malformed arguments, or an npz file that fails validation.
    """
    kind, _, arg = spec.partition(":")
    loader = _LOADERS.get(kind)
    if loader is None:
        raise DatasetError(f"unknown dataset spec {spec!r}; valid: {', '.join(_VALID_SPECS)}")
    return loader(spec, arg, seed)


def _assemble(name: str, x: np.ndarray, y: np.ndarray, seed: int, num_classes: int) -> Dataset:
    """Seeded train/test split by permutation; both sides non-empty for n >= 2."""
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = min(len(y) - 1, max(1, round(len(y) * TEST_FRACTION)))
    train, test = perm[n_test:], perm[:n_test]
    return _build(name, (x[train], y[train]), (x[test], y[test]), num_classes)


def _build(name: str, train: _Pair, test: _Pair, num_classes: int) -> Dataset:
    # torch.tensor copies, so cached or caller-owned arrays can never be mutated through us.
    xs = [torch.tensor(np.asarray(x, dtype=np.float32)) for x, _ in (train, test)]
    ys = [torch.tensor(np.asarray(y, dtype=np.int64)) for _, y in (train, test)]
    return Dataset(name, xs[0], ys[0], xs[1], ys[1], num_classes)


def _extra(module: str, spec: str) -> Any:
    """An optional dataset package, or a `DatasetError` naming the extra to install."""
    try:
        return require(module, f"dataset {spec!r}")
    except MissingExtra as exc:
        raise DatasetError(str(exc)) from None


def _no_arg(spec: str, arg: str) -> None:
    if arg:
        raise DatasetError(f"dataset spec {spec!r} takes no arguments, got {arg!r}")


def _load_digits(spec: str, arg: str, seed: int) -> Dataset:
    _no_arg(spec, arg)
    table = _digits_table(spec)
    x = (table[:, :-1] / 16.0).reshape(-1, 1, 8, 8)
    return _assemble(spec, x, table[:, -1].astype(int), seed, num_classes=10)


def _digits_table(spec: str) -> np.ndarray:
    """scikit-learn's bundled digits, ``[1797, 65]`` (64 pixels 0..16, then the label):
    its CSV read directly, as `sklearn.datasets.load_digits` reads it, without importing
    scikit-learn, which (with SciPy) cost each agent process 1.4 s of CPU at start. Its
    loader is the fallback where the file is not where this scikit-learn keeps it."""
    found = importlib.util.find_spec("sklearn")  # finds the package, imports nothing
    if found is not None and found.submodule_search_locations:
        path = Path(next(iter(found.submodule_search_locations)), *_DIGITS_CSV)
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                table = np.loadtxt(f, delimiter=",")
            if table.ndim == 2 and table.shape[1] == 65:
                return table
        except (OSError, ValueError, EOFError):
            pass
    bunch = _extra("sklearn.datasets", spec).load_digits()  # bundled, no download
    return np.concatenate([bunch.data, bunch.target[:, None]], axis=1)


@functools.lru_cache(maxsize=1)
def _mnist1d_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """MNIST-1D standardized by the train mean/std: generated once per machine (3.6 s
    of CPU with its imports), then read from the dataset cache (`data_cache`), once per
    process."""
    try:
        key = "-".join([f"r{_MNIST1D_RECIPE}",
                        *(f"{p}{metadata.version(p)}" for p in ("mnist1d", "numpy", "scipy"))])
    except metadata.PackageNotFoundError:  # no versions to key a file by (or no mnist1d:
        arrays = _mnist1d_generated()  # this raises the error naming the extra)
    else:
        arrays = data_cache.cached("mnist1d", key, _mnist1d_generated, _mnist1d_sound)
    out = tuple(arrays[k] for k in _MNIST1D_FIELDS)
    for a in out:
        a.setflags(write=False)
    return out  # type: ignore[return-value]


def _mnist1d_sound(arrays: data_cache.Arrays) -> bool:
    """The generated shapes and dtypes, labels 0..9: what a cached file must hold."""
    if sorted(arrays) != sorted(_MNIST1D_FIELDS):
        return False
    x, y, xt, yt = (arrays[k] for k in _MNIST1D_FIELDS)
    return (x.shape == (4000, 1, 40) and xt.shape == (1000, 1, 40) and y.shape == (4000,)
            and yt.shape == (1000,) and x.dtype == xt.dtype == np.float64
            and y.dtype == yt.dtype == np.int64 and bool(np.isfinite(x).all())
            and bool(np.isfinite(xt).all()) and min(y.min(), yt.min()) >= 0
            and max(y.max(), yt.max()) <= 9)  # fmt: skip


def _mnist1d_generated() -> data_cache.Arrays:
    """Generate MNIST-1D with its paper settings (about 2.3 s of CPU)."""
    data = _extra("mnist1d.data", "mnist1d")  # never its get_dataset(): it downloads

    # make_dataset reseeds the global `random` and `np.random` generators; restore them.
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        raw = data.make_dataset(data.get_dataset_args())
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    mean, std = raw["x"].mean(), raw["x"].std()
    x_train, x_test = ((raw[k] - mean) / std for k in ("x", "x_test"))
    arrays = (x_train[:, None, :], raw["y"], x_test[:, None, :], raw["y_test"])
    return dict(zip(_MNIST1D_FIELDS, arrays, strict=True))


def _load_mnist1d(spec: str, arg: str, seed: int) -> Dataset:
    _no_arg(spec, arg)
    x_train, y_train, x_test, y_test = _mnist1d_arrays()
    return _build(spec, (x_train, y_train), (x_test, y_test), num_classes=10)


def _parse_synthetic(spec: str, arg: str) -> tuple[int, int, int]:
    if not arg:
        return SYNTHETIC_DEFAULTS
    parts = arg.split(":")
    if len(parts) != 3:
        raise DatasetError(f"dataset spec {spec!r}: expected synthetic:N:D:C, got {arg!r}")
    values = []
    for label, text, low in zip(("N", "D", "C"), parts, (2, 1, 2), strict=True):
        try:
            value = int(text)
        except ValueError:
            raise DatasetError(
                f"dataset spec {spec!r}: {label}={text!r} is not an integer"
            ) from None
        if value < low:
            raise DatasetError(f"dataset spec {spec!r}: {label}={value} must be >= {low}")
        values.append(value)
    return values[0], values[1], values[2]


def _load_synthetic(spec: str, arg: str, seed: int) -> Dataset:
    n, d, c = _parse_synthetic(spec, arg)
    rng = np.random.default_rng(seed)
    means = rng.standard_normal((c, d)) * (_SYNTHETIC_SEPARATION / math.sqrt(d))
    y = rng.permutation(np.arange(n) % c)  # balanced classes in random order
    x = means[y] + rng.standard_normal((n, d))
    return _assemble(spec, x, y, seed, num_classes=c)


def _load_npz(spec: str, arg: str, seed: int) -> Dataset:
    path = Path(arg)
    if not arg or not path.is_file():
        raise DatasetError(f"npz file {arg!r}: not found")
    try:
        # allow_pickle=False: unpickling an object array runs arbitrary code from the file.
        loaded = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise DatasetError(f"npz file {arg!r}: not a readable .npz archive ({err})") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise DatasetError(f"npz file {arg!r}: holds a single {type(loaded).__name__}, not .npz")
    with loaded as npz:
        arrays = {k: _npz_field(path, npz, k) for k in ("x", "y", "x_test", "y_test")}
    x, y = _checked_pair(path, arrays, "x", "y")
    if (arrays["x_test"] is None) != (arrays["y_test"] is None):
        raise DatasetError(f"npz file {arg!r}: x_test and y_test must be given together")
    num_classes = int(y.max()) + 1
    if arrays["x_test"] is None:
        return _assemble(spec, x, y, seed, num_classes)
    x_test, y_test = _checked_pair(path, arrays, "x_test", "y_test")
    if x_test.shape[1:] != x.shape[1:]:
        raise DatasetError(f"npz file {arg!r}: x_test shape {x_test.shape} vs x {x.shape}")
    return _build(spec, (x, y), (x_test, y_test), max(num_classes, int(y_test.max()) + 1))


def _npz_field(path: Path, npz: np.lib.npyio.NpzFile, key: str) -> np.ndarray | None:
    if key not in npz.files:
        return None
    try:
        return npz[key]
    except (ValueError, OSError, EOFError) as err:  # ValueError: object dtype without pickle
        raise DatasetError(f"npz file {str(path)!r}: field {key!r} is unreadable ({err})") from None


def _checked_pair(path: Path, arrays: dict[str, np.ndarray | None], xk: str, yk: str) -> _Pair:
    where = f"npz file {str(path)!r}"
    x, y = arrays[xk], arrays[yk]
    if x is None or y is None:
        raise DatasetError(f"{where}: missing field {xk if x is None else yk!r}")
    if x.dtype.kind not in "biuf":
        raise DatasetError(f"{where}: field {xk!r} dtype {x.dtype} is not numeric")
    min_n = 2 if xk == "x" else 1  # x must split into train and test
    if x.ndim < 2 or len(x) < min_n:
        raise DatasetError(
            f"{where}: field {xk!r} shape {x.shape} is not [n>={min_n}, features...]"
        )
    if y.dtype.kind not in "iu":
        raise DatasetError(f"{where}: field {yk!r} dtype {y.dtype} is not an integer type")
    if y.shape != (len(x),):
        raise DatasetError(f"{where}: field {yk!r} shape {y.shape} != ({len(x)},) from {xk!r}")
    if y.min() < 0:
        raise DatasetError(f"{where}: field {yk!r} has negative label {int(y.min())}")
    with np.errstate(over="ignore"):  # overflow to inf is reported just below
        x = x.astype(np.float32)
    if not np.isfinite(x).all():  # after the cast, so float64 values that overflow count too
        raise DatasetError(f"{where}: field {xk!r} has non-finite values (as float32)")
    return x, y


_LOADERS: dict[str, Callable[[str, str, int], Dataset]] = {
    "digits": _load_digits,
    "mnist1d": _load_mnist1d,
    "synthetic": _load_synthetic,
    "npz": _load_npz,
}
_VALID_SPECS = ("digits", "mnist1d", "synthetic", "synthetic:N:D:C", "npz:PATH")
