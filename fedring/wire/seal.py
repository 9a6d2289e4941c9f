"""Sealed bodies: a keyed job's frames are encrypted and authenticated (version 3).

Threat model. The broker's admin and the job's coordinator (who makes the job key
and hands it to each member over the member's own inbox, in the unsigned
enrolment manifest) are trusted for the job; every other broker user is not. The
broker's ACL cannot name a job's members, so any fleet user may read every job's
broadcast topic (`jobs/{job}/all/{src}`), and gradients leak training data
(gradient inversion). So every frame of a keyed job is sealed: a reader outside
the job sees the clear header (sizes, counters, codec, shapes, the 4-byte route)
and learns nothing of the body (gradients, model parameters, metrics, manifests).
The ACL still decides who may write where; the seal decides who can read.

The cipher is AES-256-GCM-SIV (RFC 8452, `cryptography`'s `AESGCMSIV`) under a key
derived from the job key with HKDF-SHA256 and a label of its own. Its nonce is
sha256(associated data)[:12]: nothing extra travels, and the associated data (the
route's job, sender and receiver names plus the whole clear header, seq included)
differs between frames. GCM-SIV is chosen over ChaCha20-Poly1305 or AES-GCM because
a nonce may repeat: a `PeerChannel` counts seq from 0 again after a restart, and
every member and the coordinator seal under the same job key. A repeated nonce
costs GCM or ChaCha20-Poly1305 both secrecy and integrity; GCM-SIV then reveals
only that two frames with the same header carry the same body. The 16-byte tag
replaces the HMAC the frames carried before (one check, not two).

Cost: 16 bytes a frame (the tag, after the ciphertext), against the 12-byte
truncated HMAC of a version-2 compact frame: +4 bytes. A control frame drops its
32-byte sha256 and 32-byte HMAC fields for the tag: about 60 bytes fewer.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

from cryptography.exceptions import InvalidTag, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCMSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedring.wire.errors import FrameError, FrameReason

SEALED_VERSION = 3  # a sealed frame: compact (first byte 3) or a msgpack map with v = 3
SEAL_TAG_BYTES = 16
NONCE_BYTES = 12
# HKDF's info: a key for anything else drawn from the job key needs a label of its own.
_LABEL = b"fedring/v1 frame seal: AES-256-GCM-SIV"


@lru_cache(maxsize=64)
def _aead(key: bytes) -> AESGCMSIV:
    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_LABEL).derive(key)
    try:
        return AESGCMSIV(derived)
    except UnsupportedAlgorithm as exc:  # an OS build of cryptography on OpenSSL < 3.2
        raise RuntimeError(
            "this cryptography build has no AES-GCM-SIV (it needs OpenSSL >= 3.2): "
            "install cryptography's own wheel, pip install 'cryptography>=42'"
        ) from exc


def _nonce(ad: bytes) -> bytes:
    return hashlib.sha256(ad).digest()[:NONCE_BYTES]


def seal(key: bytes, ad: bytes, body: bytes | memoryview) -> bytes:
    """`body` encrypted under `key`, then its 16-byte tag over `ad` and the body."""
    return _aead(key).encrypt(_nonce(ad), body, ad)


def open_sealed(key: bytes, ad: bytes, sealed: bytes | memoryview, what: str) -> bytes:
    """The body inside `sealed`; a `FrameError` (``bad_mac``) if it does not open.

    Callers bound `sealed` (the frame size) before this; `what` names the frame.
    """
    if len(sealed) < SEAL_TAG_BYTES:
        raise FrameError(FrameReason.TRUNCATED, f"{what}: sealed body shorter than its tag")
    try:
        return _aead(key).decrypt(_nonce(ad), sealed, ad)
    except InvalidTag:
        raise FrameError(
            FrameReason.BAD_MAC, f"{what} does not open: another key, or altered on the way"
        ) from None
