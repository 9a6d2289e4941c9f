"""Start and stop a real Mosquitto broker on loopback: tests, benches, and local trials.

`Mosquitto` writes a config into its own directory, listens on 127.0.0.1 and a
free port, waits until the port accepts, and stops the broker by PID (SIGTERM,
then SIGKILL). With `persistence`, a restart keeps sessions, queued QoS 1 messages
and retained topics. With `users`, it writes a password file (via
``mosquitto_passwd``), refuses anonymous clients and, as examples/mosquitto.conf
does, makes each client's id its user name (no one can take over another's id);
`acl` is a path to an ACL file. With `tls`, the listener speaks TLS only.
``nodelay=False`` leaves out ``set_tcp_nodelay true``: a broker that Nagles its small
writes, as a default Mosquitto does (tests of the client's check for one). `limits`
imitates a managed broker's: `AWS_IOT_CORE` caps a packet at 128 KiB and QoS at 1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


class MosquittoMissing(RuntimeError):
    """The `mosquitto` binary is not installed."""


def free_port() -> int:
    """A TCP port that was free on this host a moment ago (the caller binds it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def terminate(proc: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    """SIGTERM a broker we started, SIGKILL if it lingers; nothing if it is gone."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def mosquitto_binary() -> str:
    for candidate in (shutil.which("mosquitto"), "/usr/sbin/mosquitto"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise MosquittoMissing(
        "mosquitto is not installed: apt-get install -y mosquitto mosquitto-clients"
    )


@dataclass(frozen=True)
class BrokerLimits:
    """What a broker refuses, in Mosquitto's terms (0: Mosquitto's default)."""

    max_packet_size: int = 0  # bytes of one packet; MQTT 5 clients read it in the CONNACK
    max_qos: int = 2  # a higher QoS is downgraded (MQTT 5 CONNACK: Maximum QoS)
    retain_available: bool = True  # false: a retained publish is refused

    def lines(self) -> list[str]:
        return [*([f"max_packet_size {self.max_packet_size}"] if self.max_packet_size else []),
                f"max_qos {self.max_qos}",
                f"retain_available {'true' if self.retain_available else 'false'}"]  # fmt: skip


# AWS IoT Core's message broker: 128 KB a message, QoS 0 and 1 only. It keeps retained
# messages (since 2021), so retain stays on. See docs/operations/brokers.md.
AWS_IOT_CORE = BrokerLimits(max_packet_size=128 * 1024, max_qos=1)


@dataclass(frozen=True)
class TlsListener:
    """The broker's side of TLS: its certificate, and the CA its clients' certificates need."""

    cafile: Path
    certfile: Path
    keyfile: Path
    require_certificate: bool = False  # clients must present a certificate signed by cafile


class Mosquitto:
    def __init__(
        self,
        *,
        persistence: bool = False,
        users: Mapping[str, str] | None = None,
        acl: str | Path | None = None,
        sys_interval: int = 0,
        workdir: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        prefix: Sequence[str] = (),
        tls: TlsListener | None = None,
        nodelay: bool = True,
        limits: BrokerLimits | None = None,
    ) -> None:
        self.binary = mosquitto_binary()
        self.host = host
        self.port = port or free_port()
        # e.g. ("ip", "netns", "exec", NS): run (and probe for readiness) in a namespace
        self.prefix = tuple(prefix)
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="fedring-mosquitto-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.persistence = persistence
        self.users = dict(users or {})
        self.acl = Path(acl) if acl else None
        self.sys_interval = sys_interval
        self.tls = tls
        self.nodelay = nodelay
        self.limits = limits
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.dir / "mosquitto.log"

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    def _write_config(self) -> Path:
        lines = [
            f"listener {self.port} {self.host}",
            "per_listener_settings false",
            *self._tls_lines(),
            *(["set_tcp_nodelay true"] if self.nodelay else []),
            f"allow_anonymous {'false' if self.users else 'true'}",
            "max_inflight_messages 100",
            "max_queued_messages 10000",
            *(self.limits.lines() if self.limits else ["message_size_limit 1048576"]),
            f"sys_interval {self.sys_interval}",
            f"log_dest file {self.log}",
            "log_type error",
            "log_type warning",
            "log_type notice",
        ]
        if os.geteuid() == 0:  # as root it would drop to user "mosquitto" and lose its files
            lines.append("user root")
        if self.persistence:
            lines += [
                "persistence true",
                f"persistence_location {self.dir}/",
                "autosave_interval 1",
            ]
        if self.users:
            pw = self.dir / "passwd"
            pw.write_text("")
            for user, password in self.users.items():
                subprocess.run(
                    [_passwd_binary(), "-b", str(pw), user, password],
                    check=True,
                    capture_output=True,
                )
            pw.chmod(0o600)
            lines += [f"password_file {pw}", "use_username_as_clientid true"]
        if self.acl:
            lines.append(f"acl_file {self.acl}")
        conf = self.dir / "mosquitto.conf"
        conf.write_text("\n".join(lines) + "\n")
        return conf

    def _tls_lines(self) -> list[str]:
        if self.tls is None:
            return []
        t = self.tls
        return [f"cafile {t.cafile}", f"certfile {t.certfile}", f"keyfile {t.keyfile}",
                f"require_certificate {'true' if t.require_certificate else 'false'}"]  # fmt: skip

    def start(self, timeout: float = 10.0) -> Mosquitto:
        conf = self._write_config()
        self.proc = subprocess.Popen(
            [*self.prefix, self.binary, "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                tail = self.log.read_text()[-2000:] if self.log.exists() else ""
                raise RuntimeError(f"mosquitto exited at start: {err}{tail}")
            if self._listening():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mosquitto did not listen on port {self.port} within {timeout} s")

    def _listening(self) -> bool:
        if self.prefix:  # another namespace: ask `ss` there instead of connecting from here
            found = subprocess.run(
                [*self.prefix, "ss", "-ltnH", f"sport = :{self.port}"],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            return bool(found.stdout.strip())
        with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), 0.2):
            return True
        return False

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (persistence is saved on the way out), SIGKILL if it lingers."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        terminate(proc, timeout)
        if proc.stderr:
            proc.stderr.close()

    def restart(self, pause: float = 0.0) -> None:
        self.stop()
        time.sleep(pause)
        self.start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def __enter__(self) -> Mosquitto:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def _passwd_binary() -> str:
    found = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
    if not os.access(found, os.X_OK):
        raise MosquittoMissing("mosquitto_passwd is missing: apt-get install -y mosquitto")
    return found
