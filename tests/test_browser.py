"""Issue 17: a page from another site, loaded in a real browser (headless Chromium), cannot
make the daemon generate; a local page can.  Skipped where Chromium is not installed
(`.ci/run` installs Debian's)."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import trio

from .test_http_hardening import gateway_on_sim

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed")

PAGE = """<html><body><pre id="out">pending</pre><script>
const api = "%(api)s/v1/completions";
const body = JSON.stringify({model: "sim", prompt: "a b c", max_tokens: 3});
async function attempt(name, init) {
  try {
    const answer = await fetch(api, {method: "POST", body, ...init});
    const text = answer.type === "opaque" ? "" : await answer.text();
    return name + ":" + answer.type + ":" + answer.status + ":" + text;
  } catch (error) {
    return name + ":blocked";
  }
}
(async () => {
  const results = [
    // A "simple" request: sent without asking, its answer unreadable (no-cors).
    await attempt("simple", {mode: "no-cors", headers: {"content-type": "text/plain"}}),
    // JSON: the browser asks first (preflight), and sends only if the daemon allows the origin.
    await attempt("json", {headers: {"content-type": "application/json"}}),
  ];
  document.getElementById("out").textContent = JSON.stringify(results);
})();
</script></body></html>"""


@contextmanager
def page_server(html: str) -> Iterator[int]:
    """Serve ``html`` at / on a free port, in a thread; yield the port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = html.encode()
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()


def load_in_chromium(url: str) -> list[str]:
    """The page's results after its scripts ran (``evil.example`` resolves to 127.0.0.1)."""
    assert CHROMIUM is not None
    done = subprocess.run(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--host-resolver-rules=MAP evil.example 127.0.0.1", "--virtual-time-budget=10000",
         "--dump-dom", url],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    start = done.stdout.index('<pre id="out">') + len('<pre id="out">')
    text = done.stdout[start : done.stdout.index("</pre>", start)]
    assert text != "pending", done.stderr[-2000:]
    return list(json.loads(text.replace("&quot;", '"').replace("&amp;", "&")))


@pytest.mark.parametrize(("site", "allowed"), [("evil.example", False), ("localhost", True)])
async def test_a_page_in_chromium_generates_only_from_an_allowed_origin(site: str, allowed: bool) -> None:
    async with gateway_on_sim() as (server, _, api):
        with page_server(PAGE % {"api": api}) as port:
            load = functools.partial(load_in_chromium, f"http://{site}:{port}/")
            simple, json_call = await trio.to_thread.run_sync(load)
        generated = sum(server.metrics.tokens_generated.values())
    if allowed:
        assert json_call.startswith("json:cors:200:") and '"text"' in json_call
        assert generated == 3  # the JSON request only: a text/plain body is refused (415) for anyone
    else:
        assert simple == "simple:opaque:0:"  # sent, refused by the daemon (the page cannot tell)
        assert json_call == "json:blocked"  # the preflight was refused: never sent
        assert generated == 0
