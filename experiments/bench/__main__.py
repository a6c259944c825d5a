"""``python -m experiments.bench``: the train-step benchmark (``experiments.bench.train_step``)."""

from experiments.bench.train_step import cli

cli()
