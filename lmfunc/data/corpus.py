"""Text that needs no download: the embedded default corpus and plain text files.

The default corpus is ``pydoc_data.topics``: the Python Language Reference topics (English
prose with code examples, about 465 kB) that every CPython installation ships for ``help()``.
Each topic is one document, in sorted topic order.
"""

from __future__ import annotations

import re

from lmfunc.config.model import ConfigError


def embedded_documents() -> list[str]:
    """The Python reference topics, one document each, sorted by topic name."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise ConfigError(
            "this Python installation has no pydoc_data module, which holds the embedded default "
            "corpus; train on your own text with --data.text-file FILE"
        ) from None
    return [topics[name].strip() for name in sorted(topics) if topics[name].strip()]


def text_file_documents(path: str) -> list[str]:
    """The paragraphs (separated by blank lines) of the UTF-8 text file ``path``, one document each."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"data.text_file: {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"data.text_file: {path} is a directory; pass one UTF-8 text file") from None
    except OSError as err:
        raise ConfigError(f"data.text_file: {path} cannot be read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"data.text_file: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    documents = [doc.strip() for doc in re.split(r"\n\s*\n", text) if doc.strip()]
    if not documents:
        raise ConfigError(f"data.text_file: {path} holds no text")
    return documents
