"""Serving: the continuous-batching engine (:mod:`llm.serve.engine`) and the OpenAI-compatible
HTTP API over it (:mod:`llm.serve.http`)."""

from llm.serve.engine import Engine, QueueFull, Sequence

__all__ = ["Engine", "QueueFull", "Sequence"]
