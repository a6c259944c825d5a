"""On-disk cache of index arrays, keyed by the MD5 of a description of everything they depend on.

Files: ``{md5}-{class}-{split}-{name}.npy`` plus ``...-description.txt``. Each file is written
under a temporary name and renamed; the description is renamed last and marks the cache complete,
so a reader never loads a partial cache and concurrent builders of the same cache cannot corrupt it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Callable, Optional

import numpy as np


def _replace_with(path: str, write: Callable, suffix: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def cached_arrays(description: dict, build: Callable[[], dict[str, np.ndarray]],
                  cache_dir: Optional[str]) -> dict[str, np.ndarray]:
    """``build()``'s named arrays, loaded (memory-mapped) from ``cache_dir`` when a complete cache for
    ``description`` exists, else built and saved there. ``cache_dir=None`` always builds."""
    if cache_dir is None:
        return build()
    text = json.dumps(description, indent=4, sort_keys=True)
    digest = hashlib.md5(text.encode()).hexdigest()
    stem = os.path.join(cache_dir, f"{digest}-{description['class']}-{description['split']}")
    marker = stem + "-description.txt"
    if os.path.isfile(marker):
        with open(marker) as f:
            names = json.load(f)["arrays"]
        return {name: np.load(f"{stem}-{name}.npy", mmap_mode="r") for name in names}
    os.makedirs(cache_dir, exist_ok=True)
    arrays = build()
    for name, array in arrays.items():
        _replace_with(f"{stem}-{name}.npy", lambda f, a=array: np.save(f, a, allow_pickle=False), ".npy")
    record = json.dumps({**description, "arrays": sorted(arrays)}, indent=4, sort_keys=True)
    _replace_with(marker, lambda f: f.write(record.encode()), ".txt")
    return arrays
