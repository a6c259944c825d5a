"""Training: the ``TrainState`` pytree and the one-function train step."""

from lmfunc.train.state import TrainState
from lmfunc.train.step import check_batch, make_eval_step, make_train_step

__all__ = ["TrainState", "check_batch", "make_eval_step", "make_train_step"]
