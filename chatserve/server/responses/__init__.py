"""OpenAI's Responses API on the chat pipeline: request translation (inputs.py), output items and typed
events (events.py), the stored chain (store.py), the service and its thin routes."""
from chatserve.server.responses.routes import install, routes

__all__ = ["install", "routes"]
