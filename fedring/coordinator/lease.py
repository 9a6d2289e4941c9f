"""One job, one coordinator: the output folder's lock and the broker's coordinator id.

Every coordinator connects under the one id ``coordinator``, so a second one at a
broker takes the first's MQTT session, the first reconnects and takes it back, and
both go on for as long as they live (issue 27: a stale coordinator and a
``--resume`` one did so for 4 minutes, both writing one output folder). Three
guards, from the cheapest:

- `lock_folder`: an exclusive ``flock`` on ``OUT/.coordinator.lock``, held for the
  process's life (the kernel drops it when the process dies, however it dies). The
  file names the holder's pid for the refusal message.
- `check_broker`: before connecting, the coordinator's retained presence is read
  under a throwaway client id; "online" means a live coordinator holds the id (its
  last-will turns it to "lost" when it dies). The same look clears the retained
  manifests of coordinators that crashed. A broker that binds client ids to user
  names (``use_username_as_clientid``, as docs/deploy.md sets up) allows no such
  look under the coordinator's own user (it would take over a live holder's
  session), so the look is anonymous; where the broker refuses it (a broker with
  users, as deployed), the link's own check is the guard.
- The link (`MqttLink.taken_over`): whenever it (re)subscribes, a retained presence
  "online" under another session means another process holds the id; this one steps
  back (the holder's presence put back, no will, no goodbye) and the coordinator
  stops. A newcomer under the deployed broker's users costs the holder one
  reconnect; a stale coordinator that wakes up after the broker took it for lost
  stops at its first reconnect.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedring.transport import topics
from fedring.transport.mqtt import BrokerConfig, BrokerRefused, BrokerTlsError
from fedring.transport.mqtt_peek import peek_retained
from fedring.wire.errors import FrameError
from fedring.wire.jsondoc import parse_document

log = logging.getLogger(__name__)
MAX_STATUS_BYTES = 1024

LOCK_FILE = ".coordinator.lock"


class CoordinatorBusy(RuntimeError):
    """Another coordinator holds this output folder or this broker's coordinator id."""


@dataclass
class FolderLock:
    """An exclusive lock on an output folder; released by `release` or the process's exit."""

    path: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = -1

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


def lock_folder(out: Path) -> FolderLock:
    """Lock `out` for this process, or raise `CoordinatorBusy` naming the holder's pid."""
    path = out / LOCK_FILE
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise CoordinatorBusy(f"cannot use the output folder {out}: {exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            raise CoordinatorBusy(f"cannot lock the output folder {out}: {exc}") from None
        raise CoordinatorBusy(
            f"the output folder {out} is in use by another coordinator (pid {holder}); "
            "one job has one coordinator: stop that one first, or give another --out"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return FolderLock(path, fd)


def check_broker(cfg: BrokerConfig) -> None:
    """Raise `CoordinatorBusy` if a coordinator is online at `cfg`'s broker (a crashed
    one counts once the broker sends its will: within 1.5 keep-alives); otherwise clear
    every retained job manifest, left by coordinators that crashed (a finished job
    clears its own, and only one coordinator is ever online at a broker: a resumed job
    publishes its manifest again). The look is anonymous; a broker that refuses it
    (one with users, as deployed) leaves the link's own check (see above)."""
    look = dataclasses.replace(cfg, username=None, password=None)
    try:
        retained = peek_retained(look, [topics.status(topics.COORDINATOR), topics.manifest("+")])
    except BrokerRefused as exc:
        if isinstance(exc, BrokerTlsError):
            raise
        log.info("no anonymous look at %s (%s): the link checks its id itself", cfg.url, exc)
        return
    holder = _online(retained.pop(topics.status(topics.COORDINATOR), b""))
    if holder is not None:
        job = f", job {holder['job']!r}" if holder.get("job") else ""
        raise CoordinatorBusy(
            f"a coordinator is already online at {cfg.url} (session "
            f"{holder.get('session', '?')}{job}): a broker runs one coordinator at a time, "
            f"under the id {topics.COORDINATOR!r}; stop it first (if it has just died, the "
            "broker marks it lost within 1.5 keep-alives: try again then)"
        )
    if retained:
        log.info("clearing %d retained manifest(s) of crashed coordinators: %s",
                 len(retained), sorted(retained))  # fmt: skip
        peek_retained(look, [], clear=sorted(retained))  # anonymous too


def _online(payload: bytes) -> dict[str, Any] | None:
    """A retained presence that says "online" (someone holds the id), else None."""
    if not payload:
        return None
    try:
        doc = parse_document(payload, max_bytes=MAX_STATUS_BYTES, what="coordinator status")
    except FrameError as exc:
        log.warning("the coordinator's retained status is unreadable: %s", exc)
        return None
    return doc if doc.get("state") == "online" else None
