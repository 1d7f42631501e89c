"""Binding a TCP port up front and serving an ASGI app on it with hypercorn's HTTP protocol.

The socket is bound before anything else starts, so a taken port is a one-line
start-up error rather than a failure deep inside a running daemon.  The accept loop is
ours (``trio.serve_listeners`` over a listener that holds a slot per open connection):
hypercorn's own worker has no cap on concurrent connections, and every connection holds
a file descriptor the Unix socket's accept loop needs too.  At the cap new connections
wait in the kernel's accept queue until one closes.  Each connection is then served by
hypercorn's ``TCPServer`` (HTTP/1.1 only, TLS, its keep-alive timeout), whose writes on a
plain socket are tried at once (:class:`_EagerTCPServer`).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, cast

import h11
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H2ProtocolAssumedError, H11Protocol
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ASGIFramework

from ..runtime.write_now import write_now

log = logging.getLogger(__name__)

# The ASGI types as Starlette spells them, so its apps fit.
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BindError(Exception):
    """A port given on the command line could not be bound."""


def bind_tcp(host: str, port: int, what: str) -> socket.socket:
    try:
        return socket.create_server((host, port), family=_family(host))
    except OSError as exc:
        raise BindError(f"cannot serve {what} on {host}:{port}: {exc.strerror or exc}") from None


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a host name: let getaddrinfo pick
        return socket.AF_INET


def url_of(sock: socket.socket, *, https: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if https else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class _H11NoUpgrade(H11Protocol):
    """HTTP/1.1 that never turns into HTTP/2: an ``Upgrade: h2c`` header is ignored (the
    request is answered in HTTP/1.1), and the HTTP/2 preface ends the connection (below)."""

    async def _check_protocol(self, event: h11.Request) -> None:
        if event.method == b"PRI" and event.target == b"*" and event.http_version == b"2.0":
            raise H2ProtocolAssumedError(b"")


class _Http11Only(ProtocolWrapper):
    """Hypercorn's protocol switch, serving HTTP/1.1 only.  Under HTTP/2 a client that opened
    a stream and gave no flow-control window held its connection past the idle timeout and
    the write deadline, and kept its slot after it left (hypercorn leaves the stream's send
    buffer waiting): a keyless local client took the gateway down for good with
    --http-max-connections of them.  Every client this gateway serves speaks HTTP/1.1."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.protocol = _H11NoUpgrade(
            self.app, self.config, self.context, self.task_group, self.state, self.ssl, self.client,
            self.server, self.send,
        )  # fmt: skip

    async def handle(self, event: Event) -> None:
        try:
            await self.protocol.handle(event)
        except H2ProtocolAssumedError:  # the HTTP/2 preface: not served, the connection ends
            await self.send(Closed())


FEED_AFTER_EOF_S = 0.05  # how long reads already taken may still reach the protocol after EOF


