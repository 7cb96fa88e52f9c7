"""Session tests: the redis_server fixture lives in tests/conftest.py; session_fakes sits beside this file."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
