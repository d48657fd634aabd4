"""The OpenAI-compatible HTTP server (FastAPI): `build_app(engine, served_model_name, ...)`."""
from kvserve.server.app import build_app

__all__ = ["build_app"]
