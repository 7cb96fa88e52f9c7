"""Chat sessions: the session model (session.py), the store interface and its Redis and in-memory
stores, the turn service (turns.py), the routes and the browser edge. `install(app, state)` wires it.

See docs/sessions.md (the feature) and docs/sessions-api.md (the contract with the web UI).
"""
from chatserve.server.sessions.memory_store import MemorySessionStore
from chatserve.server.sessions.redis_store import RedisSessionStore
from chatserve.server.sessions.routes import install, routes
from chatserve.server.sessions.session import Session
from chatserve.server.sessions.store import SessionStore, StoreUnavailable, new_session_id, valid_session_id
from chatserve.server.sessions.store_choice import make_session_store

__all__ = ["MemorySessionStore", "RedisSessionStore", "Session", "SessionStore", "StoreUnavailable",
           "install", "make_session_store", "new_session_id", "routes", "valid_session_id"]
