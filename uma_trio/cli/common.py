"""What every ``uma-trio`` command shares: the socket flag, exit codes, logging, and how a
failure to talk to the daemon is reported."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from cyclopts import Parameter, Token

from ..client import RequestFailed
from ..config import SOCKET_ENV, ServerConfig, socket_path

SocketPath = Annotated[Path, Parameter(env_var=SOCKET_ENV, converter=socket_path)]
LOG_LEVELS = ("debug", "info", "warning", "error")


def _log_level(_type: object, tokens: Sequence[Token]) -> str:
    """A level in any case: ``UMA_LOG_LEVEL=DEBUG`` was refused (logging's own names are upper case)."""
    if (value := tokens[-1].value.lower()) not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
    return value


LogLevel = Annotated[Literal["debug", "info", "warning", "error"], Parameter(converter=_log_level)]


def from_the_environment(message: str, argv: Sequence[str]) -> str:
    """What of ``message``'s flags came from ``UMA_*`` variables rather than the command line
    (``UMA_N_CTX=0``'s refusal named only ``--n-ctx``), as a suffix for it ("" if none)."""
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    found = []
    for flag in dict.fromkeys(re.findall(r"--[a-z][a-z0-9-]*", message)):
        names = SOCKET_ENV if flag == "--socket" else ["UMA_" + flag[2:].upper().replace("-", "_")]
        env = next((name for name in names if name in os.environ), None)
        if flag not in given and env is not None:
            found.append(f"{env}={os.environ[env]}")
    return f" (from the environment: {', '.join(found)})" if found else ""


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