class _EagerTCPServer(TCPServer):
    """Hypercorn's connection server, with each write on a plain socket tried at once.

    Hypercorn writes every chunk of a body under its send lock and with trio's
    ``send_all``: the lock's and the socket's checkpoints are two passes of trio's scheduler
    per server-sent event.  A streamed token's event almost always fits the socket buffer,
    and on two cores that host work per token runs beside the decode (BENCHMARKS.md
    "HTTP: a token's write").  Written at once it costs one system call; only what the
    socket does not take waits, behind the lock, as before.  Nothing else runs until this
    task waits, so no other write can come between.  TLS streams, HTTP/2 and a response to
    a request not yet read whole keep hypercorn's path.
    """

    write_timeout_s = 30.0  # serve_asgi sets it: --stall-timeout

    @property
    def protocol(self) -> ProtocolWrapper:
        return self._http11

    @protocol.setter
    def protocol(self, wrapper: ProtocolWrapper) -> None:
        """Hypercorn's run() makes its wrapper here; it is rebuilt to serve HTTP/1.1 only."""
        if not isinstance(wrapper, _Http11Only):
            wrapper = _Http11Only(
                wrapper.app, wrapper.config, wrapper.context, wrapper.task_group, wrapper.state,
                wrapper.ssl, wrapper.client, wrapper.server, wrapper.send, "http/1.1",
            )  # fmt: skip
        self._http11 = wrapper

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, RawData) and not self.send_lock.locked() and self._request_read():
            data = event.data
            sent = self._write_at_once(data)
            if sent < 0:  # the peer is gone: hypercorn's own path reports it
                await super().protocol_send(event)
                return
            if sent == len(data):
                return
            event = RawData(data=data[sent:])
        if isinstance(event, RawData):
            await self._send_within_deadline(event.data)
            return
        await super().protocol_send(event)

    async def _send_within_deadline(self, data: bytes) -> None:
        """Hypercorn's write (under the send lock, shielded from cancellation), with a deadline:
        a client that reads nothing, answers piling up unread (a keyless one's 401s too), held
        its connection's slot for good.  Past it the connection is closed."""
        async with self.send_lock:
            try:
                with trio.CancelScope(shield=True), trio.move_on_after(self.write_timeout_s) as deadline:
                    await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
                return
            if deadline.cancelled_caught:
                await trio.aclose_forcefully(self.stream)
                await self.protocol.handle(Closed())

    async def _read_data(self) -> None:
        """Hypercorn's read loop, with the socket read on while the protocol is paused.  h11
        pauses once a request is read whole and bytes follow it (a stray CRLF, the next
        request pipelined), and hypercorn handed it each read in the loop that reads, so
        nothing was read until the answer went: the client's hang-up went unseen, and a
        request not streamed ran to its end for nobody.  Reads now go to the protocol through
        a task of their own (at most two reads ahead); the end of the connection closes the
        request's stream at once (the app's receive says disconnect) and ends that task."""
        reads, to_protocol = trio.open_memory_channel[bytes](1)
        fed = trio.Event()
        async with trio.open_nursery() as nursery:

            async def feed() -> None:
                async for data in to_protocol:
                    await self.protocol.handle(RawData(data))
                fed.set()

            nursery.start_soon(feed)
            async with reads:
                while True:
                    try:
                        with trio.fail_after(self.config.read_timeout or math.inf):
                            data = bytes(await self.stream.receive_some(2**16))
                    except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                        break
                    if not data:
                        break
                    await reads.send(data)
            # What was read before the end goes to the protocol first (a request and a half-close,
            # as `nc -N` sends), unless it is paused on it, which it would be for good.
            with trio.move_on_after(FEED_AFTER_EOF_S):
                await fed.wait()
            await self.protocol.handle(Closed())  # the client is gone: so is what it asked for
            nursery.cancel_scope.cancel()

    def _request_read(self) -> bool:
        """Whether the HTTP/1.1 request being answered has been read whole.  Until it has,
        writes keep hypercorn's path: its checkpoints let the reading task take in the rest
        of the body before the response ends, or hypercorn, seeing the request unfinished
        then, closes the connection, and a client's next request on it (a 401 answered
        before the body was read, say) finds it gone."""
        protocol = getattr(getattr(self, "protocol", None), "protocol", None)  # h11 or h2
        return getattr(getattr(protocol, "connection", None), "their_state", None) is h11.DONE

    def _write_at_once(self, data: bytes) -> int:
        """Bytes of ``data`` the socket takes without waiting: 0 for a full buffer or a TLS
        stream, -1 for a socket that failed."""
        sock = getattr(self.stream, "socket", None)  # trio.SocketStream; an SSLStream has none
        if sock is None or not data:
            return 0
        try:
            return write_now(sock.fileno(), data)
        except OSError:
            return -1


class _CappedListener(trio.abc.Listener[trio.abc.Stream]):
    """Accepts only while a slot is free; the connection's handler gives the slot back."""

    def __init__(self, inner: trio.abc.Listener[trio.abc.Stream], slots: trio.Semaphore) -> None:
        self.inner, self.slots = inner, slots

    async def accept(self) -> trio.abc.Stream:
        await self.slots.acquire()
        try:
            return await self.inner.accept()
        except BaseException:
            self.slots.release()
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()


async def serve_asgi(
    app: AsgiApp,
    sock: socket.socket,
    *,
    name: str,
    max_connections: int,
    tls: tuple[Path, Path] | None = None,
    on_connection: Callable[[Any], Awaitable[None]] | None = None,
    write_timeout_s: float = 30.0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on the bound ``sock`` until cancelled, at most ``max_connections``
    connections at once; ``task_status.started`` gets the base URL.  ``name`` names the
    error logger; ``tls`` is a certificate chain and private key file to serve HTTPS with;
    ``on_connection(stream)`` runs beside each accepted connection (cancelled when it ends)."""
    url = url_of(sock, https=tls is not None)
    config = Config()
    config.alpn_protocols = ["http/1.1"]  # HTTP/1.1 only (_Http11Only), over TLS too
    if tls is not None:
        config.certfile, config.keyfile = str(tls[0]), str(tls[1])
    # A TLS connection that never completes its handshake is idle: closed as any idle one is
    # (hypercorn's own default held its slot 60 s).
    config.ssl_handshake_timeout = config.keep_alive_timeout
    config.accesslog = None
    config.errorlog = logging.getLogger(f"uma_trio.{name}")
    listener: trio.abc.Listener[Any] = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    if (ssl_context := config.create_ssl_context()) is not None:  # set from certfile and keyfile
        listener = trio.SSLListener(listener, ssl_context, https_compatible=True)
    slots = trio.Semaphore(max_connections)
    wrapped, context = ASGIWrapper(cast(ASGIFramework, app)), WorkerContext(None)

    async def connection(stream: Any) -> None:
        try:
            async with trio.open_nursery() as nursery:
                if on_connection is not None:
                    nursery.start_soon(on_connection, stream)
                server = _EagerTCPServer(wrapped, config, context, {}, stream)
                server.write_timeout_s = write_timeout_s
                await server
                nursery.cancel_scope.cancel()
        finally:
            slots.release()

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, connection, [_CappedListener(listener, slots)])
        task_status.started(url)
