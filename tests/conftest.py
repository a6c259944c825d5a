import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with empty Dynamo caches. Every ``make_train_step`` compiles the same code
    object with new closures, and Dynamo counts those against one recompile limit (8) per code
    object for the whole process."""
    yield
    torch._dynamo.reset()
