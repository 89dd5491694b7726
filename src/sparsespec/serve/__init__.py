"""Serving the engine: an OpenAI-compatible HTTP server (``sparsespec serve``) and a terminal chat
(``sparsespec chat``)."""
