"""A member killed mid-round: the harness the ring and the one-step collectives share."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from fedring.collective import PeerChannel
from fedring.transport import InprocTransport

NAMES = ("a", "b", "c")


def kill_c_mid_round(
    make: Callable[[PeerChannel, tuple[str, ...]], Any],
) -> tuple[dict[str, BaseException], float, dict[str, Any]]:
    """a and b all-reduce with c, which never sends and is killed 0.2 s in; returns what
    each raised, the seconds until both gave up, and the collectives."""
    hub = InprocTransport()
    cols = {n: make(PeerChannel(hub.connect(n), "job", key=b"k"), NAMES) for n in NAMES[:2]}
    hub.connect("c")
    errors: dict[str, BaseException] = {}

    def member(name: str) -> None:
        try:
            cols[name].allreduce_dense(torch.ones(300))
        except BaseException as exc:
            errors[name] = exc
            cols[name].channel.endpoint.close()  # as a failed agent leaves the group

    threads = [threading.Thread(target=member, args=(n,)) for n in cols]
    start = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(0.2)
    hub.kill("c")
    for t in threads:
        t.join(10)
    return errors, time.monotonic() - start, cols
