"""Where bench processes run: the launcher contract between the baselines and a lab.

A baseline never calls `subprocess.Popen` itself. It asks a `Launch` to start each
process on a named node and a `Host` for the address other nodes reach that node
at. Nodes are ``"hub"`` (server side: Flower's SuperLink and ServerApp, `flwr`
commands) and ``"a0"`` .. ``"a{N-1}"`` (one per agent or client).

On loopback (`local_launch`, `local_host`) every node is this host. The edge lab
plugs in its own pair: `launch` prefixes the argv with ``ip netns exec NS`` and
`host` returns the namespace's address. Either way each process must start in
its own session (``start_new_session=True``) so that `sessions.stop_session` can
end it and everything it spawned; servers listen on ``0.0.0.0`` so that nodes in
other namespaces reach them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn, Protocol

from fedring.bench.sessions import session_members, stop_session, tree_sessions


class Launch(Protocol):
    """Start `argv` on `node`, output to `log`, with exactly `env`; return the Popen.

    The process must start in a new session (``start_new_session=True``) and the
    returned Popen's PID must be that process (``ip netns exec`` execs in place).
    """

    def __call__(
        self, node: str, argv: list[str], log: Path, env: Mapping[str, str], /
    ) -> subprocess.Popen[bytes]: ...


Host = Callable[[str], str]  # host(node) -> the address other nodes reach `node` at


class BaselineError(RuntimeError):
    """A baseline run failed, timed out or left processes behind; the message says which."""


def exit_past_gloo_teardown() -> NoReturn:
    """End a gloo rank, its outputs written and its process group destroyed, without
    the interpreter's teardown: under load, torch 2.13's C++ teardown at exit sometimes
    aborts the rank ("terminate called without an active exception", SIGABRT, no
    Python frame) after `destroy_process_group` returned: 1 run of `run_ddp(4, ...)` in
    18 to 24 beside two busy loops here, and twice in CI."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def local_launch(
    node: str, argv: list[str], log: Path, env: Mapping[str, str]
) -> subprocess.Popen[bytes]:
    """Start `argv` on this host in a new session, stdout and stderr to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=dict(env),
                                start_new_session=True, cwd=log.parent)  # fmt: skip


def local_host(node: str) -> str:
    """Every node of a loopback run is this host."""
    return "127.0.0.1"


def agent_nodes(n: int) -> list[str]:
    return [f"a{i}" for i in range(n)]


def stop_all(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    """Stop each process's session and its descendants' (SIGTERM, then SIGKILL).

    Returns the PIDs still alive in any of those sessions (empty when all is well).
    """
    sids: set[int] = set()
    for proc in procs:
        # A reaped PID may be someone else's by now: only its session id is still ours.
        sids |= tree_sessions(proc.pid) if proc.poll() is None else {proc.pid}
    for sid in sorted(sids):
        if session_members(sid):
            stop_session(sid)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    return [pid for sid in sorted(sids) for pid in session_members(sid)]


def run_on(
    launch: Launch,
    node: str,
    argv: list[str],
    log: Path,
    env: Mapping[str, str],
    timeout_s: float,
) -> str:
    """Run a short command on `node` to completion; return its output (the log).

    For what the parent cannot do itself because it may live outside the node's
    namespace: probe a port, read interface counters, call the `flwr` CLI.

    Raises
    ------
    BaselineError
        Non-zero exit or past `timeout_s` (the command is stopped first).
    """
    log.unlink(missing_ok=True)
    proc = launch(node, argv, log, env)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_all([proc])
        raise BaselineError(f"{node}: {argv[:3]} not done after {timeout_s:.0f} s") from None
    stop_all([proc])  # anything it left in its session
    text = log.read_text(errors="replace") if log.exists() else ""
    if code != 0:
        raise BaselineError(f"{node}: {argv[:3]} exited with {code}:\n{text[-2000:]}")
    return text
