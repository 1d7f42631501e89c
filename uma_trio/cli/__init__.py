"""``uma-trio``: serve, info, generate, metrics, top, bench, snapshot, calibrate, ps, load, unload
and fetch-model.

Every ``serve`` (and ``info``) flag also reads an environment variable: ``--n-ctx`` ⇄
``UMA_N_CTX`` and so on (``--socket`` also honours the seeds' ``UMA_SOCK``, after
``UMA_SOCKET``); the flags are ServerConfig's fields (uma_trio/config.py).  The client
commands read only ``UMA_SOCKET`` / ``UMA_SOCK`` (and ``bench`` ``UMA_API_KEY``): read
app-wide, serve's ``UMA_MAX_TOKENS`` became ``generate``'s request size and ``UMA_SYSTEM`` a
flag ``snapshot save`` could not parse.  A bad option of a client command exits 1 (cyclopts'
own exit is 2, the code for an error the daemon reported; the request is checked with the
protocol's types before it is sent); serve and info exit 2 for every refusal at start-up.
One module per group of commands; this one assembles the app.
"""

from __future__ import annotations

import os
import sys

import cyclopts

from ..config import ConfigError
from ..pipe_console import PipeConsole
from .client_commands import bench, generate, metrics, top
from .common import (
    EXIT_PROTOCOL_ERROR,
    EXIT_READER_GONE,
    EXIT_SERVER_ERROR,
    EXIT_USAGE,
    from_the_environment,
)
from .models import load, ps, pull, unload
from .serve import info, serve
from .snapshot import snapshot_app
from .tools import calibrate, fetch_model

__all__ = ["EXIT_PROTOCOL_ERROR", "EXIT_SERVER_ERROR", "app", "main", "metrics", "top"]

app = cyclopts.App(
    name="uma-trio", help="A local multi-tenant LLM daemon with token-level scheduling, on trio.",
    console=PipeConsole(),  # `uma-trio --help | head`: exit 141 as every closed pipe, not rich's 1
)  # fmt: skip
for daemon_command in (serve, info):
    app.command(daemon_command, config=cyclopts.config.Env("UMA_", command=False))
for client_command in (generate, metrics, top, bench, snapshot_app, calibrate, ps, load, unload, pull):
    app.command(client_command)
app.command(fetch_model, name="fetch-model")


def main() -> None:
    try:
        result = app(exit_on_error=False)
        sys.stdout.flush()  # a pipe's buffer: its reader's going away is seen here, not at exit
    except cyclopts.CycloptsError:  # already printed, with the usage
        # serve's and info's refusals at start-up are all exit 2 (CONFIG.md), the clients' 1.
        sys.exit(EXIT_SERVER_ERROR if sys.argv[1:2] in (["serve"], ["info"]) else EXIT_USAGE)
    except ConfigError as exc:  # ServerConfig's own checks run as cyclopts builds it
        print(f"error: {exc}{from_the_environment(str(exc), sys.argv[2:])}", file=sys.stderr)
        sys.exit(EXIT_SERVER_ERROR)
    except BrokenPipeError:
        # stdout's reader went away (`uma-trio ps | head -1`): exit as generate and top do, with
        # no traceback, and no second complaint when Python flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(EXIT_READER_GONE)
    sys.exit(result if isinstance(result, int) else 0)
