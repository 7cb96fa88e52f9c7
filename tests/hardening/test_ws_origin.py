"""WebSocket Origin check (issue 14 item 8): a page on another origin cannot drive the model through its
visitors' browsers; same-origin pages, non-browser clients and the operator's --cors-origin list can."""
from __future__ import annotations

import pytest
from hardening_support import start_fake_server
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

pytestmark = pytest.mark.timeout(60)
HELLO = '{"id": "a", "type": "chat.completions", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'


def _talks(url: str, origin: str | None) -> bool:
    """True when the handshake succeeds and a request is answered; False when the server refuses."""
    try:
        with ws_connect(url, origin=origin, open_timeout=10) as ws:
            ws.send(HELLO)
            return bool(ws.recv(timeout=10))
    except InvalidStatus as e:
        assert e.response.status_code == 403
        return False


@pytest.fixture(scope="module")
def servers():
    plain = start_fake_server()
    trusting = start_fake_server(cors_origins=("https://app.example.com",))
    yield plain, trusting
    plain.stop()
    trusting.stop()


def test_websocket_origin_check(servers):
    plain, trusting = servers
    url = plain.url.replace("http", "ws") + "/v1/ws"
    own = plain.url                                   # http://127.0.0.1:PORT, what Host names
    assert _talks(url, None)                          # not a browser (SDKs, curl, the bench tools)
    assert _talks(url, own)                           # the UI served by this server
    for evil in ("https://evil.example", "null", own + ".evil.example", "http://127.0.0.1:1",
                 "file://", "https://app.example.com"):
        assert not _talks(url, evil), evil
    turl = trusting.url.replace("http", "ws") + "/v1/ws"
    assert _talks(turl, "https://app.example.com")    # --cors-origin is trusted
    assert not _talks(turl, "https://evil.example")
