"""Serving: the continuous-batching engine (:mod:`llm.serve.engine`) and the OpenAI-compatible
HTTP API over it (:mod:`llm.serve.http`)."""

from llm.utils.extras import require

require("serve", "starlette", "uvicorn", "pydantic", "prometheus_client", "llguidance")

from llm.serve.engine import Engine, QueueFull, Sequence  # noqa: E402

__all__ = ["Engine", "QueueFull", "Sequence"]
