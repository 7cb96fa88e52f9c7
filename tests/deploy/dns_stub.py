"""A tiny authoritative DNS server on a loopback UDP port, for the proxy's run-time resolution test.

Answers A queries for the names in `records` (changeable while it runs), NXDOMAIN for the rest, and an
empty NOERROR for other query types. Only what HAProxy's resolver sends is understood.
"""
from __future__ import annotations

import socket
import struct
import threading


class DnsStub:
    def __init__(self) -> None:
        self.records: dict[str, str] = {}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                data, peer = self.sock.recvfrom(512)
            except OSError:
                continue
            reply = self._answer(data)
            if reply:
                self.sock.sendto(reply, peer)

    def _answer(self, query: bytes) -> bytes | None:
        if len(query) < 17:
            return None
        qid, _flags, qdcount = struct.unpack("!HHH", query[:6])
        if qdcount != 1:
            return None
        labels, pos = [], 12
        while pos < len(query) and query[pos]:
            n = query[pos]
            labels.append(query[pos + 1:pos + 1 + n].decode("ascii", "replace").lower())
            pos += 1 + n
        qtype, _qclass = struct.unpack("!HH", query[pos + 1:pos + 5])
        question = query[12:pos + 5]
        name = ".".join(labels)
        addr = self.records.get(name)
        if addr is None:
            return struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question      # NXDOMAIN
        if qtype != 1:
            return struct.pack("!HHHHHH", qid, 0x8580, 1, 0, 0, 0) + question      # no AAAA etc.
        answer = struct.pack("!HHHIH", 0xC00C, 1, 1, 1, 4) + socket.inet_aton(addr)
        return struct.pack("!HHHHHH", qid, 0x8580, 1, 1, 0, 0) + question + answer

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)
        self.sock.close()
