"""The Unix socket's accept loop (issue 18): capacity errors are waited out, a broken
listener ends the loop instead of spinning on it."""

from __future__ import annotations

import errno

import pytest
import trio

from uma_trio.runtime import accept


class ScriptedListener(trio.abc.Listener[trio.SocketStream]):
    """accept() raises the scripted errors in turn, then a broken-listener error."""

    def __init__(self, *errnos: int) -> None:
        self.script = list(errnos)
        self.calls = 0

    async def accept(self) -> trio.SocketStream:
        self.calls += 1
        code = self.script.pop(0) if self.script else errno.EBADF
        raise OSError(code, "scripted")

    async def aclose(self) -> None:
        pass


async def never_called(stream: trio.SocketStream) -> None:
    raise AssertionError("no connection was accepted")


async def test_out_of_descriptors_is_waited_out_then_a_broken_listener_ends_the_loop(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    listener = ScriptedListener(errno.EMFILE, errno.ENFILE, errno.ENOBUFS)
    async with trio.open_nursery() as nursery:
        started = trio.current_time()
        error = await accept.accept_forever(listener, never_called, nursery)
    assert error.errno == errno.EBADF and listener.calls == 4
    assert trio.current_time() - started == pytest.approx(3 * accept.BACKOFF_S)
    assert sum("EMFILE" in r.message or "ENFILE" in r.message for r in caplog.records) == 2
