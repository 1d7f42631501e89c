"""A local stand-in for the Hugging Face hub, in its URL layout, for the pull tests: the
official ``huggingface_hub`` client is pointed at it through ``HF_ENDPOINT`` and nothing
reaches the internet.  It serves real files: the repository API (``/api/models/REPO``, with
each file's size and LFS sha256) and downloads (``/REPO/resolve/REV/FILE``, HEAD and GET,
byte ranges for resuming)."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Repos:
    """repo id → {file name: bytes on disk}; ``corrupt`` names files served with a wrong sha256."""

    def __init__(self) -> None:
        self.files: dict[str, dict[str, Path]] = {}
        self.wrong_sha: set[str] = set()
        self.downloads: list[str] = []

    def add(self, repo: str, name: str, path: Path) -> None:
        self.files.setdefault(repo, {})[name] = path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _handler(repos: Repos) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            if path.startswith("/api/models/"):
                self._model_info(path.removeprefix("/api/models/").split("/revision/")[0])
            elif "/resolve/" in path:
                repo, _, rest = path.lstrip("/").partition("/resolve/")
                self._file(repo, rest.partition("/")[2], body)
            else:
                self.send_error(404)

        def _model_info(self, repo: str) -> None:
            files = repos.files.get(repo)
            if files is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.end_headers()
                return
            siblings = []
            for name, file in files.items():
                sha = "0" * 64 if name in repos.wrong_sha else _sha256(file)
                size = file.stat().st_size
                siblings.append(
                    {
                        "rfilename": name,
                        "size": size,
                        "lfs": {"sha256": sha, "size": size, "pointerSize": 134},
                    }
                )
            payload = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "siblings": siblings}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _file(self, repo: str, name: str, body: bool) -> None:
            file = repos.files.get(repo, {}).get(name)
            if file is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.end_headers()
                return
            data = file.read_bytes()
            start = 0
            if (ranged := self.headers.get("Range")) and ranged.startswith("bytes="):
                start = int(ranged.removeprefix("bytes=").split("-")[0] or 0)
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{_sha256(file)}"')
            self.send_header("X-Linked-Etag", f'"{_sha256(file)}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if body:
                repos.downloads.append(name)
                self.wfile.write(data[start:])

    return Handler


@contextmanager
def fake_hub(repos: Repos) -> Iterator[str]:
    """Serve ``repos`` on a free loopback port; yields the endpoint URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(repos))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
