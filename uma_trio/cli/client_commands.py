"""The commands that talk to a running daemon: generate, metrics, top, bench."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import anyio
import msgspec
import trio
from cyclopts import Parameter

from ..client import ConnectionLost, RequestFailed, UmaClient
from ..config import DEFAULT_SOCKET, WholeNumber, whole_number
from ..protocol.messages import EosEvent, ErrorEvent, GenerateRequest, TokenEvent
from .common import (
    EXIT_PROTOCOL_ERROR,
    EXIT_READER_GONE,
    EXIT_SERVER_ERROR,
    EXIT_USAGE,
    SocketPath,
    daemon_failure,
)
from .request_check import option_problem

Text = Annotated[str, Parameter(allow_leading_hyphen=True)]  # a prompt may start with "-"


def generate(
    *,
    prompt: Text,
    system: Text | None = None,
    max_tokens: WholeNumber = 128,
    temp: float = 0.8,
    top_p: float = 0.95,
    seed: Annotated[int | None, Parameter(converter=whole_number)] = None,
    no_stream: Annotated[bool, Parameter(negative=())] = False,  # not --no-no-stream
    raw: bool = False,
    json_schema: Path | None = None,
    json_object: bool = False,
    grammar: Path | None = None,
    tools: Path | None = None,
    tool_choice: str = "auto",
    socket: SocketPath = DEFAULT_SOCKET,
) -> int:
    """Send one request and print the answer to stdout (the seeds' uma-cli).

    Exit status: 0 success, 1 a bad option or file (or stdout cannot be written), 2 the
    daemon reported an error or cancelled the request (its shutdown, a stall), 3 connection
    or protocol error, 130 on Ctrl-C, 141 when the output's reader went away (`| head`).

    Parameters
    ----------
    prompt
        The user's message (formatted with the model's chat template unless --raw).
    system
        A system message before it (else the template's own default, if it has one).
    max_tokens
        Most tokens to generate.
    temp
        Sampling temperature; 0 is greedy.
    top_p
        Nucleus sampling threshold.
    seed
        Random seed for reproducible sampling.
    no_stream
        Ask for one final event instead of a token stream.
    raw
        Send the prompt as plain text completion instead of a chat message.
    json_schema
        A JSON file holding a JSON schema: the answer is one JSON value matching it.
    json_object
        The answer is one JSON object (any).
    grammar
        A grammar file, llama.cpp's GBNF or Lark: the answer matches it.
    tools
        A JSON file holding OpenAI-style tools (a list of {"type": "function", "function":
        {...}}); the calls the answer makes are printed as a JSON list after it.
    tool_choice
        With --tools: auto, none, required, or the name of the one function to call.
    socket
        Unix socket path of the daemon.
    """
    request: dict[str, object] = {
        "max_tokens": max_tokens, "temperature": temp, "top_p": top_p, "stream": not no_stream,
    }  # fmt: skip
    if raw:
        request["prompt"] = prompt
    else:
        system_turn = [{"role": "system", "content": system}] if system is not None else []
        request["messages"] = [*system_turn, {"role": "user", "content": prompt}]
    if seed is not None:
        request["seed"] = seed
    try:
        request.update(_constraint(json_schema, json_object, grammar))
        if tools is not None:
            request["tools"] = json.loads(tools.read_text())
            named = tool_choice not in ("auto", "none", "required")
            request["tool_choice"] = (
                {"type": "function", "function": {"name": tool_choice}} if named else tool_choice
            )
        elif tool_choice != "auto":
            raise ValueError("--tool-choice needs --tools")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if (problem := option_problem(request, GenerateRequest, _GENERATE_FLAGS)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    return anyio.run(_generate, socket, request)


# The request fields generate's flags set, for a refusal before sending.
_GENERATE_FLAGS = {
    "max_tokens": "--max-tokens", "temperature": "--temp", "top_p": "--top-p", "seed": "--seed",
    "prompt": "--prompt", "messages": "--prompt/--system", "tools": "--tools", "tool_choice": "--tool-choice",
    "grammar": "--grammar", "response_format": "--json-schema",
}  # fmt: skip


def _constraint(json_schema: Path | None, json_object: bool, grammar: Path | None) -> dict[str, object]:
    """The request fields for --json-schema, --json-object or --grammar (at most one)."""
    if (json_schema is not None) + json_object + (grammar is not None) > 1:
        raise ValueError("give one of --json-schema, --json-object and --grammar")
    if json_schema is not None:
        try:
            schema = json.loads(json_schema.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{json_schema} is not JSON: {exc}") from None
        return {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    if json_object:
        return {"response_format": {"type": "json_object"}}
    if grammar is not None:
        return {"grammar": grammar.read_text()}
    return {}


class OutputFailed(Exception):
    """Writing the answer to stdout failed (a full disk, ``> /dev/full``): ours, not the daemon's."""


def _write(text: str, *, flush: bool = False) -> None:
    try:
        sys.stdout.write(text)
        if flush:
            sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise OutputFailed(exc.strerror or str(exc)) from None


async def _generate(socket: Path, request: dict[str, object]) -> int:
    try:
        streamed = False  # an error then starts a line of its own, and only then
        async with UmaClient.connect(socket) as client, client.stream(**request) as events:
            async for event in events:
                if isinstance(event, TokenEvent):
                    _write(event.text, flush=True)
                    streamed = streamed or bool(event.text)
                elif isinstance(event, ErrorEvent):  # the request's, or the connection's (no id)
                    start = "\n" if streamed else ""
                    print(f"{start}error {event.code}: {event.message}", file=sys.stderr)
                    return EXIT_SERVER_ERROR if event.id is not None else EXIT_PROTOCOL_ERROR
                elif isinstance(event, EosEvent):
                    _write((event.text or "") + "\n")
                    if event.tool_calls:
                        calls = [msgspec.to_builtins(call) for call in event.tool_calls]
                        _write(json.dumps(calls) + "\n")
                    _write("", flush=True)
                    if event.reason == "cancelled":  # by the daemon: shutdown, a stall...
                        why = f" ({event.cancel_reason})" if event.cancel_reason else ""
                        print(
                            f"the daemon cancelled the request{why}: the answer is cut short", file=sys.stderr
                        )
                    return EXIT_SERVER_ERROR if event.reason in ("error", "cancelled") else 0
    except BrokenPipeError:
        # Our reader went away (`| head`): the request was cancelled on the way out; no
        # daemon failure, and no second complaint when Python flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_READER_GONE
    except OutputFailed as exc:  # it was reported as "cannot talk to the daemon"
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"error: cannot write the answer to stdout: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ConnectionLost, OSError) as exc:
        return daemon_failure(socket, exc)
    print("the daemon ended the stream without an eos event", file=sys.stderr)
    return EXIT_PROTOCOL_ERROR


def metrics(
    *, socket: SocketPath = DEFAULT_SOCKET, json_: Annotated[bool, Parameter(name="--json")] = False
) -> int:
    """Print the daemon's metrics: tables, or the raw snapshot with --json (docs/METRICS.md).

    Parameters
    ----------
    socket
        Unix socket path of the daemon.
    json_
        Print the snapshot as JSON instead of tables.
    """

    async def fetch() -> dict[str, Any]:
        async with UmaClient.connect(socket) as client:
            return await client.metrics()

    try:
        snapshot = anyio.run(fetch)
    except (RequestFailed, ConnectionLost, OSError) as exc:
        return daemon_failure(socket, exc)
    if json_:
        print(json.dumps(snapshot, indent=2, sort_keys=True))
    else:
        from ..observability.views import report
        from ..pipe_console import PipeConsole

        PipeConsole().print(report(snapshot))
    return 0


def top(*, socket: SocketPath = DEFAULT_SOCKET, interval: float = 1.0, once: bool = False) -> int:
    """A live view of the daemon: requests in flight, lane latencies, the scorecard.

    Parameters
    ----------
    socket
        Unix socket path of the daemon.
    interval
        Seconds between refreshes.
    once
        Draw one frame and exit (for scripts). Where the output is not a terminal, a frame
        is printed every interval instead of a redrawn screen (as `top -b`).
    """
    from ..top import run_top

    if not 0 < interval < math.inf:  # NaN too: trio's sleep refused it with a traceback
        print("error: --interval must be a positive number of seconds", file=sys.stderr)
        return EXIT_USAGE
    try:
        trio.run(run_top, socket, interval, once)
    except BrokenPipeError:  # `top | head`: the reader went away, as generate says it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_READER_GONE
    except (RequestFailed, ConnectionLost, OSError) as exc:
        return daemon_failure(socket, exc)
    except KeyboardInterrupt:
        pass
    return 0


def bench(
    scenario: str,
    *,
    target: Annotated[list[str] | None, Parameter(consume_multiple=False)] = None,
    socket: SocketPath = DEFAULT_SOCKET,
    api_key: Annotated[str | None, Parameter(env_var="UMA_API_KEY")] = None,
    out: Path = Path("benches/results/bench"),
    timeout: float = 600.0,
) -> int:
    """Run a benchmark scenario against one or more servers, one after the other, and print
    them side by side (docs/BENCHMARKS.md). Exit status 1 if any request failed, 130 if
    interrupted (Ctrl-C; what ran is written).

    Parameters
    ----------
    scenario
        A scenario or suite JSON file, or the name of one in benches/scenarios/
        (mixed, storm, scaling, agents, ipc, ...).
    target
        Repeat for each server: `uma` (the daemon at --socket), `uma-http:URL` or
        `openai:URL` (any OpenAI-compatible server, e.g. llama-server), optionally
        labelled: `llama-server=openai:http://127.0.0.1:8081`. Default: uma.
    socket
        Unix socket of the `uma` target.
    api_key
        Bearer key for HTTP targets.
    out
        Directory for tokens.csv, requests.csv, summary.csv and the PNG plots.
    timeout
        Seconds a request may wait for its next event before it is recorded failed (TIMEOUT):
        a server that stops answering does not hang the bench.
    """
    from ..bench_cli import EXIT_INTERRUPTED, BenchError, run

    try:
        return run(
            scenario, target or ["uma"], socket_path=socket, api_key=api_key, out=out, timeout_s=timeout
        )
    except KeyboardInterrupt:  # outside the runs (they write what ran): nothing more to say
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    except BaseExceptionGroup as group:  # a BenchError beside another failure
        errors = group.subgroup(BenchError)
        if errors is None:
            raise
        print(f"error: {errors.exceptions[0]}", file=sys.stderr)
        return EXIT_SERVER_ERROR
