"""A hub-shaped HTTP origin on localhost for huggingface_hub's real client (set HF_ENDPOINT to its url):
the endpoints the client calls for a model repo — info by revision, the recursive tree listing, and file
resolve (HEAD and GET with ETag, X-Repo-Commit and Content-Length) — over repositories held in memory.
Every request is recorded (path and headers), so a test can assert that none was made.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

API_RE = re.compile(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?")
TREE_RE = re.compile(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?")
RESOLVE_RE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")


@dataclass
class HubRepo:
    files: dict[str, bytes | Path]          # path in the repo → bytes, or a local file served as is
    commit: str = ""

    def __post_init__(self) -> None:
        if not self.commit:
            self.commit = hashlib.sha1(json.dumps(sorted(self.files)).encode()).hexdigest()

    def content(self, path: str) -> bytes:
        data = self.files[path]
        return data.read_bytes() if isinstance(data, Path) else data


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class Hub:
    repos: dict[str, HubRepo] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    url: str = ""
    _server: ThreadingHTTPServer | None = None

    def start(self) -> "Hub":
        hub = self

        class Handler(HubHandler):
            state = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def tree_entry(path: str, data: bytes) -> dict:
    entry = {"type": "file", "path": path, "size": len(data),
             "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
    if path.endswith((".gguf", ".safetensors")):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


class HubHandler(BaseHTTPRequestHandler):
    state: Hub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:     # quiet
        pass

    def do_HEAD(self) -> None:
        self.route(send_body=False)

    def do_GET(self) -> None:
        self.route(send_body=True)

    def route(self, send_body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.state.requests.append(Request(self.command, path, {k.lower(): v for k, v in self.headers.items()}))
        if m := TREE_RE.fullmatch(path):
            return self.tree(m.group(1), m.group(3) or "", send_body)
        if m := API_RE.fullmatch(path):
            return self.info(m.group(1), send_body)
        if m := RESOLVE_RE.fullmatch(path):
            return self.resolve(m.group(1), m.group(3), send_body)
        self.reply(404, b'{"error": "not found"}', send_body)

    def repo(self, repo_id: str, send_body: bool) -> HubRepo | None:
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self.reply(404, json.dumps({"error": "Repository not found"}).encode(), send_body,
                       {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
        return repo

    def info(self, repo_id: str, send_body: bool) -> None:
        if (repo := self.repo(repo_id, send_body)) is not None:
            body = {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                    "siblings": [{"rfilename": p} for p in sorted(repo.files)]}
            self.reply(200, json.dumps(body).encode(), send_body)

    def tree(self, repo_id: str, under: str, send_body: bool) -> None:
        if (repo := self.repo(repo_id, send_body)) is not None:
            entries = [tree_entry(p, repo.content(p)) for p in sorted(repo.files)
                       if not under or p.startswith(under.rstrip("/") + "/")]
            self.reply(200, json.dumps(entries).encode(), send_body)

    def resolve(self, repo_id: str, path: str, send_body: bool) -> None:
        if (repo := self.repo(repo_id, send_body)) is None:
            return
        if path not in repo.files:
            self.reply(404, b'{"error": "Entry not found"}', send_body,
                       {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit})
            return
        data = repo.content(path)
        etag = tree_entry(path, data).get("lfs", {}).get("oid") or tree_entry(path, data)["oid"]
        self.reply(200, data, send_body, {"ETag": f'"{etag}"', "X-Repo-Commit": repo.commit},
                   content_type="application/octet-stream")

    def reply(self, status: int, body: bytes, send_body: bool, headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if send_body:
            self.wfile.write(body)
