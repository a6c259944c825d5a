"""Benchmarks: the train step (``python -m experiments.bench``; its workload, paired timing and
settings in ``workload``, ``paired``, ``config``), the data pipeline (``experiments.bench.data``),
checkpoints (``experiments.bench.checkpoint``) and the collectives report (``--comm``, ``comm``)."""
