"""Data: tokenizers, the embedded corpus, datasets and batches (data flows model-ward from here)."""
