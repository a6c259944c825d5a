"""lmfunc: functional LLM pretraining on PyTorch.

Models are pure functions over parameter pytrees, the optimizer is optax-style, and the
training step is one compiled function ``step(state, batch) -> (state, metrics)``.
"""

from lmfunc import tree
from lmfunc.grad import value_and_grad

__version__ = "0.1.0"

__all__ = ["tree", "value_and_grad", "__version__"]
