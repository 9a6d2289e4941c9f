"""The lab's network: one hub namespace with a bridge, one namespace per agent.

::

    frl<PID>-a0  eth0 10.201.0.11 --veth-- v0 ┐
    frl<PID>-a1  eth0 10.201.0.12 --veth-- v1 ┼ br0 10.201.0.1  frl<PID>-hub
    ...                                       ┘ (Mosquitto, coordinator, SuperLink)

Each agent's link is shaped with `tc tbf` in both directions: on its own ``eth0``
(upload) and on the hub's ``v<i>`` (download). The veth pairs are created straight
inside the namespaces, so nothing is added to the host's namespace and only
namespaces the lab made carry traffic. Every name starts with ``frl<PID>-``, the
PID of the process that built it: `stale` finds the leftovers of a lab whose owner
died without tearing down, and `destroy` ends every process still inside a
namespace before deleting it (which removes its links, qdiscs and nftables rules).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

PREFIX = "frl"
SUBNET = "10.201.0"
HUB_ADDR = f"{SUBNET}.1"
AGENT_IFACE = "eth0"
MAX_AGENTS = 200  # addresses .11 .. .210


class LabError(RuntimeError):
    """A lab command failed (with the command and what it printed)."""


def sh(*argv: str, check: bool = True, input: str | None = None) -> str:
    """Run one `ip` / `tc` / `nft` command; raise `LabError` naming it on failure."""
    done = subprocess.run(argv, capture_output=True, text=True, input=input, check=False)
    if check and done.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def can_build() -> str | None:
    """Why this machine cannot build a lab, or None if it can."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True, check=False).returncode:
            return f"`{tool}` (iproute2) is not installed"
    return None


def tbf(rate_mbps: float) -> list[str]:
    """A token bucket at `rate_mbps`: a burst of 10 ms (at least 16 KB), 100 ms of queue."""
    burst = max(16 * 1024, int(rate_mbps * 1e6 / 8 * 0.010))
    return ["tbf", "rate", f"{rate_mbps * 1000:.0f}kbit", "burst", str(burst), "latency", "100ms"]


@dataclass(frozen=True)
class Net:
    """The names and addresses of one lab's namespaces."""

    agents: int
    owner: int  # PID of the process that builds and tears it down

    def __post_init__(self) -> None:
        if not 1 <= self.agents <= MAX_AGENTS:
            raise ValueError(f"agents={self.agents} must be in [1, {MAX_AGENTS}]")

    @property
    def prefix(self) -> str:
        return f"{PREFIX}{self.owner}-"

    @property
    def hub(self) -> str:
        return f"{self.prefix}hub"

    def ns(self, node: str) -> str:
        """Namespace of a node: "hub" or "a<i>"."""
        return f"{self.prefix}{node}"

    def nodes(self) -> list[str]:
        return [f"a{i}" for i in range(self.agents)]

    def host(self, node: str) -> str:
        if node == "hub":
            return HUB_ADDR
        return f"{SUBNET}.{11 + int(node[1:])}"

    def namespaces(self) -> list[str]:
        return [self.hub] + [self.ns(n) for n in self.nodes()]

    def exec(self, node: str) -> list[str]:
        """The argv prefix that runs a command on `node`."""
        return ["ip", "netns", "exec", self.ns(node)]


def build(net: Net, up_mbps: float, down_mbps: float | None = None) -> None:
    """Create the namespaces, the bridge and the shaped veth links."""
    down = up_mbps if down_mbps is None else down_mbps
    for rate, name in ((up_mbps, "bandwidth"), (down, "downlink")):
        if not 0.01 <= rate <= 100_000:
            raise ValueError(f"{name}={rate} Mbit/s must be in [0.01, 100000]")
    hub = net.hub
    sh("ip", "netns", "add", hub)
    sh("ip", "-n", hub, "link", "set", "lo", "up")
    sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", hub, "addr", "add", f"{HUB_ADDR}/24", "dev", "br0")
    sh("ip", "-n", hub, "link", "set", "br0", "up")
    for i, node in enumerate(net.nodes()):
        ns, port = net.ns(node), f"v{i}"
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", AGENT_IFACE, "netns", ns, "type", "veth",
           "peer", "name", port, "netns", hub)  # fmt: skip
        sh("ip", "-n", ns, "addr", "add", f"{net.host(node)}/24", "dev", AGENT_IFACE)
        sh("ip", "-n", ns, "link", "set", AGENT_IFACE, "up")
        sh("ip", "-n", hub, "link", "set", port, "master", "br0", "up")
        sh("tc", "-n", ns, "qdisc", "add", "dev", AGENT_IFACE, "root", *tbf(up_mbps))
        sh("tc", "-n", hub, "qdisc", "add", "dev", port, "root", *tbf(down))
    log.info("lab %s: %d agents at %g/%g Mbit/s", net.prefix, net.agents, up_mbps, down)


