"""Control messages between agents and the coordinator: a JSON document plus bytes.

Enrolment, manifests, model transfers, acknowledgements, metrics and goodbyes
are ordinary frames (`wire.frame`) whose body is a small JSON document followed
by an optional blob (a model's float32 parameters); ``meta["doc"]`` says where the
document ends. Large bodies are split into parts like ring chunks.

Every control frame is sealed with the job key (`wire.seal`: encrypted and
authenticated; "signed" below) except the enrolment manifest, which hands the key
out over the member's own inbox: a receiver accepts an unsigned frame only of kind
``manifest``, and only from the coordinator's inbox level, which the broker's ACL
reserves to the coordinator.

    >>> a, b = ControlCodec("coordinator"), ControlCodec("a1")
    >>> [frame] = a.encode("manifest", "job1", "a1", {"epoch": 0}, sign=False)
    >>> b.decode("coordinator", frame).doc
    {'epoch': 0}
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from fedring.counters import Counters
from fedring.logs_limit import LogLimiter
from fedring.wire.chunks import Reassembler, SeenWindow, split_payload
from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.frame import Frame, FrameLimits, decode_frame, encode_frame
from fedring.wire.jsondoc import parse_document

log = logging.getLogger(__name__)
_KEY_HOLDER = "coordinator"  # `transport.topics.COORDINATOR`: only it sends unsigned


@dataclass(frozen=True)
class ControlMessage:
    kind: str
    job: str
    src: str
    round: int
    doc: dict[str, Any]
    blob: bytes
    signed: bool


class ControlCodec:
    """Encodes and checks one endpoint's control frames; counts every refusal."""

    def __init__(
        self,
        me: str,
        key: bytes | None = None,
        limits: FrameLimits | None = None,
        counters: Counters | None = None,
    ) -> None:
        self.me = me
        self.key = key
        self.limits = limits or FrameLimits()
        self.counters = counters or Counters()
        self._log = LogLimiter(log, f"control frames refused by {me}")
        # Microseconds since the epoch: a restarted sender keeps counting upwards,
        # so its new frames are never mistaken for repeats of its old ones.
        self._seq = itertools.count(time.time_ns() // 1000)
        self._seen = SeenWindow()
        self._parts = Reassembler(self.limits)

    def encode(
        self,
        kind: str,
        job: str,
        dst: str,
        doc: dict[str, Any],
        blob: bytes = b"",
        *,
        round: int = 0,
        sign: bool = True,
    ) -> list[bytes]:
        text = json.dumps(doc, separators=(",", ":")).encode()
        template = Frame(
            kind=kind, job=job, src=self.me, dst=dst, seq=0, round=round, meta={"doc": len(text)}
        )
        frames = split_payload(template, text + blob, next(self._seq), self.limits)
        for _ in frames[1:]:
            next(self._seq)
        key = self.key if sign else None
        return [encode_frame(f, key) for f in frames]

    def decode(self, sender: str, data: bytes) -> ControlMessage | None:
        """The message once complete; None while parts are missing, or if refused."""
        try:
            frame, signed = self._frame(data)
            if sender and frame.src != sender:
                raise FrameError(
                    FrameReason.UNEXPECTED, f"frame claims src {frame.src!r}, came from {sender!r}"
                )
            if frame.dst not in (self.me, "*"):
                raise FrameError(FrameReason.UNEXPECTED, f"frame for {frame.dst!r}")
            if not self._seen.first_time(frame.src, frame.seq):
                self.counters.add("duplicate")
                return None
            done = self._parts.add(frame)
            if done is None:
                return None
            head, body = done
            return _message(head, bytes(body), signed)
        except FrameError as exc:
            self.counters.add(f"frame_{exc.reason.value}")
            self._log.warning(sender, exc.reason.value, "%s refused a control frame from %r: %s",
                              self.me, sender, exc)  # fmt: skip
            return None

    def _frame(self, data: bytes) -> tuple[Frame, bool]:
        try:
            return decode_frame(data, self.key, self.limits), self.key is not None
        except FrameError as exc:
            if exc.reason is not FrameReason.BAD_MAC or self.key is None:
                raise
            try:
                frame = decode_frame(data, None, self.limits)  # unsigned: a new enrolment?
            except FrameError:
                raise exc from None  # signed with another key: say so, not "no key here"
            if frame.kind != "manifest" or frame.src != _KEY_HOLDER:
                raise  # an agent's unsigned frame would be read as a manifest (issue 27)
            return frame, False


def _message(head: Frame, body: bytes, signed: bool) -> ControlMessage:
    size = head.meta.get("doc")
    if type(size) is not int or not 0 <= size <= len(body):
        raise FrameError(FrameReason.MALFORMED, f"meta 'doc'={size!r} for a {len(body)}-byte body")
    doc = parse_document(body[:size], what=f"{head.kind} document") if size else {}
    return ControlMessage(head.kind, head.job, head.src, head.round, doc, body[size:], signed)


def field(msg: ControlMessage, name: str, kind: type, default: Any = None) -> Any:
    """``msg.doc[name]`` checked against `kind`; a `FrameError` names the field."""
    value = msg.doc.get(name, default)
    if value is None or (kind is float and type(value) is int):
        return value if value is None else float(value)
    if type(value) is not kind:
        raise FrameError(
            FrameReason.MALFORMED,
            f"{msg.kind} from {msg.src!r}: field {name!r}={value!r:.60} is not {kind.__name__}",
        )
    return value
