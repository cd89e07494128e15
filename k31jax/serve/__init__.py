"""`k31jax serve`: an OpenAI- and Anthropic-compatible HTTP server over the continuous-batching
``Scheduler`` (``k31jax.generate``).

- ``create_app(scheduler, ServeSettings(model_name=..., api_key=...))``: the FastAPI app
  (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/v1/messages``,
  ``/v1/messages/count_tokens``, ``/health``, ``/metrics``).
- ``APIError``: an error answered in the calling API's own schema and status.
- ``ACCESS_LOG``: the ``logging`` logger of the access log (one INFO line per request).
"""

from ._app import ACCESS_LOG, ServeSettings, create_app, error_body
from ._metrics import render_metrics
from ._protocol import APIError

__all__ = ["ACCESS_LOG", "APIError", "ServeSettings", "create_app", "error_body", "render_metrics"]
