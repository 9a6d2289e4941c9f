"""Start and stop a real Aedes broker (Node.js, from npm) on loopback: a second broker.

Aedes is the MQTT broker of the Node.js world (about 260 k npm downloads a month
when it was chosen, against 15 k for amqtt on PyPI; see docs/operations/brokers.md). It
speaks MQTT 3.1 and 3.1.1 only: an MQTT 5 CONNECT is refused with "unacceptable
protocol version", so a link with ``?protocol=auto`` falls back to 3.1.1. Its sessions,
retained messages and wills live in memory (a restart forgets them).

`Aedes` has `Mosquitto`'s face (``url``, ``start``, ``stop``, ``pid``, a context
manager): it writes a small CommonJS server into its own directory, runs it with
``node`` on 127.0.0.1 and a free port, waits until the port accepts, and stops it by
PID (SIGTERM, then SIGKILL). Install it with ``npm install -g aedes@1.2.0``, or point
``FEDRING_AEDES_DIR`` at a ``node_modules`` folder that holds it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from fedring.transport.mosquitto import free_port, terminate

AEDES_DIR_ENV = "FEDRING_AEDES_DIR"  # a node_modules folder holding aedes

# Plain CommonJS: NODE_PATH finds `aedes` for require() (it does not for ESM imports).
SERVER_JS = """\
const { createServer } = require('node:net')
const { Aedes } = require('aedes')
const [host, port] = [process.argv[2], Number(process.argv[3])]
Aedes.createBroker().then((broker) => {
  // Like Mosquitto's set_tcp_nodelay: small QoS 1 frames must not wait on Nagle
  const server = createServer((socket) => { socket.setNoDelay(true); broker.handle(socket) })
  server.listen(port, host, () => console.log(`aedes ${host}:${port}`))
  const stop = () => server.close(() => broker.close(() => process.exit(0)))
  process.on('SIGTERM', stop)
  process.on('SIGINT', stop)
})
"""


class AedesMissing(RuntimeError):
    """``node`` or the aedes package is not installed."""


def aedes_modules() -> Path:
    """The ``node_modules`` folder that holds aedes (raise `AedesMissing` if none does)."""
    if shutil.which("node") is None:
        raise AedesMissing("node is not installed: apt-get install -y nodejs npm")
    given = os.environ.get(AEDES_DIR_ENV)
    if given:
        roots = [Path(given)]
    elif shutil.which("npm") is None:
        roots = [Path("/usr/lib/node_modules"), Path("/usr/local/lib/node_modules")]
    else:
        npm = ["npm", "root", "-g"]
        found = subprocess.run(npm, capture_output=True, text=True, check=False, timeout=30)
        roots = [Path(found.stdout.strip())] if found.returncode == 0 else []
        roots += [Path("/usr/lib/node_modules"), Path("/usr/local/lib/node_modules")]
    for root in roots:
        if (root / "aedes" / "package.json").is_file():
            return root
    where = ", ".join(map(str, roots)) or "nowhere"
    raise AedesMissing(f"aedes is not installed (looked in {where}): npm install -g aedes@1.2.0")


class Aedes:
    """One Aedes broker process on `host` and a free port (MQTT 3.1.1, no TLS, anonymous)."""

    def __init__(self, *, workdir: str | Path | None = None, host: str = "127.0.0.1",
                 port: int | None = None) -> None:  # fmt: skip
        self.modules = aedes_modules()
        self.host = host
        self.port = port or free_port()
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="fedring-aedes-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = self.dir / "aedes.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    @property
    def _where(self) -> tuple[str, int]:
        return self.host, self.port

    def start(self, timeout: float = 15.0) -> Aedes:
        script = self.dir / "server.cjs"
        script.write_text(SERVER_JS)
        env = {**os.environ, "NODE_PATH": str(self.modules)}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["node", str(script), self.host, str(self.port)],
                stdout=log, stderr=log, env=env, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"aedes exited at start: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(self._where, 0.2):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"aedes did not listen on port {self.port} within {timeout} s")

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, SIGKILL if it lingers."""
        proc, self.proc = self.proc, None
        terminate(proc, timeout)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def __enter__(self) -> Aedes:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
