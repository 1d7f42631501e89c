"""The Unix socket's accept loop: which accept errors to wait out and which end it.

trio's :class:`~trio.SocketListener` already retries the errors a client causes
(ECONNABORTED, EPROTO, EPERM).  What is left is either the machine running short (no free
descriptors or buffers: back off and try again, as ``trio.serve_listeners`` does) or the
listening socket itself broken, which retrying would only spin on: then the loop ends and
says why.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger(__name__)

# Out of descriptors, kernel memory or buffers: connections closing will free them.
CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
BACKOFF_S = 0.1


async def accept_forever(
    listener: trio.abc.Listener[trio.SocketStream],
    handle: Callable[[trio.SocketStream], Awaitable[None]],
    nursery: trio.Nursery,
) -> OSError:
    """Start ``handle(stream)`` in ``nursery`` for every connection; back off while the
    machine is out of capacity.  Returns the error that broke the listener."""
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno in CAPACITY_ERRNOS:
                log.warning("accept failed (%s); retrying in %.1f s", errno.errorcode[exc.errno], BACKOFF_S)
                await trio.sleep(BACKOFF_S)
                continue
            return exc
        nursery.start_soon(handle, stream)
