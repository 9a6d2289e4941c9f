"""The dataset cache: a sound file is read back instead of generating again; anything
else is logged, generated again and replaced; an unwritable place loses nothing. And
the two loaders that use what it saves: digits without importing scikit-learn, MNIST-1D
from the cache, each the same arrays as before."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fedring.training import data_cache, datasets
from fedring.training.data_cache import cached, digest


def _arrays() -> dict[str, np.ndarray]:
    return {"x": np.arange(12.0).reshape(3, 4), "y": np.array([0, 1, 2])}


class _Maker:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> dict[str, np.ndarray]:
        self.calls += 1
        return _arrays()


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FEDRING_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def test_the_second_process_reads_what_the_first_generated(folder: Path) -> None:
    make = _Maker()
    first = cached("toy", "v1", make)
    assert make.calls == 1 and [p.name for p in folder.iterdir()] == ["toy-v1.npz"]
    again = cached("toy", "v1", make)
    assert make.calls == 1 and _same(again, first) and _same(again, _arrays())
    cached("toy", "v2", make)  # another key (other package versions): made again
    assert make.calls == 2 and len(list(folder.iterdir())) == 2


def _broken_files(path: Path) -> dict[str, bytes]:
    good = path.read_bytes()
    swapped = path.with_name("swapped.npz")
    other = {**_arrays(), "x": np.zeros((3, 4))}
    np.savez(swapped, **other, sha256=digest(_arrays()))  # the digest of other arrays
    pickled = path.with_name("pickled.npz")
    np.savez(pickled, x=np.array([{"a": 1}], dtype=object), sha256=np.zeros(32, np.uint8))
    return {"truncated": good[: len(good) // 2], "not a zip": b"hello", "empty": b"",
            "other arrays": swapped.read_bytes(), "an object array": pickled.read_bytes(),
            "no digest": _npz(_arrays(), path)}  # fmt: skip


def _npz(arrays: dict[str, np.ndarray], near: Path) -> bytes:
    path = near.with_name("plain.npz")
    np.savez(path, **arrays)
    return path.read_bytes()


def test_a_file_that_fails_its_digest_is_generated_again_and_replaced(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make = _Maker()
    cached("toy", "v1", make)
    path = folder / "toy-v1.npz"
    broken = _broken_files(path)
    for what, data in broken.items():
        path.write_bytes(data)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=data_cache.__name__):
            got = cached("toy", "v1", make)
        assert _same(got, _arrays()), what
        assert "generating it again" in caplog.text, what
        assert cached("toy", "v1", lambda: pytest.fail("replaced: read back")), what
    assert make.calls == 1 + len(broken)


def test_a_sound_file_the_caller_does_not_expect_is_generated_again(folder: Path) -> None:
    cached("toy", "v1", lambda: {"x": np.ones(5)})  # right digest, wrong arrays
    make = _Maker()
    got = cached("toy", "v1", make, check=lambda a: sorted(a) == ["x", "y"])
    assert make.calls == 1 and _same(got, _arrays())
    assert _same(cached("toy", "v1", make, check=lambda a: sorted(a) == ["x", "y"]), got)
    assert make.calls == 1


def test_an_unwritable_place_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("FEDRING_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    make = _Maker()
    with caplog.at_level(logging.WARNING, logger=data_cache.__name__):
        assert _same(cached("toy", "v1", make), _arrays())
    assert "cannot be written" in caplog.text and make.calls == 1


def test_off_keeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDRING_CACHE_DIR", "off")
    monkeypatch.chdir(tmp_path)
    make = _Maker()
    cached("toy", "v1", make)
    cached("toy", "v1", make)
    assert make.calls == 2 and list(tmp_path.iterdir()) == []


def test_the_place_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FEDRING_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert data_cache.cache_dir() == tmp_path / "fedring"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert data_cache.cache_dir() == Path.home() / ".cache" / "fedring"


def test_a_digest_covers_names_dtypes_shapes_and_values() -> None:
    base = digest(_arrays())
    x = np.arange(12.0).reshape(3, 4)
    for changed in ({"x": x.reshape(4, 3)}, {"x": x.astype(np.int64)}, {"x": x + 1e-12},
                    {"z": x}):  # fmt: skip
        arrays = {"y": _arrays()["y"], **changed}
        assert not np.array_equal(digest(arrays), base), list(changed)
    assert np.array_equal(digest(_arrays()), base) and base.dtype == np.uint8 and len(base) == 32


def test_mnist1d_read_back_is_what_was_generated(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets._mnist1d_arrays.cache_clear()
    try:
        generated = datasets._mnist1d_arrays()
        assert len(list(folder.glob("mnist1d-r1-mnist1d*-numpy*-scipy*.npz"))) == 1
        datasets._mnist1d_arrays.cache_clear()
        monkeypatch.setattr(datasets, "_mnist1d_generated", lambda: pytest.fail("generated"))
        read = datasets._mnist1d_arrays()
    finally:
        datasets._mnist1d_arrays.cache_clear()
    for a, b in zip(generated, read, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b) and not b.flags.writeable


def test_the_digits_table_is_scikit_learns_and_its_loader_the_fallback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    table = datasets._digits_table("digits")
    assert table.shape == (1797, 65)
    assert np.array_equal(table[:, :-1].reshape(-1, 8, 8), bunch.images)
    assert np.array_equal(table[:, -1].astype(int), bunch.target)
    monkeypatch.setattr(datasets, "_DIGITS_CSV", ("datasets", "data", "missing.csv.gz"))
    assert np.array_equal(datasets._digits_table("digits"), table)


def test_a_process_loads_digits_and_cached_mnist1d_without_their_packages(folder: Path) -> None:
    datasets._mnist1d_arrays.cache_clear()
    try:
        datasets._mnist1d_arrays()  # fills the cache the child reads
    finally:
        datasets._mnist1d_arrays.cache_clear()
    code = ("import sys, json\n"
            "from fedring.training.datasets import load_dataset\n"
            "load_dataset('digits'); load_dataset('mnist1d')\n"
            "print(json.dumps(sorted(m for m in ('sklearn', 'scipy', 'mnist1d', 'matplotlib')"
            " if m in sys.modules)))\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_no_pickle_is_read(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "toy-v1.npz").write_bytes(pickle.dumps({"x": np.ones(3)}))
    assert _same(cached("toy", "v1", _Maker()), _arrays())


def test_a_new_mnist1d_recipe_does_not_read_the_old_arrays(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets._mnist1d_arrays.cache_clear()
    try:
        old = dict(zip(datasets._MNIST1D_FIELDS, datasets._mnist1d_arrays(), strict=True))
        made = []
        changed = {**old, "x_train": old["x_train"] * 2.0}  # as if standardized otherwise
        monkeypatch.setattr(datasets, "_mnist1d_generated", lambda: made.append(1) or changed)
        monkeypatch.setattr(datasets, "_MNIST1D_RECIPE", 2)
        datasets._mnist1d_arrays.cache_clear()
        new = datasets._mnist1d_arrays()
    finally:
        datasets._mnist1d_arrays.cache_clear()
    assert made == [1] and np.array_equal(new[0], changed["x_train"])
    assert len(list(folder.glob("mnist1d-r*.npz"))) == 2


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(folder: Path) -> None:
    """A writer killed mid-write leaves ``toy-v1<random>.tmp``; the next write of that
    name removes it once it is older than `STALE_TMP_S`, and leaves a young one (another
    process's, still writing) and other names' alone."""
    stale, young = folder / "toy-v1abc.tmp", folder / "toy-v1def.tmp"
    other = folder / "toy-v2abc.tmp"
    folder.mkdir(parents=True, exist_ok=True)
    for tmp in (stale, young, other):
        tmp.write_bytes(b"half a file")
    old = time.time() - data_cache.STALE_TMP_S - 60
    for tmp in (stale, other):
        os.utime(tmp, (old, old))
    assert _same(cached("toy", "v1", _Maker()), _arrays())
    assert not stale.exists() and young.exists() and other.exists()
    assert sorted(p.name for p in folder.glob("toy-v1*")) == ["toy-v1.npz", "toy-v1def.tmp"]


def test_a_temporary_file_that_cannot_be_removed_does_not_stop_the_write(
    folder: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    stale = folder / "toy-v1abc.tmp"
    stale.write_bytes(b"another user's")
    old = time.time() - data_cache.STALE_TMP_S - 60
    os.utime(stale, (old, old))
    unlink = Path.unlink

    def refuse(self: Path, missing_ok: bool = False) -> None:
        if self == stale:
            raise PermissionError(13, "Permission denied", str(self))
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    with caplog.at_level(logging.WARNING, logger=data_cache.__name__):
        assert _same(cached("toy", "v1", _Maker()), _arrays())
    assert "cannot remove" in caplog.text and stale.exists()
    assert (folder / "toy-v1.npz").exists()  # written all the same
