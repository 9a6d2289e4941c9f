"""Every test here may build a flwr `Message` by hand, which reads the process's task
identity: set it as a SuperNode (and `InProcessGrid`) would, so that no test depends on
an earlier one in the same worker having set it."""

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
