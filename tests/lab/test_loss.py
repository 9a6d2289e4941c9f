"""nftables loss in two namespaces the test makes (frd-a, frd-b), joined by a veth pair.

The namespaces are deleted after each test, also on failure, and the teardown
checks that ``ip netns list`` no longer shows them. Tests that need them are
skipped with the reason unless this runs as root with ``ip`` and ``nft``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from fedring.lab.impair import (
    Loss,
    NftError,
    apply_loss,
    clear_loss,
    dropped,
    loss_ruleset,
    loss_unsupported,
)

UNSUPPORTED = loss_unsupported()
needs_netns = pytest.mark.skipif(bool(UNSUPPORTED), reason=UNSUPPORTED or "root, ip and nft")

A, B = "frd-a", "frd-b"
VETH_A, VETH_B = "frd-va", "frd-vb"
ADDR_B = "10.250.0.2"
PORT = 9999

RECEIVER = textwrap.dedent(f"""
    import socket, time
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    SO_RCVBUFFORCE = 33  # Linux; Python does not name it. Root may exceed rmem_max.
    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)  # no drops at the socket
    s.bind(("{ADDR_B}", {PORT}))
    print("ready", flush=True)
    got, deadline = 0, time.monotonic() + 20
    s.settimeout(5)  # the first datagram
    while time.monotonic() < deadline:
        try:
            s.recv(2048)
        except TimeoutError:
            break
        got += 1
        s.settimeout(1)  # then stop once the sender is done
    print(got, flush=True)
""")

SENDER = textwrap.dedent(f"""
    import socket, sys, time
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    refused = 0
    for i in range(int(sys.argv[1])):
        try:
            s.sendto(b"%08d" % i, ("{ADDR_B}", {PORT}))
        except PermissionError:  # a local packet dropped by egress loss fails with EPERM
            refused += 1
        if i % 50 == 0:
            time.sleep(0.002)  # paced so that neither the ARP queue nor the receiver overflows
    print(refused)
