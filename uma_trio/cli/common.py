"""What every ``uma-trio`` command shares: the socket flag, exit codes, logging, and how a
failure to talk to the daemon is reported."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Literal

from cyclopts import Parameter

from ..client import RequestFailed
from ..config import SOCKET_ENV, ServerConfig, socket_path

SocketPath = Annotated[Path, Parameter(env_var=SOCKET_ENV, converter=socket_path)]
LogLevel = Literal["debug", "info", "warning", "error"]

EXIT_USAGE = 1  # a bad option or file (cli.main maps cyclopts' own 2 to it)
EXIT_SERVER_ERROR = 2
EXIT_PROTOCOL_ERROR = 3
EXIT_READER_GONE = 141  # stdout's reader went away (`| head`), as a tool killed by SIGPIPE exits

DEFAULTS = ServerConfig()


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def daemon_failure(socket: Path, exc: Exception) -> int:
    """Say why talking to the daemon at ``socket`` failed; returns the exit code: 2 for an
    error event answering the request, 3 when it could not be reached or hung up, or refused
    the connection itself (an error with no request id, e.g. E_AUTH_001: this user is not on
    its --allow-uid; whether that arrives as the error or as the hang-up after it is a race)."""
    if isinstance(exc, RequestFailed):
        print(f"error {exc.event.code}: {exc.event.message}", file=sys.stderr)
        return EXIT_SERVER_ERROR if exc.event.id is not None else EXIT_PROTOCOL_ERROR
    print(f"cannot talk to the daemon at {socket}: {exc}", file=sys.stderr)
    return EXIT_PROTOCOL_ERROR
