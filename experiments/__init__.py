"""Benchmarks and studies of lmfunc (not part of the installed package): run from the repository
root as ``python -m experiments.<study>``."""
