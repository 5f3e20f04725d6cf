"""Serving: an OpenAI-compatible HTTP server (``graphgen serve``) over the :class:`ServingEngine`
interface (``engine_api``). Needs the ``serve`` extra (FastAPI, uvicorn, prometheus_client);
nothing here is imported by the build path. See docs/serve.md."""
