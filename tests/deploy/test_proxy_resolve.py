"""docker/haproxy.cfg starts while a replica's name does not resolve, and picks the replica up at run time.

Compose resolves `chatserve-2` only while that container exists; a proxy that resolved names only at
start crash-looped whenever one replica was down. Here the replica names are served by a stub DNS
server (the config's `parse-resolv-conf` swapped for it), replica 1's name first unknown, then known.
"""
from __future__ import annotations

import http.server
import threading
import urllib.request
from pathlib import Path

import pytest

from dns_stub import DnsStub
from proxy_run import CFG, Proxy, free_port, haproxy_exe

pytestmark = [pytest.mark.timeout(120)]


class _Replica(http.server.ThreadingHTTPServer):
    def __init__(self, name: str) -> None:
        self.name = name

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = name.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.read().decode()


@pytest.fixture
def replicas():
    servers = [_Replica("one"), _Replica("two")]
    yield servers
    for s in servers:
        s.shutdown()
        s.server_close()


def test_proxy_starts_with_a_replica_unresolved_and_picks_it_up(tmp_path: Path, replicas):
    if haproxy_exe() is None:
        pytest.skip("haproxy not installed")
    dns = DnsStub()
    cfg_text = CFG.read_text()
    assert "parse-resolv-conf" in cfg_text, "the proxy must resolve replica names at run time"
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(cfg_text.replace("parse-resolv-conf", f"nameserver stub 127.0.0.1:{dns.port}"))
    one, two = replicas
    dns.records["replica-two.test"] = "127.0.0.1"
    proxy = Proxy([f"replica-one.test:{one.server_port}", f"replica-two.test:{two.server_port}"],
                  tmp_path / "haproxy.log", cfg=cfg)
    try:
        # Starts, and serves from the replica it can resolve.
        proxy.wait_states({"replica2": "UP"}, timeout=60)
        assert proxy.server_states().get("replica1") != "UP"
        status, body = _get(proxy.url + "/v1/models")
        assert (status, body) == (200, "two")
        # The missing replica's name appears: it is picked up without a restart.
        dns.records["replica-one.test"] = "127.0.0.1"
        proxy.wait_states({"replica1": "UP", "replica2": "UP"}, timeout=60)
        seen = {_get(proxy.url + "/v1/models", {"X-Session-Id": f"session-{i:04d}"})[1] for i in range(40)}
        assert seen == {"one", "two"}
        assert proxy.proc.poll() is None
    finally:
        proxy.stop()
        dns.close()
