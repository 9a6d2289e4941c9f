"""`fedring.connect`: this process's `Group` over a real MQTT broker, found by rendezvous.

The MQTT counterpart of `fedring.local_group`, and of torch.distributed's
``init_process_group(init_method=..., world_size=..., rank=...)`` with the broker
as its store::

    with fedring.connect("mqtt://broker.lan:1883", job="j1", agent_id="pi-1", world=4,
                         key=b"shared secret") as group:
        reducer = fedring.Reducer(group.collective, numel, fedring.ReducerSettings())

How agents find each other: each opens an `MqttLink` whose retained presence
(``agents/{id}/status``, the topic the daemons already use) names the job, and
waits until `world` agents, itself included, are online in that job. The members
are their ids, sorted; a rank is a place in that order, so every member builds the
same ring without a coordinator. No new topic: the example ACL works as it is,
with each agent's user name its id.

Refused before anything is sent: an id that is already online at the broker
(`DuplicateAgent`; connecting under it would take over the holder's MQTT session
and disconnect it), more agents in the job than `world` (`TooManyAgents`), and too
few of them within `wait_s` (`RendezvousTimeout`, naming who came and how many are
missing). A dead broker raises the transport's `BrokerUnreachable`, a refused
login `BrokerRefused`, both unchanged. A broker that Nagles small messages (no
``set_tcp_nodelay true``) is reported with a warning that names the fix
(`MqttLink.check_broker_nagle`, anonymous links only; ``group.link.broker_nagle``).

The group's frames name the job and a tag of its members' link sessions
(``j1.3fa2c1d0``): the broker keeps each id's session between runs, and frames
queued there for an earlier run of the same job are refused as another job's
rather than summed into this one. Agents of one job must agree on `world` and
`key`; a wrong key shows as refused frames (``bad_mac``) in the first collective.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fedring.collective.channel import PeerChannel
from fedring.collective.fanout import COLLECTIVES
from fedring.counters import Counters
from fedring.engine.group import Group
from fedring.transport import topics
from fedring.transport.base import Deadline
from fedring.transport.mqtt import BrokerConfig, MqttLink
from fedring.transport.mqtt_peek import peek_retained
from fedring.wire.errors import FrameError
from fedring.wire.jsondoc import parse_document

log = logging.getLogger(__name__)

TOPOLOGIES = ("auto", "ring", "torus")
_POLL_S = 0.05  # how often the rendezvous looks at presence


class RendezvousError(Exception):
    """The group could not be formed at the broker."""


class DuplicateAgent(RendezvousError):
    """Another process is online at the broker under this agent id."""


class TooManyAgents(RendezvousError):
    """More agents are online in the job than its `world`."""


class RendezvousTimeout(RendezvousError, TimeoutError):
    """Fewer than `world` agents joined the job before the wait ran out."""

    def __init__(self, job: str, world: int, present: tuple[str, ...], waited_s: float) -> None:
        self.job, self.world, self.present, self.waited_s = job, world, present, waited_s
        self.missing = world - len(present)
        super().__init__(
            f"job {job!r}: {len(present)} of {world} agents after {waited_s:.1f} s, "
            f"{self.missing} missing (present: {', '.join(present)})"
        )


@dataclass
class MqttGroup(Group):
    """A `Group` whose members met at a broker: `close` it, or use it in ``with``."""

    link: MqttLink = field(kw_only=True, repr=False)

    def close(self) -> None:
        """Leave: retained status "offline" (peers see "left"), then disconnect. Idempotent."""
        self.link.close()

    def __enter__(self) -> MqttGroup:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def connect(
    broker: str | BrokerConfig, *, job: str, agent_id: str, world: int, key: bytes,
    username: str | None = None, password: str | None = None, topology: str = "auto",
    timeout_s: float = 60.0, wait_s: float = 120.0, counters: Counters | None = None,
    collective: str = "ring",
) -> MqttGroup:  # fmt: skip
    """Join `job` at `broker` as `agent_id` and return this member's group.

    Parameters
    ----------
    broker
        ``mqtt://HOST[:PORT]`` or ``mqtts://HOST[:PORT]``, or a `BrokerConfig`
        (TLS files, keep-alive, MQTT version).
    job, agent_id
        Topic-safe ids (letters, digits, ``_.-``); ``coordinator`` is reserved.
    world
        How many agents form the group, this one included; all must say the same.
    key
        The job's shared secret: every frame is sealed with it (`fedring.wire.seal`).
    username, password
        Broker credentials (with the example ACL, the user name is `agent_id`).
    topology
        ``auto`` (a torus of rings from 9 members where it has fewer steps), ``ring``
        or ``torus``, as in `fedring.local_group`.
    timeout_s
        Deadline of every step of a collective.
    collective
        How a sum travels: ``ring`` (2(N-1) steps; the `topology`'s torus), ``fanout``
        (each member broadcasts its payload once on the job's broadcast topic and sums
        all N) or ``hub`` (rank 0 sums and broadcasts once): one or two broker steps
        where a round is latency (`docs/lab.md`). All must say the same.
    wait_s
        The longest `connect` waits, for the broker and for the other agents.

    Raises
    ------
    DuplicateAgent, TooManyAgents, RendezvousTimeout
        The group could not be formed (all are `RendezvousError`).
    BrokerUnreachable, BrokerRefused
        From the transport, unchanged.
    """
    _check(job, agent_id, world, key, topology, timeout_s, wait_s)
    if collective not in COLLECTIVES:
        raise ValueError(
            f"collective {collective!r} must be one of {', '.join(COLLECTIVES)} (auto is "
            "planned by the coordinator, from every agent's probe)"
        )
    started = time.monotonic()
    deadline = Deadline(started + wait_s)
    cfg = broker if isinstance(broker, BrokerConfig) else BrokerConfig.parse(broker)
    if username is not None:
        cfg = dataclasses.replace(cfg, username=username, password=password)
    holder = online_status(_within(cfg, deadline), agent_id)
    if holder is not None:
        where = f"in job {holder['job']!r}" if holder.get("job") else "outside any job"
        raise DuplicateAgent(
            f"agent id {agent_id!r} is already online at {cfg.url} {where} (session "
            f"{holder.get('session', '?')}): pick another id; if its process has just died, "
            "the broker marks it lost within 1.5 keep-alives"
        )
    link = MqttLink(_within(cfg, deadline), agent_id, control_from=(), counters=counters, job=job)
    link.connect()
    try:
        link.check_broker_nagle()  # a warning naming the fix, counted as broker_nagle
        sessions = _rendezvous(link, world, deadline, started)
        members = tuple(sorted(sessions))
        tag = hashlib.sha256(" ".join(f"{m}:{sessions[m]}" for m in members).encode())
        channel = PeerChannel(
            link.endpoint(job), f"{job}.{tag.hexdigest()[:8]}", key=key, counters=link.counters
        )
        group = MqttGroup(channel, members, topology, timeout_s, algorithm=collective, link=link)
    except BaseException:
        link.close()
        raise
    log.info("%s joined %s at %s: rank %d, %s", agent_id, channel.job, cfg.url, group.rank,
             group.layout)  # fmt: skip
    return group


def _check(
    job: str, agent_id: str, world: int, key: bytes, topology: str, timeout_s: float,
    wait_s: float,
) -> None:  # fmt: skip
    """Refuse bad arguments before touching the network (`ValueError` naming the field)."""
    topics.check_id("job", job)
    topics.check_id("agent_id", agent_id)
    if agent_id == topics.COORDINATOR:
        raise ValueError(f"agent_id {agent_id!r} is reserved for the coordinator")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a whole number >= 1, not {world!r}")
    if not isinstance(key, bytes | bytearray) or not key:
        raise ValueError("key must be non-empty bytes: every frame is signed with it")
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology {topology!r} must be one of {', '.join(TOPOLOGIES)}")
    for name, value in (("timeout_s", timeout_s), ("wait_s", wait_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, not {value!r}")


def _within(cfg: BrokerConfig, deadline: Deadline) -> BrokerConfig:
    """`cfg` whose broker connection gives up by `deadline` (or sooner, as configured)."""
    wait = max(min(cfg.connect_timeout_s, deadline.remaining()), 0.1)
    return dataclasses.replace(cfg, connect_timeout_s=wait)


def _rendezvous(link: MqttLink, world: int, deadline: Deadline, started: float) -> dict[str, str]:
    """Wait until `world` agents are online in the link's job: id -> link session."""
    job = link.job or ""
    while True:
        present = {link.me: link.session, **link.peers_in(job)}
        if len(present) > world:
            raise TooManyAgents(
                f"job {job!r} has {len(present)} agents online for a world of {world}: "
                f"{', '.join(sorted(present))}"
            )
        if len(present) == world:
            return present
        if deadline.expired:
            raise RendezvousTimeout(job, world, tuple(sorted(present)), time.monotonic() - started)
        time.sleep(min(_POLL_S, deadline.remaining()))


def online_status(cfg: BrokerConfig, agent: str) -> dict[str, Any] | None:
    """`agent`'s retained status if it says online (someone holds the id), else None.

    Read by a short-lived client under another client id, which publishes nothing
    and leaves no session behind: connecting as ``fedring-{agent}`` itself would
    take over the holder's session and disconnect it.
    """
    if cfg.username is not None:
        # The documented broker binds client ids to user names
        # (use_username_as_clientid): a peek under the agent's user would itself take
        # over the holder's session, and the broker keeps one session per user anyway.
        return None
    topic = topics.status(agent)
    who = f"{agent!r}" + (f" as user {cfg.username!r}" if cfg.username else " anonymously")
    seen = list(peek_retained(cfg, [topic], who=who).values())
    for payload in seen:
        try:
            doc = parse_document(payload, what="status")
        except FrameError as exc:
            log.warning("the retained status of %r is unreadable: %s", agent, exc)
            continue
        if doc.get("state") == "online":
            return doc
    return None
