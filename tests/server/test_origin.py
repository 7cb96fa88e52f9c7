"""The one same-origin rule (chatserve/server/origin.py) that the WebSocket handshake and the browser edge share."""
import pytest

from chatserve.server.origin import origin_allowed


@pytest.mark.parametrize("origin, host, allowed, ok", [
    (None, "h:8000", (), True),                                     # not a browser
    ("http://h:8000", "h:8000", (), True),                          # the server's own origin
    ("HTTP://H:8000/", "h:8000", (), True),                         # case and a trailing slash normalized
    ("http://h", "h:80", (), True),                                 # default port on either side
    ("https://h:443", "h", (), True),
    ("http://h:8001", "h:8000", (), False),                         # another port of this host
    ("https://evil.example", "h:8000", (), False),
    ("null", "h:8000", (), False),                                  # sandboxed frames, file: pages
    ("file://", "h:8000", (), False),
    ("http://h:8000", None, (), False),                             # no Host to compare with
    ("https://app.example", "h:8000", ("https://app.example/",), True),   # an operator-trusted origin
    ("https://any.example", "h:8000", ("*",), True),
])
def test_same_origin_rule(origin, host, allowed, ok):
    assert origin_allowed(origin, host, allowed) is ok
