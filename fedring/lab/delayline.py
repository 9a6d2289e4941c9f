"""Packet delay in user space: a line that holds every frame of an agent's link.

`fedring.lab.delay` delays TCP connections through a proxy, which fits a client
that dials one server (an agent to the broker, a SuperNode to the SuperLink). DDP's
gloo ranks connect to each other at addresses they exchange at run time, so they
need the delay on the link itself, and this kernel has no netem. While
`packet_delay(lab)` is open, each agent link runs through this line::

    agent eth0 ──veth── v<i> ⇄ [forwarder] ⇄ p<i> ──veth── q<i> ── br0   (hub namespace)

`v<i>` leaves the hub's bridge, a veth pair `p<i>`/`q<i>` takes its place (`q<i>` on
the bridge), and one forwarder process in the hub namespace reads every frame from
`v<i>` and `p<i>` (AF_PACKET) and writes it out of the other ``delay_ms`` later, in
order. The tbf shaping stays where it was (`eth0` up, `v<i>` down), so a frame
between two agents crosses two shaped links and is held twice, as an MQTT message
through the broker is. Frames must arrive whole and checksummed: segmentation and
checksum offloads are turned off on `eth0` and `q<i>` (GRO on `v<i>` and `p<i>`),
and turned back on when the line closes.

    python -m fedring.lab.delayline forward --delay-ms 20 v0:p0 v1:p1
    python -m fedring.lab.delayline offload off eth0
"""

from __future__ import annotations

import argparse
import array
import contextlib
import fcntl
import heapq
import itertools
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedring.lab.lab import Lab

SIOCETHTOOL = 0x8946
ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
MAX_FRAME = 1514  # Ethernet header + the veth MTU of 1500
# Legacy ethtool set commands (struct ethtool_value), in the order to turn them off.
OFFLOADS = {"tso": 0x1F, "gso": 0x24, "gro": 0x2C, "tx-csum": 0x17, "sg": 0x19}


def set_offloads(iface: str, on: bool, which: Sequence[str] = tuple(OFFLOADS)) -> None:
    """Turn `which` offloads of `iface` (in this namespace) on or off (SIOCETHTOOL)."""
    order = list(reversed(which)) if on else list(which)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in order:
            value = array.array("I", [OFFLOADS[name], int(on)])
            ifr = struct.pack("16sP", iface.encode(), value.buffer_info()[0])
            fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifr.ljust(40, b"\0"))


def forward(pairs: Sequence[tuple[str, str]], delay_ms: float) -> None:
    """Move frames between the two interfaces of every pair, each ``delay_ms`` late,
    until SIGTERM or SIGINT."""
    delay = delay_ms / 1000
    peer: dict[int, socket.socket] = {}
    socks = []
    for a, b in pairs:
        sa, sb = (_packet_socket(i) for i in (a, b))
        peer[sa.fileno()], peer[sb.fileno()] = sb, sa
        socks += [sa, sb]
    running = [True]

    def leave(*_: object) -> None:
        running[0] = False

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    held: list[tuple[float, int, socket.socket, bytes]] = []
    seq, oversize = itertools.count(), 0
    print(f"forwarding {len(pairs)} links, {delay_ms:g} ms each way", flush=True)
    while running[0]:
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, _, out, frame = heapq.heappop(held)
            with contextlib.suppress(OSError):  # a full queue drops the frame, as a link would
                out.send(frame)
        wait = max(0.0, held[0][0] - now) if held else 0.5
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select(socks, [], [], wait)
        now = time.monotonic()
        for s in ready:
            while True:
                try:
                    frame, addr = s.recvfrom(65536)
                except (BlockingIOError, InterruptedError):
                    break
                if addr[2] == PACKET_OUTGOING:
                    continue  # our own writes, seen again on the way out
                if len(frame) > MAX_FRAME:
                    oversize += 1
                    continue
                heapq.heappush(held, (now + delay, next(seq), peer[s.fileno()], frame))
    print(f"stopped; {oversize} oversized frames dropped", flush=True)


def _packet_socket(iface: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
    s.bind((iface, 0))
    s.setblocking(False)
    return s


@contextlib.contextmanager
def packet_delay(lab: Lab, logs: Path, timeout_s: float = 20.0) -> Iterator[bool]:
    """While open, every agent link holds each frame ``lab.delay_ms`` each way; yields
    whether a line runs (False without a delay)."""
    if not lab.delay_ms:
        yield True
        return
    net, hub = lab.net, lab.net.hub
    nodes = list(enumerate(net.nodes()))
    logs.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m", "fedring.lab.delayline"]
    proc = None
    try:
        for i, node in nodes:
            _ip(net.exec(node), *py, "offload", "off", "eth0")
            _ip(["ip", "-n", hub], "link", "set", f"v{i}", "nomaster")
            _ip(["ip", "-n", hub], "link", "add", f"p{i}", "type", "veth", "peer", "name", f"q{i}")
            _ip(net.exec("hub"), *py, "offload", "off", f"q{i}")
            _ip(net.exec("hub"), *py, "offload", "off", f"p{i}", f"v{i}", "--only", "gro")
            _ip(["ip", "-n", hub], "link", "set", f"q{i}", "master", "br0", "up")
            _ip(["ip", "-n", hub], "link", "set", f"p{i}", "up")
        log = logs / "delayline.log"
        proc = lab.launch("hub", [*py, "forward", "--delay-ms", f"{lab.delay_ms:g}",
                                  *(f"v{i}:p{i}" for i, _ in nodes)], log)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while "forwarding" not in (log.read_text(errors="replace") if log.exists() else ""):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise OSError(f"the packet delay line did not start; see {log}")
            time.sleep(0.1)
        yield True
    finally:
        from fedring.lab.lab import stop

        if proc is not None:
            stop(proc)
        for i, node in nodes:
            subprocess.run(["ip", "-n", hub, "link", "del", f"p{i}"], capture_output=True,
                           check=False)  # fmt: skip
            subprocess.run(["ip", "-n", hub, "link", "set", f"v{i}", "master", "br0"],
                           capture_output=True, check=False)  # fmt: skip
            subprocess.run([*net.exec("hub"), *py, "offload", "on", f"v{i}", "--only", "gro"],
                           capture_output=True, check=False)  # fmt: skip
            subprocess.run([*net.exec(node), *py, "offload", "on", "eth0"],
                           capture_output=True, check=False)  # fmt: skip


def _ip(prefix: list[str], *argv: str) -> None:
    done = subprocess.run([*prefix, *argv], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"`{' '.join([*prefix, *argv])}` failed: {done.stderr.strip()}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedring.lab.delayline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    fwd = sub.add_parser("forward", help="hold every frame between interface pairs")
    fwd.add_argument("--delay-ms", type=float, required=True)
    fwd.add_argument("pairs", nargs="+", help="IFACE_A:IFACE_B")
    off = sub.add_parser("offload", help="turn an interface's offloads on or off")
    off.add_argument("state", choices=("on", "off"))
    off.add_argument("ifaces", nargs="+")
    off.add_argument("--only", choices=tuple(OFFLOADS), action="append")
    args = parser.parse_args(argv)
    if args.cmd == "forward":
        pairs = [tuple(p.split(":", 1)) for p in args.pairs]
        if any(len(p) != 2 for p in pairs) or not 0 <= args.delay_ms <= 10_000:
            parser.error("pairs are IFACE_A:IFACE_B and --delay-ms is in [0, 10000]")
        forward([(a, b) for a, b in pairs], args.delay_ms)
        return 0
    for iface in args.ifaces:
        set_offloads(iface, args.state == "on", args.only or tuple(OFFLOADS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
