"""Groups: who trains together, this member's rank, and the layout of their collective.

    groups = fedring.local_group(4)            # four in-process members, one per thread
    group = groups[rank]
    group.rank, group.members, group.layout    # 0, ('agent-0', ...), 'ring of 4'

A `Group` wraps a `PeerChannel` (frames over a transport endpoint) and builds the
collective the layout asks for: a flat ring, or from 9 members up a torus of rings
(``topology="auto"``). `local_group` connects members through the in-process
transport (the embedded default and a test aid). Over MQTT, `fedring.connect`
(in `fedring.rendezvous`, above the engine) meets `world` agents of a job on the
broker, and the agent daemon builds its group from the coordinator's manifest:
the way `torch.distributed.init_process_group` hands DDP its process group.

Timeouts: the group's `timeout_s` (here, `local_group`, `fedring.connect`) is the
one deadline of every collective step, and the source of every other: a
`DistributedOptimizer`'s start waits that long for rank 0, and a `Reducer` whose
`ReducerSettings.timeout_s` is None (the default) gives a star exchange the same.
Set `ReducerSettings.timeout_s` only to give a round trip through a star's centre
another deadline; it changes nothing else.

What crossed the wire: ``group.stats()`` (a `GroupStats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedring.collective.channel import PeerChannel
from fedring.collective.fanout import COLLECTIVES, Fanout, Hub
from fedring.collective.ring import Ring
from fedring.collective.torus import Torus, build_ring, layout_name
from fedring.counters import Counters
from fedring.engine.star import Centre
from fedring.transport.base import Endpoint
from fedring.transport.inproc import InprocTransport

LOCAL_KEY = b"fedring-local"  # frames of in-process groups are signed too
Collective = Ring | Torus | Fanout | Hub  # what a group's layout builds; a reducer runs over it


@dataclass(frozen=True)
class GroupStats:
    """What one member's endpoint carried so far, encoding and framing included.

    Attributes
    ----------
    bytes_sent, bytes_received : int
        Wire bytes of every frame this member sent or received (headers, seals and
        chunking included): what a link or a metered connection sees.
    frames_sent, frames_received : int
        Frames sent and received.
    payload_bytes_sent : int
        Encoded payload bodies only, before framing (what compression decides).
    refused : int
        Frames refused on arrival (malformed, bad seal, another job, too large...),
        by this member's counters; the log names each one.
    duplicates : int
        Repeats of a frame already taken (dropped, not refused).
    """

    bytes_sent: int
    bytes_received: int
    frames_sent: int
    frames_received: int
    payload_bytes_sent: int
    refused: int
    duplicates: int


@dataclass
class Group:
    """One member's view of its group."""

    channel: PeerChannel
    members: tuple[str, ...]
    topology: str = "auto"  # auto | ring | torus
    timeout_s: float = 60.0  # deadline of every collective step (and the engine's default)
    centre: Centre | None = None  # a star's centre; None: `STAR` on this channel
    algorithm: str = "ring"  # the job's `collective`: ring (or torus) | fanout | hub
    collective: Collective = field(init=False)

    def __post_init__(self) -> None:
        if self.algorithm == "fanout":
            self.collective = Fanout(self.channel, self.members, self.timeout_s)
        elif self.algorithm == "hub":
            self.collective = Hub(self.channel, self.members, self.timeout_s)
        elif self.algorithm == "ring":
            self.collective = build_ring(self.channel, self.members, self.topology, self.timeout_s)
        else:
            raise ValueError(f"collective {self.algorithm!r} is not one of {COLLECTIVES}")

    @property
    def rank(self) -> int:
        return self.members.index(self.channel.name)

    @property
    def world(self) -> int:
        return len(self.members)

    def stats(self) -> GroupStats:
        """Bytes and frames this member sent and received, and frames it refused.

        Counts are this member's since its endpoint opened (all jobs on that
        endpoint). Members of a `local_group` given one shared `counters` share
        `refused` and `duplicates` (the job's totals); by default each counts its own.
        """
        link = self.channel.endpoint.stats
        counts = self.channel.counters.snapshot()
        return GroupStats(
            bytes_sent=link.bytes_sent, bytes_received=link.bytes_received,
            frames_sent=link.frames_sent, frames_received=link.frames_received,
            payload_bytes_sent=self.channel.payload_bytes_sent,
            refused=sum(v for k, v in counts.items() if k.startswith("frame_")),
            duplicates=counts.get("duplicate", 0),
        )  # fmt: skip

    @property
    def layout(self) -> str:
        if self.algorithm != "ring":
            return f"{self.algorithm} of {self.world}"
        return layout_name(self.topology, self.world)

    @classmethod
    def on(
        cls, endpoint: Endpoint, members: tuple[str, ...], *, job: str, key: bytes | None,
        topology: str = "auto", timeout_s: float = 60.0, counters: Counters | None = None,
        algorithm: str = "ring", **channel: object,
    ) -> Group:  # fmt: skip
        """The group of `members` as seen from `endpoint` (one of them)."""
        ch = PeerChannel(endpoint, job, key=key, counters=counters, **channel)  # type: ignore[arg-type]
        return cls(ch, members, topology, timeout_s, algorithm=algorithm)


def local_group(
    n: int, *, job: str = "local", topology: str = "auto", timeout_s: float = 60.0,
    hub: InprocTransport | None = None, counters: Counters | None = None,
    algorithm: str = "ring",
) -> list[Group]:  # fmt: skip
    """`n` members connected in-process, one `Group` per member (run each on a thread).

    Parameters
    ----------
    n : int
        Members, named ``agent-0`` ... ``agent-{n-1}``; rank 0 is ``agent-0``.
    timeout_s : float
        The deadline of every collective step, and the default of every other wait
        of the engine (see the module docstring); a member that waits longer for a
        peer raises `CollectiveTimeout` (`StepMismatch` when the peer is on another step).
    counters : Counters, optional
        One set of counters for all members (a job's totals); by default each member
        has its own, which `Group.stats` reads.
    """
    if n < 1:
        raise ValueError(f"a group needs at least one member, not {n}")
    hub = hub or InprocTransport()
    names = tuple(f"agent-{i}" for i in range(n))
    return [
        Group.on(hub.connect(name), names, job=job, key=LOCAL_KEY, topology=topology,
                 timeout_s=timeout_s, counters=counters or Counters(), algorithm=algorithm)
        for name in names
    ]  # fmt: skip
