"""Processes by session: find and stop everything a started process spawned.

Every process the benches and the Flower tests start gets ``start_new_session=True``,
so its session id is its PID and whatever it spawns (SuperExec, ServerApp and
ClientApp processes, gloo workers' helpers) stays in that session unless it asks
for a new one. `stop_session` ends a session (SIGTERM, then SIGKILL) and
`session_members` lists what is still alive in it. Both read ``/proc``, which
shows every network namespace's processes (they share the PID namespace).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from fedring.transport.mosquitto import free_port

__all__ = ["free_port", "session_members", "stop_session", "tree_sessions"]


def session_members(sid: int) -> list[int]:
    """Live processes (zombies left out) of session `sid`."""
    return [pid for pid, _, s, state in _processes() if s == sid and state != "Z"]


def tree_sessions(pid: int) -> set[int]:
    """Session ids of `pid` and of all its live descendants.

    Flower's SuperLink starts its SuperExec with ``start_new_session=True``, so a
    session scan of the SuperLink alone misses the SuperExec and the ServerApp
    under it; collect the sessions of the whole tree before stopping anything.
    """
    procs = _processes()
    children: dict[int, list[int]] = {}
    for p, ppid, _, _ in procs:
        children.setdefault(ppid, []).append(p)
    sid_of = {p: s for p, _, s, _ in procs}
    seen, todo = {pid}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return {pid} | {sid_of[p] for p in seen if p in sid_of}


def stop_session(sid: int, kill_first: bool = False, grace_s: float = 5.0) -> None:
    """End every process of session `sid`: SIGTERM, up to `grace_s` later SIGKILL.

    With `kill_first`, SIGKILL at once (a board losing power). Returns when the
    session is empty or both signals have had `grace_s`; check `session_members`.
    """
    signals = [signal.SIGKILL] if kill_first else [signal.SIGTERM, signal.SIGKILL]
    for sig in signals:
        for pid, _, s, _ in _processes():
            if s == sid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not session_members(sid):
                return
            time.sleep(0.1)


def _processes() -> list[tuple[int, int, int, str]]:
    """(pid, ppid, session, state) of every process in /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out.append((int(entry.name), int(fields[1]), int(fields[3]), fields[0]))
    return out
