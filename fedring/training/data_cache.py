"""Generated datasets kept on disk, so each process does not make them again.

MNIST-1D is generated, not shipped: importing its package (with SciPy and matplotlib)
and generating the paper's 5,000 samples cost every agent and coordinator process about
3.6 s of CPU at start on a 2-core AMD EPYC, and several times that on a Raspberry Pi.
The first process keeps the arrays in one ``.npz`` file; later ones read it in
milliseconds.

- **Where:** ``$FEDRING_CACHE_DIR``, else ``$XDG_CACHE_HOME/fedring``, else
  ``~/.cache/fedring``. ``FEDRING_CACHE_DIR=off`` keeps nothing.
- **Which:** the file's name holds a key of the versions of the packages that generated
  it and of the caller's own recipe, so an upgrade or a changed recipe makes a new file
  rather than reading old data.
- **Trust:** read with ``allow_pickle=False``, and only used if its arrays match the
  SHA-256 digest stored beside them and pass the caller's check (names, dtypes,
  shapes, ranges). Anything else (a truncated write, another program's file, a
  changed array) is logged, generated again and replaced. The digest finds damage,
  not a forgery: whoever can write the directory chooses the training data, so keep it
  the agent's own (the default, or the unit's ``/var/lib/fedring/cache``), never a
  shared one. A file is written under a temporary name and renamed into place, so
  processes starting together never read half a file.
- **Nothing lost:** a directory that cannot be written to leaves the dataset generated
  in memory, as before, with a warning. A writer killed mid-write leaves its temporary
  file; the next write of the same name removes those older than `STALE_TMP_S` (a
  younger one may be another process's, still writing).

    >>> import os, tempfile
    >>> os.environ["FEDRING_CACHE_DIR"] = tempfile.mkdtemp()
    >>> make = lambda: {"x": np.arange(3.0)}
    >>> cached("demo", "v1", make)["x"].tolist(), (cache_dir() / "demo-v1.npz").exists()
    ([0.0, 1.0, 2.0], True)
    >>> del os.environ["FEDRING_CACHE_DIR"]
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
_DIGEST = "sha256"  # the stored array holding the digest of the others
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
Arrays = dict[str, np.ndarray]
STALE_TMP_S = 600.0  # a temporary file this old is a killed writer's: generating takes seconds


def cache_dir() -> Path | None:
    """Where generated datasets are kept (None: ``FEDRING_CACHE_DIR=off``)."""
    chosen = os.environ.get("FEDRING_CACHE_DIR")
    if chosen is not None:
        return None if chosen.strip().lower() in ("off", "") else Path(chosen)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "fedring"


def digest(arrays: Arrays) -> np.ndarray:
    """SHA-256 over the arrays' names, dtypes, shapes and bytes, as 32 uint8."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return np.frombuffer(h.digest(), dtype=np.uint8)


def cached(name: str, key: str, make: Callable[[], Arrays],
           check: Callable[[Arrays], bool] = lambda arrays: True) -> Arrays:  # fmt: skip
    """`make()`'s arrays, from ``<cache_dir>/<name>-<key>.npz`` where a copy kept there
    matches its digest and passes `check`, else made now and kept for the next process."""
    folder = cache_dir()
    if folder is None:
        return make()
    path = folder / f"{_SAFE.sub('_', name)}-{_SAFE.sub('_', key)}.npz"
    found = _read(path)
    if found is not None and check(found):
        return found
    if found is not None:
        log.warning("dataset cache %s holds other arrays than expected: generating it again",
                    path)  # fmt: skip
    arrays = make()
    _write(path, arrays)
    return arrays


def _read(path: Path) -> Arrays | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        log.warning("dataset cache %s cannot be read back (%s): generating it again", path, exc)
        return None
    stored = arrays.pop(_DIGEST, None)
    if stored is None or not np.array_equal(stored, digest(arrays)):
        log.warning("dataset cache %s fails its digest: generating it again", path)
        return None
    return arrays


def _write(path: Path, arrays: Arrays) -> None:
    if _DIGEST in arrays:
        raise ValueError(f"an array may not be named {_DIGEST!r}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _sweep(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **{**arrays, _DIGEST: digest(arrays)})  # type: ignore[arg-type]
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.warning("dataset cache %s cannot be written (%s): generated in memory only",
                    path, exc)  # fmt: skip


def _sweep(path: Path) -> None:
    """Remove the temporary files that killed writers of `path` left (older than
    `STALE_TMP_S`). One that vanishes meanwhile was another process's to remove; one
    that cannot be removed stays, and the write goes on."""
    now = time.time()
    for tmp in path.parent.glob(f"{glob.escape(path.stem)}*.tmp"):
        try:
            if now - tmp.stat().st_mtime > STALE_TMP_S:
                tmp.unlink()
                log.info("dataset cache: removed %s, left by a killed writer", tmp)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("dataset cache: cannot remove %s (%s)", tmp, exc)
