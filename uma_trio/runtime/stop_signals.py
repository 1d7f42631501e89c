"""The signals that stop the daemon, before it serves and while it serves.

While serving, SIGINT, SIGTERM and SIGHUP drain it (:meth:`Server._signal_task`): there is no
configuration to reload, and a hang-up is the terminal it ran in going away (or a
supervisor's ``kill -HUP``), which left the daemon dead with no line, every stream cut and its
socket file left behind.  SIGHUP is left alone where the daemon started with it ignored
(``nohup``).  Before it serves (the model loading) or after its drain, SIGTERM and SIGHUP log
one line and end the process by the same signal, as their default action would, so a
supervisor sees the usual status (143, 129) and the log says why; Ctrl-C is trio's
KeyboardInterrupt there (exit 130, ``cli/serve.py``).
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType

log = logging.getLogger("uma_trio")


def hang_up_ignored() -> bool:
    return signal.getsignal(signal.SIGHUP) is signal.SIG_IGN


def drain_signals() -> list[signal.Signals]:
    """The signals that drain a serving daemon (a second one stops it at once)."""
    signals = [signal.SIGINT, signal.SIGTERM]
    return signals if hang_up_ignored() else [*signals, signal.SIGHUP]


def _stop_now(signum: int, _frame: FrameType | None) -> None:
    log.info("%s while not serving (loading the model, or stopping): exiting", signal.Signals(signum).name)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def log_stops_while_not_serving() -> None:
    """Install the before-serving handlers (in the main thread, before ``trio.run``)."""
    signal.signal(signal.SIGTERM, _stop_now)
    if not hang_up_ignored():
        signal.signal(signal.SIGHUP, _stop_now)
