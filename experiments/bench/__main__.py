"""``python -m experiments.bench``: the train-step benchmark (``experiments.bench.train_step``)."""

from experiments.bench.train_step import cli
from lmfunc.train.__main__ import exit_without_finalizing

cli()
exit_without_finalizing()  # gloo's threads can abort a finalizing interpreter (see there)
