"""`make_lab`: a fixture that builds labs in the test's folder and, at teardown,
closes them and fails the test if anything of theirs is left."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fedring.lab.lab import Lab
from tests.lab.labcheck import leftovers


@pytest.fixture
def make_lab(tmp_path: Path) -> Iterator[Callable[..., Lab]]:
    made: list[Lab] = []

    def make(agents: int, bandwidth_mbps: float, **options: Any) -> Lab:
        lab = Lab(agents, bandwidth_mbps, workdir=tmp_path / f"lab{len(made)}", **options)
        made.append(lab)
        return lab.__enter__()

    yield make
    for lab in made:
        lab.close()
    left = [item for lab in made for item in leftovers(lab.workdir)]
    assert left == [], f"the lab left {left}"
