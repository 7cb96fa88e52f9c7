"""HTTP routes for chat sessions and the bundled web UI (stub; filled in by issue 7).

Not the store itself (see sessions.py) and not the OpenAI routes (see the server app).
"""
from __future__ import annotations

from typing import Any

routes: list = []


def install(app: Any, state: Any) -> None:
    """Attach session middleware/state to the app (stub: does nothing yet)."""
    return None
