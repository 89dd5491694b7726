"""sparsespec: speculative decoding over budgeted KV caches, on CPU (exact in float32; see README)."""

__version__ = "0.1.0"
