"""sparsespec: exact speculative decoding over budgeted KV caches, on CPU."""

__version__ = "0.1.0"
