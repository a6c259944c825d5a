import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def torchrun():
    """``torchrun(nproc, args, timeout=600)``: a multi-rank run from the repository root that must exit 0."""
    from tests.helpers import run_torchrun

    return run_torchrun


@pytest.fixture
def tiny_state():
    """``tiny_state(tx, loss_scale=None)``: a ``TrainState`` of the ``tiny`` preset initialised with seed 0."""
    from lmfunc import model
    from lmfunc.config import model_preset
    from lmfunc.train import TrainState

    def make(tx, loss_scale=None):
        return TrainState.create(model.init(model_preset("tiny"), seed=0), tx, loss_scale=loss_scale)

    return make
