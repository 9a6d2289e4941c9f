"""The MQTT manifest names only the members an agent exchanges with."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fedring.collective.torus import build_ring, contacts


@pytest.mark.parametrize("topology", ["ring", "torus", "auto", "star"])
def test_a_member_needs_only_its_contacts_names(topology: str) -> None:
    """The MQTT manifest names only `contacts`: every ring a member is on (the flat
    one and each grid axis) finds its left and right neighbours among them."""
    for world in range(1, 41):
        names = [f"agent-{i}" for i in range(world)]
        for rank in range(world):
            known = contacts(topology, world, rank)
            view = tuple(names[i] if i in known else f"~{i}" for i in range(world))
            channel = SimpleNamespace(name=names[rank])
            c = build_ring(channel, view, topology, 1.0)  # type: ignore[arg-type]
            rings = [c.flat, *getattr(c, "axes", [])]
            for ring in rings:
                assert not ring.left.startswith("~") and not ring.right.startswith("~")
            assert len(known) <= 3 + 2 * len(getattr(c, "axes", []))
