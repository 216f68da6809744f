"""A local HTTP server that answers like the HuggingFace hub for what ``snapshot_download`` calls.

Endpoints (as huggingface_hub 1.x uses them, with ``HF_ENDPOINT`` pointing here):

- ``GET /api/models/{repo}/revision/{rev}``: model info (``sha`` = the commit);
- ``GET /api/models/{repo}/tree/{rev}?recursive=True``: file listing with sizes, git blob ids and,
  for LFS files (``*.safetensors``), the sha256;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: ``ETag``, ``X-Repo-Commit``, ``Content-Length``
  (``X-Linked-*`` for LFS files) and byte ``Range`` requests (206).

Errors carry the hub's ``X-Error-Code`` (``GatedRepo``, ``RepoNotFound``, ``RevisionNotFound``,
``EntryNotFound``). A transfer can be cut after N bytes (connection closed mid-body) and slowed
down, to test resume and concurrent prefetches. Every request is recorded.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    branches: dict[str, str] = field(default_factory=dict)
    #: Requests need ``Authorization: Bearer <token>``; without it the hub answers 401 GatedRepo.
    token: str | None = None

    @classmethod
    def from_dir(cls, path: Path, *, token: str | None = None) -> Repo:
        files = {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*"))
                 if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)}
        digest = hashlib.sha1()
        for name, data in files.items():
            digest.update(name.encode() + hashlib.sha256(data).digest())
        commit = digest.hexdigest()
        return cls(files=files, commit=commit, branches={"main": commit}, token=token)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorized: bool


def _is_lfs(name: str) -> bool:
    return name.endswith(".safetensors")


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """Run with ``with FakeHub() as hub: hub.repos["org/name"] = Repo(...)``; ``hub.url`` is the endpoint."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        #: file name -> [bytes to send before closing the connection, times left]
        self.cut: dict[str, list[int]] = {}
        #: seconds to sleep per 64 KiB sent (slows transfers down)
        self.delay_per_chunk = 0.0
        #: when set, every API call answers this HTTP status (a hub outage)
        self.api_status: int | None = None
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return None

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def do_GET(self) -> None:
                hub._handle(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def gets(self, filename: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + filename)
                and "/resolve/" in r.path]

    # -- request handling ----------------------------------------------------------------------------
    def _send(self, h: BaseHTTPRequestHandler, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              head: bool = False) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str, head: bool) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(h, status, body, {"X-Error-Code": code, "X-Error-Message": message,
                                     "Content-Type": "application/json"}, head)

    def _handle(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        path = urlsplit(h.path).path
        auth = h.headers.get("Authorization", "")
        with self._lock:
            self.requests.append(Request("HEAD" if head else "GET", path, h.headers.get("Range"), bool(auth)))
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo_id, kind, rev = f"{parts[2]}/{parts[3]}", parts[4], "/".join(parts[5:])
            api = True
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id, kind, rev, filename = f"{parts[0]}/{parts[1]}", "resolve", parts[3], "/".join(parts[4:])
            api = False
        else:
            self._error(h, 404, "EntryNotFound", f"no route {path}", head)
            return
        if api and self.api_status is not None:
            self._send(h, self.api_status, b"upstream error", {"Content-Type": "text/plain"}, head)
            return
        repo = self.repos.get(repo_id)
        if repo is None:
            # Like the hub: anonymous requests for a missing (or private) repo get 401, others 404.
            self._error(h, 401 if not auth else 404, "RepoNotFound", "Repository not found", head)
            return
        if repo.token is not None and auth != f"Bearer {repo.token}":
            self._error(h, 401 if not auth else 403, "GatedRepo",
                        f"Access to model {repo_id} is restricted. You must have access to it and be authenticated.",
                        head)
            return
        commit = rev if rev == repo.commit else repo.branches.get(rev)
        if commit is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            return
        if api and kind == "revision":
            info = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False, "gated": False,
                    "siblings": [{"rfilename": n} for n in repo.files]}
            self._send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
            return
        if api:
            entries = []
            for name, data in repo.files.items():
                e: dict[str, Any] = {"type": "file", "path": name, "size": len(data), "oid": _git_blob_id(data)}
                if _is_lfs(name):
                    e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                entries.append(e)
            self._send(h, 200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, head)
            return
        data = repo.files.get(filename)
        if data is None:
            self._error(h, 404, "EntryNotFound", f"{filename} does not exist", head)
            return
        self._serve_file(h, repo, commit, filename, data, head)

    def _serve_file(self, h: BaseHTTPRequestHandler, repo: Repo, commit: str, filename: str, data: bytes,
                    head: bool) -> None:
        etag = hashlib.sha256(data).hexdigest() if _is_lfs(filename) else _git_blob_id(data)
        headers = {"ETag": f'"{etag}"', "X-Repo-Commit": commit, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if _is_lfs(filename):
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
        start, status = 0, 200
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes="):
            first = rng[len("bytes="):].split("-", 1)[0]
            start, status = int(first or 0), 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if head:
            return
        limit = len(body)
        with self._lock:
            cut = self.cut.get(filename)
            if cut and cut[1] > 0:
                cut[1] -= 1
                limit = min(limit, cut[0])
        sent = 0
        try:
            while sent < limit:
                chunk = body[sent:min(limit, sent + 65536)]
                h.wfile.write(chunk)
                sent += len(chunk)
                if self.delay_per_chunk:
                    time.sleep(self.delay_per_chunk)
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            return
        if limit < len(body):
            # Drop the connection mid-body, as a flaky network does.
            h.close_connection = True
            import socket

            h.connection.shutdown(socket.SHUT_RDWR)
