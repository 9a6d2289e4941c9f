"""Packet loss with nftables, inside one network namespace.

The lab's kernel has no netem, so links cannot be impaired with ``tc``: latency is
added in user space (`fedring.lab.delay`) and loss here, by an nftables rule that
drops a random fraction of the packets crossing an interface::

    iifname "veth0" numgen random mod 10000 < 3000 counter drop   # 30 % loss

Rules live in a table of our own, ``inet fedring_lab``, with a ``prerouting``
chain for ingress (``iifname``) and a ``postrouting`` chain for egress
(``oifname``), so they see what the namespace sends, receives and forwards. The
inet family sees IPv4 and IPv6 only: ARP passes untouched. The loss resolution is
1/10000. TCP retransmits what is dropped, so on the MQTT link loss shows up as
delay and lower throughput, not as lost messages. Hazard: a packet the namespace
itself sends and egress loss drops fails the send with EPERM (``PermissionError``
from a UDP ``sendto``); put loss on the peer's ingress to keep senders unaware.

`apply_loss` replaces the whole table in one ``nft -f`` transaction run with
``ip netns exec NS``, so applying twice leaves the last set only. Remove it with
`clear_loss` (``ip netns exec NS nft delete table inet fedring_lab``); deleting the
namespace removes it too. `dropped` reads each rule's counter::

    apply_loss("frl-a1", Loss("veth0", 0.02))  # 2 % each way
    dropped("frl-a1")  # {("veth0", "ingress"): 3, ("veth0", "egress"): 5}
    clear_loss("frl-a1")
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

TABLE = "fedring_lab"
RESOLUTION = 10_000  # numgen modulus: loss is rounded to 1/RESOLUTION
NFT_TIMEOUT_S = 10.0

Direction = Literal["ingress", "egress"]
# chain name → (hook and priority, the interface match of that direction)
_CHAINS: dict[Direction, tuple[str, str]] = {
    "ingress": ("prerouting priority raw", "iifname"),  # before conntrack: drops leave no state
    "egress": ("postrouting priority filter", "oifname"),
}
_IFNAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")  # IFNAMSIZ − 1; no quotes reach the ruleset
_NETNS = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class NftError(RuntimeError):
    """``nft`` (or ``ip netns exec``) failed; the message carries its stderr."""


@dataclass(frozen=True)
class Loss:
    """Drop a fraction `loss` of the packets on `interface` in `direction`."""

    interface: str
    loss: float  # in [0, 1); 0 keeps the rule (and its counter) but drops nothing
    direction: Direction | Literal["both"] = "both"

    def __post_init__(self) -> None:
        if not isinstance(self.interface, str) or not _IFNAME.fullmatch(self.interface):
            raise ValueError(
                f"interface={self.interface!r} must be 1–15 of letters, digits, '_', '.', '-'"
            )
        if not isinstance(self.loss, int | float) or not (
            math.isfinite(self.loss) and 0 <= self.loss < 1
        ):
            raise ValueError(f"loss={self.loss} must be in [0, 1)")
        if self.direction not in ("ingress", "egress", "both"):
            raise ValueError(f"direction={self.direction!r} must be ingress, egress or both")

    @property
    def directions(self) -> tuple[Direction, ...]:
        return ("ingress", "egress") if self.direction == "both" else (self.direction,)

    @property
    def threshold(self) -> int:
        """Packets whose random number in [0, RESOLUTION) is below this are dropped."""
        return round(self.loss * RESOLUTION)


def loss_ruleset(losses: Sequence[Loss]) -> str:
    """The ``nft -f`` text that replaces table ``inet fedring_lab`` with these losses."""
    rules: dict[Direction, list[str]] = {"ingress": [], "egress": []}
    seen: set[tuple[str, Direction]] = set()
    for item in losses:
        for direction in item.directions:
            if (item.interface, direction) in seen:
                raise ValueError(f"interface={item.interface!r} has two {direction} losses")
            seen.add((item.interface, direction))
            match = _CHAINS[direction][1]
            rules[direction].append(
                f'{match} "{item.interface}" numgen random mod {RESOLUTION} '
                f"< {item.threshold} counter drop"
            )
    # "add" then "delete" makes the delete succeed whether or not the table exists.
    lines = [f"add table inet {TABLE}", f"delete table inet {TABLE}", f"table inet {TABLE} {{"]
    for direction, chain_rules in rules.items():
        if chain_rules:
            hook = _CHAINS[direction][0]
            lines += [f"\tchain {direction} {{", f"\t\ttype filter hook {hook}; policy accept;"]
            lines += [f"\t\t{rule}" for rule in chain_rules]
            lines.append("\t}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def apply_loss(netns: str, losses: Loss | Sequence[Loss]) -> None:
    """Replace the loss rules of namespace `netns` with `losses` (one transaction)."""
    ruleset = loss_ruleset([losses] if isinstance(losses, Loss) else losses)
    _nft(netns, ["-f", "-"], ruleset)


def clear_loss(netns: str) -> None:
    """Remove table ``inet fedring_lab`` from `netns`; a no-op where there is none."""
    _nft(netns, ["-f", "-"], f"add table inet {TABLE}\ndelete table inet {TABLE}\n")


def dropped(netns: str) -> dict[tuple[str, Direction], int]:
    """Packets dropped so far, by ``(interface, direction)``, from the rules' counters."""
    listing = json.loads(_nft(netns, ["-j", "list", "table", "inet", TABLE]))
    counts: dict[tuple[str, Direction], int] = {}
    for entry in listing["nftables"]:
        rule = entry.get("rule")
        if rule is None or rule["chain"] not in _CHAINS:
            continue
        interface, packets = None, None
        for expr in rule["expr"]:
            if "match" in expr and "meta" in expr["match"]["left"]:
                interface = expr["match"]["right"]
            elif "counter" in expr:
                packets = expr["counter"]["packets"]
        if interface is not None and packets is not None:
            counts[(interface, rule["chain"])] = int(packets)
    return counts


def loss_unsupported() -> str:
    """Why `apply_loss` cannot run here (not root, no ``ip`` or ``nft``), or "" if it can."""
    if os.geteuid() != 0:
        return "nftables in a namespace needs root"
    missing = [tool for tool in ("ip", "nft") if _binary(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed: apt-get install -y iproute2 nftables"
    return ""


def _binary(name: str) -> str | None:
    for candidate in (shutil.which(name), f"/usr/sbin/{name}", f"/sbin/{name}"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _nft(netns: str, args: list[str], stdin: str = "") -> str:
    if not isinstance(netns, str) or not _NETNS.fullmatch(netns) or netns in (".", ".."):
        raise ValueError(f"netns={netns!r} must be a namespace name (letters, digits, _ . -)")
    ip, nft = _binary("ip"), _binary("nft")
    if ip is None or nft is None:
        raise NftError(loss_unsupported())
    command = [ip, "netns", "exec", netns, nft, *args]
    done = subprocess.run(
        command, input=stdin, capture_output=True, text=True, timeout=NFT_TIMEOUT_S
    )
    if done.returncode != 0:
        raise NftError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout
