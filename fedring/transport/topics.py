"""MQTT topic names, all under ``fedring/v1/`` (see ARCHITECTURE.md, "Transports").

An inbox topic ends with the *sender's* id: ``jobs/{job}/to/{dst}/{src}``. The
broker's ACL lets a client publish only where that last level is its own user
name (``pattern write fedring/v1/jobs/+/to/+/%u``), so the broker, not the frame,
vouches for who sent it; the frame's seal then ties it to the job. This adds one
level to the architecture's ``jobs/{job}/to/{id}``: without it a receiver could not
tell one sender from another before decoding, and any agent could pose as the
coordinator.

    >>> inbox("job1", "a2", "a1")
    'fedring/v1/jobs/job1/to/a2/a1'
    >>> parse_inbox("fedring/v1/jobs/job1/to/a2/a1")
    ('job1', 'a2', 'a1')
"""

from __future__ import annotations

import re

ROOT = "fedring/v1"
COORDINATOR = "coordinator"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class TopicError(ValueError):
    """An id that cannot be a topic level (empty, wildcards, slashes, too long)."""


def check_id(kind: str, value: str) -> str:
    """`value` if it is a safe topic level; otherwise a `TopicError` naming `kind`."""
    if not _ID.match(value):
        raise TopicError(
            f"{kind} {value!r} must be 1-64 characters of letters, digits, '_', '.', '-' "
            "(no '/', '+', '#' or spaces), starting with a letter or digit"
        )
    return value


def status(agent: str) -> str:
    return f"{ROOT}/agents/{agent}/status"


def hello(agent: str) -> str:
    return f"{ROOT}/agents/{agent}/hello"


def beat(agent: str) -> str:
    """A link's heartbeat (QoS 0, not retained): how a watcher sees a hung board."""
    return f"{ROOT}/agents/{agent}/beat"


def probe(agent: str) -> str:
    return f"{ROOT}/agents/{agent}/probe"


def manifest(job: str) -> str:
    return f"{ROOT}/jobs/{job}/manifest"


def inbox(job: str, dst: str, src: str) -> str:
    return f"{ROOT}/jobs/{job}/to/{dst}/{src}"


def broadcast(job: str, src: str) -> str:
    """A job's broadcast topic, one per sender: ``jobs/{job}/all/{src}``. As with the
    inboxes, the ACL lets a client write only where the last level is its user name
    (``pattern write fedring/v1/jobs/+/all/%u``); one publish reaches every member.

    >>> broadcast("job1", "a1")
    'fedring/v1/jobs/job1/all/a1'
    """
    return f"{ROOT}/jobs/{job}/all/{src}"


def job_broadcasts(job: str) -> str:
    """Subscription for every member's broadcasts in `job`."""
    return f"{ROOT}/jobs/{job}/all/+"


def parse_broadcast(topic: str) -> tuple[str, str] | None:
    """(job, src) of a broadcast topic, or None.

    >>> parse_broadcast("fedring/v1/jobs/job1/all/a1")
    ('job1', 'a1')
    """
    parts = topic.split("/")
    if len(parts) == 6 and "/".join(parts[:2]) == ROOT and parts[2] == "jobs" and parts[4] == "all":
        return parts[3], parts[5]
    return None


def star(job: str) -> str:
    """The topic-level job of a star's exchanges with the coordinator, apart from its
    control messages (both come from the coordinator's id).

    >>> star("digits-1a2b")
    'digits-1a2b.star'
    """
    return check_id("job", f"{job}.star")


def is_star(job: str) -> bool:
    """Whether a topic-level job is a star's exchanges (`star`), not a job's own.

    >>> is_star(star("digits-1a2b")), is_star("digits-1a2b")
    (True, False)
    """
    return job.endswith(".star")


def my_inboxes(me: str) -> str:
    """Subscription for every job's inbox of `me`, from any sender."""
    return f"{ROOT}/jobs/+/to/{me}/+"


def metrics(job: str, agent: str) -> str:
    return f"{ROOT}/jobs/{job}/metrics/{agent}"


def parse_inbox(topic: str) -> tuple[str, str, str] | None:
    """(job, dst, src) of an inbox topic, or None."""
    parts = topic.split("/")
    if len(parts) == 7 and "/".join(parts[:2]) == ROOT and parts[2] == "jobs" and parts[4] == "to":
        return parts[3], parts[5], parts[6]
    return None


def parse_agent_topic(topic: str) -> tuple[str, str] | None:
    """(agent, leaf) of ``agents/{id}/{leaf}``, or None."""
    parts = topic.split("/")
    if len(parts) == 5 and "/".join(parts[:2]) == ROOT and parts[2] == "agents":
        return parts[3], parts[4]
    return None