""")


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=20).stdout


def netns_names() -> set[str]:
    return {line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()}


def delete_netns() -> None:
    for ns in (A, B):
        if ns in netns_names():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


@pytest.fixture
def pair() -> Iterator[None]:
    """frd-a (10.250.0.1/24 on frd-va) ↔ frd-b (10.250.0.2/24 on frd-vb), IPv4 only."""
    delete_netns()  # left over by a killed run: these names are this test's own
    try:
        for ns in (A, B):
            sh("ip", "netns", "add", ns)
            # No IPv6: router solicitations and DAD would also meet the drop rule's counter.
            for conf in ("all", "default"):
                sh(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "sysctl",
                    "-qw",
                    f"net.ipv6.conf.{conf}.disable_ipv6=1",
                )
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", A, "link", "add", VETH_A, "type", "veth", "peer", "name", VETH_B, "netns", B)
        for ns, veth, addr in ((A, VETH_A, "10.250.0.1/24"), (B, VETH_B, "10.250.0.2/24")):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", veth)
            sh("ip", "-n", ns, "link", "set", veth, "up")
        yield
    finally:
        delete_netns()
        left = netns_names() & {A, B}
        assert not left, f"namespaces left behind: {left}"


def send_udp(count: int) -> tuple[int, int]:
    """Send `count` datagrams from frd-a to frd-b; return how many arrived and were refused."""
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", B, sys.executable, "-c", RECEIVER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        line = receiver.stdout.readline()  # the receiver exits on its own within 25 s
        assert line.strip() == "ready", receiver.communicate(timeout=30)[1]
        refused = sh("ip", "netns", "exec", A, sys.executable, "-c", SENDER, str(count))
        out, err = receiver.communicate(timeout=30)
        assert receiver.returncode == 0, err
        return int(out), int(refused)
    finally:
        if receiver.poll() is None:
            receiver.kill()
        receiver.communicate(timeout=5)  # reaps it and closes the pipes


@needs_netns
@pytest.mark.parametrize(
    ("ns", "veth", "direction"), [(A, VETH_A, "egress"), (B, VETH_B, "ingress")]
)
def test_thirty_percent_loss(pair: None, ns: str, veth: str, direction: str) -> None:
    apply_loss(ns, Loss(veth, 0.3, direction))  # type: ignore[arg-type]
    sent = 2000
    received, refused = send_udp(sent)
    drops = dropped(ns)[(veth, direction)]  # type: ignore[index]
    assert 0.6 <= received / sent <= 0.8, received
    # the sender learns of egress drops in its own namespace (EPERM), not of others
    assert refused == (drops if direction == "egress" else 0), (refused, drops)
    # ARP is not IP and passes, so every missing datagram is one the rule counted
    assert abs(drops - (sent - received)) <= 0.01 * sent, (drops, sent - received)


@needs_netns
def test_no_loss_drops_nothing(pair: None) -> None:
    apply_loss(A, Loss(VETH_A, 0.0))
    assert send_udp(500) == (500, 0)
    assert dropped(A) == {(VETH_A, "ingress"): 0, (VETH_A, "egress"): 0}


@needs_netns
def test_apply_replaces_and_clear_removes(pair: None) -> None:
    apply_loss(A, [Loss(VETH_A, 0.5, "egress"), Loss("lo", 0.1, "ingress")])
    apply_loss(A, Loss(VETH_A, 0.2, "ingress"))
    assert dropped(A) == {(VETH_A, "ingress"): 0}
    clear_loss(A)
    clear_loss(A)  # idempotent
    assert sh("ip", "netns", "exec", A, "nft", "list", "tables") == ""
    with pytest.raises(NftError, match="No such file or directory"):
        dropped(A)


@needs_netns
def test_missing_namespace_is_an_nft_error() -> None:
    assert "frd-nowhere" not in netns_names()
    with pytest.raises(NftError, match="frd-nowhere"):
        apply_loss("frd-nowhere", Loss("eth0", 0.1))


def test_ruleset_text() -> None:
    text = loss_ruleset([Loss("veth0", 0.3, "egress"), Loss("br0", 0.00125)])
    assert text == (
        "add table inet fedring_lab\n"
        "delete table inet fedring_lab\n"
        "table inet fedring_lab {\n"
        "\tchain ingress {\n"
        "\t\ttype filter hook prerouting priority raw; policy accept;\n"
        '\t\tiifname "br0" numgen random mod 10000 < 12 counter drop\n'
        "\t}\n"
        "\tchain egress {\n"
        "\t\ttype filter hook postrouting priority filter; policy accept;\n"
        '\t\toifname "veth0" numgen random mod 10000 < 3000 counter drop\n'
        '\t\toifname "br0" numgen random mod 10000 < 12 counter drop\n'
        "\t}\n"
        "}\n"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interface": "eth0", "loss": 1.5}, r"loss=1.5 must be in \[0, 1\)"),
        ({"interface": "eth0", "loss": 1.0}, r"loss=1.0 must be in \[0, 1\)"),
        ({"interface": "eth0", "loss": -0.1}, r"loss=-0.1 must be in \[0, 1\)"),
        ({"interface": "eth0", "loss": float("nan")}, r"loss=nan must be in \[0, 1\)"),
        ({"interface": 'eth0"; flush', "loss": 0.1}, "interface='eth0\"; flush' must be"),
        ({"interface": "a-very-long-interface", "loss": 0.1}, "interface='a-very-long-"),
        ({"interface": "eth0", "loss": 0.1, "direction": "up"}, "direction='up' must be"),
    ],
)
def test_bad_loss_names_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Loss(**kwargs)  # type: ignore[arg-type]


def test_bad_namespace_and_duplicates_are_refused() -> None:
    with pytest.raises(ValueError, match=r"netns='\.\./etc' must be"):
        apply_loss("../etc", Loss("eth0", 0.1))
    with pytest.raises(ValueError, match="interface='eth0' has two egress losses"):
        loss_ruleset([Loss("eth0", 0.1), Loss("eth0", 0.2, "egress")])
