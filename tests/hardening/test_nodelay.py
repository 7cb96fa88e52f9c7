"""TCP_NODELAY on every accepted connection (issue 14 item 5), through `chatserve serve`'s own server
construction (serve.make_server) on the fake engine: asserted on the server's side of HTTP and WebSocket
connections, and 50 requests on one kept-alive connection stay far from Nagle's ~40 ms."""
from __future__ import annotations

import http.client
import socket
import statistics
import threading
import time
from dataclasses import replace

import pytest
from fakes import VOCAB, FakeTokenizer, fake_engine
from hardening_support import free_port
from websockets.sync.client import connect as ws_connect

from chatserve.config import EngineConfig, ServerConfig
from chatserve.server.app import build_app
from chatserve.server.serve import SOCKET_SEND_BUFFER, listener, make_server
from chatserve.server.state import single_model_state

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def served():
    cfg = EngineConfig(server=replace(ServerConfig(), host="127.0.0.1", port=free_port()))
    eng = fake_engine(cfg)
    state = single_model_state(cfg, eng, FakeTokenizer(), "fake-model", vocab_size=VOCAB)
    server = make_server(build_app(state), cfg, state.models)
    # the listening socket as `chatserve serve` binds it (uvicorn's bind_socket: proto 0, so asyncio
    # never sets TCP_NODELAY on what it accepts)
    sock = listener(server.config, SOCKET_SEND_BUFFER)
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    assert server.started
    yield server, cfg.server.port
    server.should_exit = True
    th.join(10)


def _server_side_nodelay(server) -> list[int]:
    """TCP_NODELAY of every connection the server holds, read from the accepted sockets."""
    out = []
    for proto in list(server.server_state.connections):
        sock = proto.transport.get_extra_info("socket")
        out.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
    return out


def test_accepted_http_and_websocket_connections_have_nodelay(served):
    server, port = served
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/health")
    assert c.getresponse().read()
    with ws_connect(f"ws://127.0.0.1:{port}/v1/ws") as ws:
        ws.send('{"id": "a", "type": "chat.completions", "messages": [{"role": "user", "content": "hi"}],'
                ' "max_tokens": 2}')
        assert ws.recv(timeout=10)
        flags = _server_side_nodelay(server)
        assert len(flags) >= 2, flags          # the HTTP one and the upgraded WebSocket one
        assert all(flags), flags
    c.close()


def _keep_alive_round(port: int, n: int = 50) -> list[float]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/health")
    c.getresponse().read()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        times.append(time.perf_counter() - t0)
        assert r.status == 200 and not r.will_close
    c.close()
    return times


def test_fifty_keep_alive_requests_without_nagle_delay(served):
    """The issue's bar: < 5 ms per request on a kept-alive connection (Nagle + delayed ACK made it
    ~44 ms). Judged by the median of 50, and by the best of up to three rounds, because this shared
    2-core machine sometimes does not schedule the server for milliseconds; with Nagle every round
    sits near 40 ms."""
    _, port = served
    medians = []
    for _ in range(3):
        times = _keep_alive_round(port)
        medians.append(statistics.median(times))
        print(f"\n50 keep-alive /health: median {medians[-1] * 1e3:.2f} ms, max {max(times) * 1e3:.2f} ms")
        if medians[-1] < 0.005:
            break
    assert min(medians) < 0.005, [f"{m * 1e3:.1f} ms" for m in medians]
