"""A member's ``bye``: what the coordinator takes from it is checked first (a bye is
network input, from any member holding the job key).

`read_counters` takes its ``counters``, which the summary shows under
``agent_counters`` for a ring, star or asynchronous job and for a pipeline's stages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_COUNTERS = 512  # names in one bye's counters (fedring bumps about 150)
MAX_COUNTER_NAME = 64  # characters in one name (the longest fedring bumps has 28)


@dataclass(frozen=True)
class ByeCounters:
    """A member's counters from its ``bye``: accepted, or refused with the reason."""

    counters: dict[str, int]
    refused: str = ""  # why the whole object was left out ('' if it was not)


def read_counters(bye: Mapping[str, Any]) -> ByeCounters:
    """The ``counters`` of a member's `bye`: an object of at most `MAX_COUNTERS` names
    (strings of 1 to `MAX_COUNTER_NAME` characters), each a non-negative integer. Absent
    (an older agent): none. Anything else is refused whole, the reason naming the field
    and the value (shortened: a bye may be a megabyte).

        >>> read_counters({"counters": {"pp-act_sent": 40}})
        ByeCounters(counters={'pp-act_sent': 40}, refused='')
        >>> read_counters({"counters": {"duplicate": -1}}).refused
        "field 'counters' entry 'duplicate' = -1: not a non-negative integer"
    """
    raw = bye.get("counters", {})
    if not isinstance(raw, dict):
        return ByeCounters({}, f"field 'counters' = {raw!r:.60}: not an object")
    if len(raw) > MAX_COUNTERS:
        return ByeCounters({}, f"field 'counters' has {len(raw)} names, more than {MAX_COUNTERS}")
    for name, value in raw.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_COUNTER_NAME:
            return ByeCounters({}, f"field 'counters' name {name!r:.80}: not a string of 1 to "
                                   f"{MAX_COUNTER_NAME} characters")  # fmt: skip
        if type(value) is not int or value < 0:  # bool is an int: true is no count
            return ByeCounters({}, f"field 'counters' entry {name!r} = {value!r:.40}: not a "
                                   "non-negative integer")  # fmt: skip
    return ByeCounters(dict(raw))
