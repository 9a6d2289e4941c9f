"""Content digests and message authentication for frames.

Bodies are content-addressed with sha256 (as Flower does for arrays) and re-checked
on arrival. When a job has a key, every frame also carries an HMAC-SHA256 over its
header; the header includes the body's sha256, so the MAC binds the body too
without hashing it twice.
"""

from __future__ import annotations

import hashlib
import hmac

DIGEST_BYTES = 32


def sha256(data: bytes | bytearray | memoryview) -> bytes:
    """Return the 32-byte sha256 digest of `data`."""
    return hashlib.sha256(data).digest()


def mac(key: bytes, message: bytes) -> bytes:
    """Return HMAC-SHA256 of `message` under `key`."""
    return hmac.new(key, message, hashlib.sha256).digest()


def mac_ok(key: bytes, message: bytes, tag: bytes) -> bool:
    """Check a tag in constant time."""
    return hmac.compare_digest(mac(key, message), tag)