def reshape(net: Net, up_mbps: float, down_mbps: float | None = None) -> None:
    """New rates on every agent link (`tc qdisc replace`: the namespaces stay)."""
    down = up_mbps if down_mbps is None else down_mbps
    for rate, name in ((up_mbps, "bandwidth"), (down, "downlink")):
        if not 0.01 <= rate <= 100_000:
            raise ValueError(f"{name}={rate} Mbit/s must be in [0.01, 100000]")
    for i, node in enumerate(net.nodes()):
        sh("tc", "-n", net.ns(node), "qdisc", "replace", "dev", AGENT_IFACE, "root", *tbf(up_mbps))
        sh("tc", "-n", net.hub, "qdisc", "replace", "dev", f"v{i}", "root", *tbf(down))


def existing(prefix: str = PREFIX) -> list[str]:
    """Namespaces whose name starts with `prefix`."""
    names = [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def ns_pids(ns: str) -> list[int]:
    return [int(p) for p in sh("ip", "netns", "pids", ns, check=False).split()]


def destroy(namespaces: Sequence[str], grace_s: float = 3.0) -> list[str]:
    """End every process inside `namespaces` (SIGTERM, then SIGKILL) and delete them.

    Returns what could not be removed (empty on success)."""
    present = set(existing(""))
    targets = [ns for ns in namespaces if ns in present]
    _signal_all(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(ns_pids(ns) for ns in targets):
        time.sleep(0.1)
    _signal_all(targets, signal.SIGKILL)
    left = []
    for ns in targets:
        # a killed process can take seconds to go on a loaded machine (a torch process
        # freeing its memory): wait for it, or it outlives the namespace's name
        for _ in range(150):
            if not ns_pids(ns):
                break
            time.sleep(0.1)
        done = subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        if done.returncode != 0:
            left.append(ns)
    if left:
        log.error("could not delete namespaces %s", left)
    return left


def _signal_all(namespaces: Sequence[str], sig: signal.Signals) -> None:
    for ns in namespaces:
        for pid in ns_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def stale(every: bool = False) -> list[str]:
    """Lab namespaces whose owner process is gone (all lab namespaces with `every`)."""
    out = []
    for ns in existing():
        m = re.match(rf"{PREFIX}(\d+)-", ns)
        if m is None:
            continue
        if every or not _alive(int(m.group(1))):
            out.append(ns)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def inodes(namespaces: Sequence[str]) -> dict[str, int]:
    """Inode of each namespace (what /proc/PID/ns/net of a process inside points to)."""
    out = {}
    for ns in namespaces:
        with contextlib.suppress(FileNotFoundError):
            out[ns] = os.stat(f"/run/netns/{ns}").st_ino
    return out


def processes_in(inode_set: set[int]) -> list[int]:
    """PIDs of every process whose network namespace is one of `inode_set`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{entry}/ns/net").st_ino in inode_set:
                found.append(int(entry))
    return found


def link_bytes(net: Net, node: str) -> tuple[int, int]:
    """(sent, received) bytes the kernel counted on an agent's interface."""
    doc = json.loads(sh("ip", "-n", net.ns(node), "-s", "-j", "link", "show", "dev", AGENT_IFACE))
    stats = doc[0]["stats64"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


def qdiscs(net: Net, node: str) -> str:
    """`tc qdisc show` on a node (agents: eth0; hub: every port)."""
    return sh("tc", "-n", net.ns(node), "qdisc", "show")
