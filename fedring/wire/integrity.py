"""Content digests for frames.

Bodies are content-addressed with sha256 (as Flower does for arrays) and re-checked
on arrival. A keyed job's frames carry no digest of their own: their seal's tag
(`fedring.wire.seal`) authenticates header and body together.
"""

from __future__ import annotations

import hashlib

DIGEST_BYTES = 32


def sha256(data: bytes | bytearray | memoryview) -> bytes:
    """Return the 32-byte sha256 digest of `data`."""
    return hashlib.sha256(data).digest()
