"""Helpers for browser tests: a live uvicorn server in a thread and how to launch Debian's Chromium."""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "sessions"))

CHROMIUM = os.environ.get("CHATSERVE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]


class LiveServer:
    """Runs an ASGI app with uvicorn on a free port in a background thread (its own event loop)."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        import uvicorn
        from session_fakes import free_port
        self.port = port or free_port()
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    ws="websockets-sansio" if _has_sansio() else "auto",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def kill(self) -> None:
        """Stop at once, as a crash would: open streams and sockets are cut, not drained."""
        self.server.should_exit = True
        self.server.force_exit = True
        self.thread.join(timeout=15)


def _has_sansio() -> bool:
    try:
        import uvicorn.protocols.websockets.websockets_sansio_impl  # noqa: F401
        return True
    except ImportError:
        return False




class ServeProcess:
    """`python -m chatserve.cli serve` in a subprocess (the real app, engine and model)."""

    def __init__(self, model: str, log_path: Path, *extra: str) -> None:
        import subprocess
        from session_fakes import free_port
        self.port = free_port()
        self.log_path = log_path
        self.args = [sys.executable, "-m", "chatserve.cli", "serve", "--model", model, "--port", str(self.port),
                     "--stats-interval", "0", *extra]
        self._subprocess = subprocess
        self.proc: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServeProcess":
        import httpx
        root = Path(__file__).resolve().parents[2]
        self.log = open(self.log_path, "a")
        self.proc = self._subprocess.Popen(self.args, cwd=root, stdout=self.log, stderr=self.log,
                                           env={**os.environ, "PYTHONPATH": str(root)})
        deadline = time.monotonic() + 600   # bounds a hang; a crash is seen at once (poll)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(self.log_path.read_text()[-3000:])
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()                 # __exit__ does not run when __enter__ raises
                self.proc.wait()
                raise RuntimeError("chatserve serve did not become ready:\n" + self.log_path.read_text()[-3000:])
            time.sleep(0.2)

    def __exit__(self, *exc: Any) -> None:
        import signal
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except self._subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
