"""Daemon settings: one frozen dataclass whose fields are the ``serve`` flags, their
``UMA_*`` environment variables and docs/CONFIG.md's table (issue 18: declared once).

Over 400 lines because it is that one declaration: every setting with its help text, which
cyclopts shows in ``--help`` and config_doc writes into docs/CONFIG.md."""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Literal, get_args

from cyclopts import Parameter, Token


def default_socket_path() -> Path:
    """Where the daemon listens unless told otherwise: a directory private to this user,
    ``$XDG_RUNTIME_DIR/uma-trio/uma.sock`` when ``XDG_RUNTIME_DIR`` is an absolute path to a
    directory we own, else ``/tmp/uma-trio-<uid>/uma.sock``.  The daemon creates the
    directory (0700) and refuses to serve in one that is not ours alone (docs/SECURITY.md)."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime_dir):
        try:
            info = os.stat(runtime_dir)
        except OSError:
            pass
        else:
            if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
                return Path(runtime_dir) / "uma-trio" / "uma.sock"
    return Path("/tmp") / f"uma-trio-{os.geteuid()}" / "uma.sock"


DEFAULT_SOCKET = default_socket_path()  # computed once, at import: the CLI's default
KvType = Literal["f16", "q8_0", "q4_0"]
KV_TYPE_NAMES: tuple[KvType, ...] = get_args(KvType)
FlashAttn = Literal["auto", "on", "off"]
SplitMode = Literal["none", "layer", "row", "tensor"]

# The engine settings of the two modes (docs/CONFIG.md): fast, as llama-server runs, or
# deterministic, where greedy output does not depend on batching, chunking or the cache.
FAST_N_UBATCH = 512
FAST_KV_TYPE: KvType = "f16"
DETERMINISTIC_N_UBATCH = 32
DETERMINISTIC_KV_TYPE: KvType = "q8_0"
DETERMINISTIC_MAX_UBATCH = 63  # llama.cpp's CPU matrix kernels change arithmetic at 64 tokens


MIN_FRAME_BYTES, MAX_FRAME_BYTES = 1024, 2**32 - 1


class ConfigError(ValueError):
    """A setting the daemon cannot run with; the message names the flag."""


GpuLayersMode = Literal["auto", "all"]

# ASCII only: str.isdigit() is True for "²" (which int() refuses) and float() reads "inf",
# "nan", "1_000" and other scripts' digits; a setting is written in ASCII digits.
_DIGITS = re.compile(r"[0-9]+")
_DECIMAL = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?")


def parse_gpu_layers(value: str) -> GpuLayersMode | int:
    """``auto``, ``all`` or a layer count (0 or more); anything else is a ConfigError
    that names the flag."""
    text = value.strip().lower()
    if text in ("auto", "all"):
        return "auto" if text == "auto" else "all"
    if _DIGITS.fullmatch(text):
        return int(text)
    raise ConfigError(f"--gpu-layers must be auto, all or a number of layers (0 or more), not {value!r}")


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_memory_budget(value: str, total_bytes: int) -> int:
    """``--memory-budget``: bytes (``24G``, ``512M``, ``8000000000``) or a fraction of
    ``total_bytes`` (``0.8``); a ConfigError naming the flag otherwise."""
    text = value.strip().lower().removesuffix("ib").removesuffix("b")
    digits = text.rstrip("kmgt")
    unit = text[len(digits) :]
    number = float(digits) if _DECIMAL.fullmatch(digits) else math.nan
    fraction = not unit and number <= 1
    size = number * (total_bytes if fraction else _SIZE_UNITS.get(unit, 0))
    # int() of 1e400 (infinity) raised OverflowError, a traceback rather than a ConfigError.
    finite = number > 0 and (fraction or 1 <= size < math.inf)  # 1e-9K: under a byte
    if not finite or unit not in _SIZE_UNITS or (not unit and "." in text and number > 1):
        raise ConfigError(f"--memory-budget must be a size (24G, 512M) or a fraction (0.8), not {value!r}")
    return int(size)


def _comma_separated(_type: object, tokens: Sequence[Token]) -> tuple[str, ...]:
    return tuple(part.strip() for token in tokens for part in token.value.split(",") if part.strip())


def whole_number(_type: object, tokens: Sequence[Token]) -> int:
    """An integer flag's value as written: cyclopts rounds ``1.5`` to 2, which a count or a
    limit must refuse rather than guess."""
    value = tokens[-1].value.strip()
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"a whole number is needed, not {value!r}") from None


# An integer setting (Annotated merges the Parameter with a field's own).
WholeNumber = Annotated[int, Parameter(converter=whole_number)]


def socket_path(_type: object, tokens: Sequence[Token]) -> Path:
    """``--socket``'s path; an empty one (``UMA_SOCKET=``) was taken as ``.``."""
    if not (value := tokens[-1].value):
        raise ValueError("a socket path must not be empty")
    return Path(value)


# Serve and the clients read them in this order: serve took UMA_SOCK first and the clients
# UMA_SOCKET, so with both set they talked past each other.
SOCKET_ENV = ["UMA_SOCKET", "UMA_SOCK"]


def client_socket_path() -> Path:
    """The socket a client reaches unless told otherwise, as the client commands read it:
    ``UMA_SOCKET``, else ``UMA_SOCK``, else :func:`default_socket_path`.  An empty variable
    is refused, as ``--socket`` refuses it (a program using the library sees the daemon the
    CLI sees)."""
    for name in SOCKET_ENV:
        if (value := os.environ.get(name)) is not None:
            if not value:
                raise ValueError(f"{name} is set but empty: unset it or give the socket's path")
            return Path(value)
    return default_socket_path()


def _tensor_split(_type: object, tokens: Sequence[Token]) -> tuple[float, ...]:
    return parse_tensor_split(tokens[-1].value)


def parse_tensor_split(value: str) -> tuple[float, ...]:
    """``3,1`` (or ``3/1``): the share of the model each GPU holds, in device order."""
    parts = [p for p in value.replace("/", ",").split(",") if p.strip()]
    try:
        shares = tuple(float(p) for p in parts)
    except ValueError:
        shares = ()
    if not valid_shares(shares):
        raise ConfigError(f"--tensor-split must be non-negative shares such as 3,1, not {value!r}")
    return shares


def valid_shares(shares: Sequence[float]) -> bool:
    """Finite, non-negative shares, not all zero: what llama.cpp can split a model by."""
    return bool(shares) and all(0.0 <= s < math.inf for s in shares) and sum(shares) > 0.0


_COMMA_LIST = Parameter(converter=_comma_separated, consume_multiple=False, negative_iterable=())
_HIDDEN = Parameter(parse=False)  # tuned in code and tests, not a user setting


@Parameter(name="*")  # cyclopts: every field is a flag of its own (--n-ctx, not --config.n-ctx)
@dataclass(frozen=True)
class ServerConfig:
    """Every daemon setting, declared once.  Each field's type, default and docstring are
    the ``uma-trio serve`` flag (cyclopts flattens this dataclass into the command), its
    ``UMA_*`` environment variable, and its row of docs/CONFIG.md's table, which
    ``python -m uma_trio.config_doc`` writes and tests/test_config_docs.py checks."""

    socket_path: Annotated[
        Path,
        Parameter(
            name="--socket",
            env_var=SOCKET_ENV,  # UMA_SOCK: the seeds' name
            # Shown, the help listed UMA_SOCKET twice (here and as the flag's UMA_ name); the
            # text below names both, in the order they are read.
            show_env_var=False,
            converter=socket_path,
            show_default="$XDG_RUNTIME_DIR/uma-trio/uma.sock, else /tmp/uma-trio-UID/uma.sock",
        ),
    ] = DEFAULT_SOCKET
    """Unix socket path, created 0600; a stale file is removed; a live daemon there makes
    start-up fail (exit 2). Its directory is created 0700 if missing (only the last component)
    and must be a real directory (not a symbolic link) owned by the daemon's user that group
    and others cannot write to (or a sticky directory owned by root or the user, like /tmp),
    else start-up fails (exit 2), before the model loads; so does a path over 97 bytes (93 on
    macOS: a Unix socket's limit less the 10 of the name it is bound under first), and a
    directory where no socket can be created (a read-only file system, /proc: a socket is
    bound there and removed to find out).
    XDG_RUNTIME_DIR is used when it is an absolute path to a directory the user owns
    (SECURITY.md). Also read from the seeds' UMA_SOCK (UMA_SOCKET first, for the clients
    too); an empty path is refused."""

    # Models (docs/MODELS.md)
    models_dir: Annotated[Path | None, Parameter(show_default="~/.local/share/uma-trio/models")] = None
    """A directory of GGUF files besides --model: a request may name any of them (by file name
    without .gguf, or an --alias), and it is loaded for that request and unloaded when idle."""
    alias: Annotated[tuple[str, ...], _COMMA_LIST, Parameter(show_default="none")] = ()
    """Comma-separated NAME=FILE: more names for a model (FILE a file of --models-dir, or a
    path, which joins the store), e.g. chat=SmolLM2-135M-Instruct.Q4_1.gguf. A NAME that is
    another model's id, or a path to a file other than the store's of that name, is refused."""
    max_loaded: WholeNumber = 3
    """Models loaded at once, --model's included: loading one more first unloads the least
    recently used idle one; a model with requests in flight is never unloaded."""
    memory_budget: Annotated[str | None, Parameter(show_default="--model's + 90 % of free memory")] = None
    """Bytes the loaded models' weights and KV caches may take together (24G, 512M), or a
    fraction of the machine's memory (0.8): loading one more first unloads idle ones until it
    fits; a model too big even alone is refused with the numbers."""
    keep_alive_s: Annotated[float, Parameter(name="--keep-alive")] = 300.0
    """Seconds a model other than --model stays loaded once idle (a request's Ollama
    keep_alive overrides it for its model: 0 unloads after the request, negative never)."""

    # Engine
    n_ctx: WholeNumber = 4096
    """KV cells one request may use (prompt + max_tokens); the KV cache holds n_ctx ×
    max_sessions cells (for the default model 23 KB each at f16, 12 KB at q8_0); one whose host
    share, with the weights', exceeds the machine's memory (or its container's limit) is refused
    at start-up (exit 2)."""
    deterministic: bool = False
    """Exact, batch-invariant greedy output instead of the fast defaults (CONFIG.md "Two
    modes"): q8_0 KV, --n-ubatch 32, one KV stream per session, flash attention on. An
    explicit --kv-type f16, --n-ubatch 64+, --kv-unified or --flash-attn off beside it is
    refused at start-up (exit 2)."""
    gpu_layers: str = "auto"
    """Model layers on the GPU: auto offloads every layer when llama.cpp has a GPU backend and
    the weights plus the whole KV cache (n_ctx × max_sessions cells) fit the free memory of
    the GPUs that take layers, each less a reserve (5 %, at least 512 MiB), for its share of
    the model (--split-mode none: --main-gpu's alone; else the --tensor-split shares, by
    default llama.cpp's split: by free memory, evenly with tensor); else as many layers as fit, and logs why;
    all; or a count (0: CPU only). Anything else is refused at start-up naming the flag
    (exit 2). `uma-trio info` shows the decision without starting the daemon."""
    flash_attn: FlashAttn = "auto"
    """Flash attention: auto (where the backend supports it), on, or off (needs --kv-type f16:
    a quantized V cache needs flash attention)."""
    main_gpu: WholeNumber = 0
    """The GPU that holds the whole model with --split-mode none (llama.cpp reads it for no
    other mode), counted among the GPUs llama.cpp uses (the discrete ones, else the integrated
    ones); on a machine with GPUs, one it does not have is refused at start-up."""
    split_mode: SplitMode = "layer"
    """Across several GPUs: layer (whole layers per GPU), tensor (each layer's matrices and
    KV split across every GPU, integrated ones included, and computed in parallel: llama.cpp's
    tensor parallelism, marked experimental there; needs flash attention; where no layer goes
    to a GPU, layer is used), row (rows of each matrix, on backends with split buffers: SYCL,
    Hexagon; on a machine with GPUs, refused at start-up on others, CUDA included) or none
    (all on --main-gpu). A machine with no GPU runs on the CPU whatever these say."""
    tensor_split: Annotated[
        tuple[float, ...] | None,
        Parameter(converter=_tensor_split, negative_iterable=(), show_default="by free memory"),
    ] = None
    """Share of the model per GPU in device order, e.g. 3,1 (by default llama.cpp splits by
    free memory, with --split-mode tensor evenly); on a machine with GPUs, more shares than it
    has is refused at start-up (unless --split-mode none, which ignores it)."""
    run_ahead: bool = True
    """While the same sessions decode step after step, the compute thread starts the next
    decode itself from the tokens it just sampled; the event loop collects results one step
    behind (same tokens). On the H100 it cut the time between two decodes from 10–14 % of a
    step to 4 % (BENCHMARKS.md "GPU"); on a CPU +2-4 % tokens/s at 1-4 streams, the same at
    8-16 (BENCHMARKS.md "Streams on the CPU"). A chain of background steps on a CPU stays
    preemptible: an arriving chat stops the step running, as it would a planned one."""
    mmap: bool = True
    """Map model files into memory (llama.cpp's default, as llama-server's): loads in a moment
    and shares the pages with the file cache, but a loaded model's file must then never be
    overwritten or truncated in place (`cp new.gguf over.gguf`): the kernel kills the daemon
    (SIGBUS) at its next read of a page the file no longer has. Replace a model by writing
    another file and renaming it over (`mv`: the loaded model keeps the old pages). --no-mmap
    reads the weights into the daemon's own memory instead: slower to load, and the file may
    then change freely."""
    gpu_sampling: bool = False
    """A greedy request's next token is picked where the logits are computed (llama.cpp's
    backend sampler, an argmax in the model's graph), so a step copies no logits to the host
    and the compute thread does no argmax; other requests' rows still come back. Same tokens
    (tests/test_gpu_sampling.py). Off by default: on the H100 the graph's per-sequence argmax
    cost what it saved (BENCHMARKS.md "GPU", step probe); on a CPU it saves nothing."""
    cuda_graphs: bool = True
    """llama.cpp's CUDA graphs (CUDA builds only): a steady decode is captured once and then
    replayed; each new batch shape costs one capture step (the second step at that shape,
    5-9 ms more on an 8B model), which the streams see as a gap when the number of decoding
    chats changes. --no-cuda-graphs runs every step kernel by kernel, as vLLM's
    --enforce-eager: no capture steps, but each step's kernels are then launched from the
    host, which is slower, the more so on a busy host (H100: 1-19 % fewer tokens/s), and on
    the H100s measured it did not shorten the chats' longest gaps (BENCHMARKS.md "GPU", runs
    GE and GK). For diagnosis, or a driver whose captures misbehave.
    GGML_CUDA_DISABLE_GRAPHS in the environment turns them off too."""
    tick_trace: Annotated[Path | None, Parameter(show_default="off")] = None
    """Append one JSON line per engine step to this file (METRICS.md "Per-step trace"): tokens
    planned, predicted and measured step time, budget, whether the step ran ahead. A
    diagnostic for the scheduler."""
    kv_unified: Annotated[
        bool | None, Parameter(show_default="on when every layer is on a GPU (fast mode), else off")
    ] = None
    """One KV stream shared by all sessions instead of one each. Same memory, and a request
    may use any free cell (up to the model's trained context) instead of --n-ctx, but greedy
    output then depends on what else ran (SCHEDULER.md "Batch invariance"). On a GPU it is
    the faster choice under mixed load: per-session streams make llama.cpp run a tick that
    mixes decode tokens and a prompt chunk as two micro-batches (BENCHMARKS.md "GPU")."""
    kv_type: Annotated[KvType | None, Parameter(show_default="f16 (q8_0 with --deterministic)")] = None
    """K and V cache element type: f16, q8_0 or q4_0 (CONFIG.md "Choosing --kv-type")."""
    prefix_cache_cells: Annotated[int | None, Parameter(converter=whole_number, show_default="all idle")] = (
        None
    )
    """Most KV cells finished requests may leave cached for later requests sharing their
    prefix; the cache only ever holds cells no request needs; 0 turns it off (SCHEDULER.md
    "Prefix cache")."""
    snapshot_dir: Annotated[Path | None, Parameter(show_default="~/.local/state/uma-trio/snapshots")] = None
    """Where KV snapshots are saved, restored and listed from (`uma-trio snapshot`; created
    0700); another --allow-uid user's go in its own uid-N subdirectory (SECURITY.md)."""
    n_batch: WholeNumber = 2048
    """Most tokens in one tick (llama-server's default: a burst of prompts fits); at least
    --max-sessions."""
    n_ubatch: Annotated[
        int | None, Parameter(converter=whole_number, show_default="512 (32 with --deterministic)")
    ] = None
    """llama.cpp micro-batch: the weights are read once per micro-batch, so 512 prefills
    several times faster than 32; under 64 for --deterministic (SCHEDULER.md "Batch
    invariance")."""
    threads: Annotated[int | None, Parameter(converter=whole_number, show_default="all cores")] = None
    """llama.cpp threads."""

    # Scheduling (docs/SCHEDULER.md)
    tick_ms: float = 50.0
    """Tick budget (ms) when no interactive stream decodes (throughput mode), or longer where
    a step's own cost is more than a quarter of it (SCHEDULER.md "throughput tick")."""
    latency_cap: float = 1.2
    """Tick budget = this × 0.95 × the predicted decode-only tick of the interactive streams
    (SCHEDULER.md); background work only fills the headroom above that tick."""
    tick_ms_min: float = 5.0
    """Floor of the tick budget (ms)."""
    # Woken from idle, the decode task waits this long after the first arrival, twice that
    # after later ones (at most burst_max_ms), and while other requests are still on their
    # way in, so a burst of requests shares its first tick (runtime/decode_loop.py).
    burst_quiet_ms: Annotated[float, _HIDDEN] = 2.0
    burst_max_ms: Annotated[float, _HIDDEN] = 25.0
    interactive_reserve: WholeNumber = 1
    """Sessions background requests never take, so interactive ones find one; but background
    work always keeps one, so with --max-sessions at or under this a chat may wait for a
    background request to end."""
    bmt_budget_gbps: Annotated[float | None, Parameter(show_default="probed")] = None
    """Memory bandwidth (GB/s) for the ΣBMT guard. When not given it is probed at start-up
    where the weights live: a 256 MB host copy for a CPU engine, the weight bytes over the
    median of eight timed one-token steps for an engine with layers on a GPU; 0 turns the
    guard off."""
    chat_template: Annotated[Path | None, Parameter(show_default="the model's own")] = None
    """A Jinja chat template file to format chat messages with instead of the model's own
    (its GGUF's tokenizer.chat_template), as HF transformers renders it; `--model`'s model only
    (the other models of `--models-dir` keep their own). A file that cannot be read or does
    not compile is refused at start-up."""
    cost_model: Annotated[Path | None, Parameter(show_default="the calibrated file if present")] = None
    """Tick-cost coefficients from `uma-trio calibrate` (default path:
    cost-model.json in UMA_CACHE_DIR or the per-user cache, ~/.cache/uma-trio on Linux: beside
    its models/ directory). A file records the device, layers, model and engine settings it
    was measured with and is used only for the same; else, on a GPU, the daemon uses what it
    calibrated at an earlier start on the same device, model and settings (cost-models/ beside
    that file; delete it to measure again), or calibrates now (seconds on an H100, minutes on a
    slow device) and keeps the result; on a CPU it uses built-in coefficients for a 2-core
    machine. A file given here that cannot be read or is not a cost model is refused at
    start-up; a damaged default file is passed over with a warning."""

    # Limits that protect the daemon
    max_sessions: WholeNumber = 8
    """Requests generating at once (one KV sequence and stream each); more wait in a queue."""
    max_queue: WholeNumber = 64
    """Requests waiting beyond one per free session (those start at the next tick; the
    sessions kept for interactive requests count as free, so background requests may queue
    --interactive-reserve more); a burst within one tick counts too. More get E_LIMIT_004 at
    once, except that a request of a client with nothing waiting (another app's) still gets
    one of a quarter of --max-queue places more (one at least; none with 0), so one app
    filling the queue does not shut the others out. An interactive request that can start
    at once still gets past a queue of background ones."""
    max_connections: WholeNumber = 64
    """Socket connections at once; separately, HTTP generation requests in flight (--http;
    with several API keys one key holds three quarters of them at most) and connections to
    --metrics-port."""
    http_max_connections: WholeNumber = 256
    """HTTP connections open at once, idle keep-alive ones included (--http); more wait in
    the kernel's accept queue until one closes (hypercorn closes a connection idle for 5 s)."""
    max_in_flight: WholeNumber = 16
    """Requests in flight per connection."""
    max_frame_bytes: WholeNumber = 1 << 20
    """Largest frame; also the largest HTTP request body (1024 to 2^32 - 1: the length prefix
    is 4 bytes). A larger length prefix closes the connection."""
    max_prompt_tokens: WholeNumber = 4096
    """Longest accepted prompt, in tokens."""
    max_tokens: WholeNumber = 2048
    """Largest max_tokens of a request: the socket and /generate refuse more; the OpenAI,
    Anthropic and Ollama routes cut the answer there (finish reason length)."""
    idle_timeout_s: Annotated[float, Parameter(name="--idle-timeout")] = 300.0
    """Seconds a connection with nothing in flight may stay silent (any message counts as
    activity)."""
    stall_timeout_s: Annotated[float, Parameter(name="--stall-timeout")] = 30.0
    """Seconds a client may leave its events unread (one write blocked that long): its
    requests are cancelled with cancel_reason "stalled" and it is disconnected. Until then its
    streams are parked (left out of the batch). HTTP streams: the request is cancelled the
    same way and frees what it held."""
    sse_keepalive_s: Annotated[float, Parameter(name="--sse-keepalive")] = 10.0
    """Seconds an HTTP event stream (OpenAI chat and completions, Responses, Anthropic,
    /infill, /generate) may go without an event before its first token (a long prompt read,
    a wait for room or for its model), or in the background lane, before it gets one that
    says the request still runs: an SSE comment; a
    `response.in_progress` event for the Responses API, Anthropic's `ping`. Clients and
    proxies give up on a silent stream (Codex after 300 s). 0: never."""
    frame_timeout_s: Annotated[float, Parameter(name="--frame-timeout")] = 10.0
    """Seconds a frame may take to arrive whole once its first byte is in; then E_PROTO_008
    and the connection is closed. Also the deadline of an HTTP request body (408)."""
    shutdown_grace_s: Annotated[float, Parameter(name="--shutdown-grace")] = 10.0
    """Seconds running requests get to finish after SIGINT, SIGTERM or SIGHUP (then exit 0; a
    second signal stops at once; SIGHUP stays ignored where the daemon started with it
    ignored, as under nohup). Before the daemon serves (while the model loads), Ctrl-C exits
    130 and SIGTERM or SIGHUP end it by the signal (status 143 or 129), each with one log
    line."""
    stream_buffer: Annotated[WholeNumber, _HIDDEN] = 16  # token events held per request before it is parked

    # Observability (docs/METRICS.md)
    metrics_interval_s: Annotated[float, Parameter(name="--metrics-interval")] = 10.0
    """Seconds between scorecard lines in the log (and --scorecard-csv rows)."""
    metrics_window_s: Annotated[float, Parameter(name="--metrics-window")] = 60.0
    """Seconds covered by the windowed percentiles and the scorecard (METRICS.md)."""
    metrics: Annotated[str | None, Parameter(show_default="off")] = None
    """Serve Prometheus text at http://HOST:PORT/metrics on any address, for routers and
    scrapers (FLEET.md): no prompts, no request ids, no key asked; a bare PORT binds
    127.0.0.1. Instead of --metrics-port. Bound before the model loads (a taken port is a
    start-up error, exit 2), answered once the daemon serves."""
    metrics_port: Annotated[int | None, Parameter(converter=whole_number, show_default="off")] = None
    """Serve Prometheus text at http://127.0.0.1:PORT/metrics, loopback only; 0 picks a free
    port (logged). Bound before the model loads, as --metrics."""
    scorecard_csv: Annotated[Path | None, Parameter(show_default="off")] = None
    """Append a scorecard row to this CSV file every --metrics-interval seconds."""

    # HTTP gateway (docs/HTTP.md)
    http: Annotated[str | None, Parameter(show_default="off")] = None
    """Serve the OpenAI-compatible HTTP API (HTTP.md) on HOST:PORT, e.g. 127.0.0.1:8080; a
    bare PORT binds 127.0.0.1, [::1]:PORT for IPv6, port 0 picks a free one (logged). Bound
    before the model loads, so /health answers 503 "loading" meanwhile."""
    ollama: Annotated[str | None, Parameter(show_default="off")] = None
    """Also serve the HTTP API on HOST:PORT as --http does, for apps that look for Ollama at
    its own address: 11434 (Ollama's port) lets them find uma-trio unchanged. The same app,
    keys and limits as --http; either flag alone starts it."""
    api_key: Annotated[str | None, Parameter(show_default="none")] = field(default=None, repr=False)
    """With it, every HTTP path but /health needs "Authorization: Bearer KEY"; set it through
    UMA_API_KEY rather than the command line, which other users can see."""
    api_key_file: Annotated[Path | None, Parameter(show_default="none")] = field(default=None, repr=False)
    """More HTTP API keys, one per line ("#" starts a comment); any of them, or --api-key, is
    accepted, as "Authorization: Bearer KEY" or "x-api-key: KEY". Holders of different keys
    never share cached prefixes."""
    tls_cert: Annotated[Path | None, Parameter(show_default="none")] = None
    """Serve the HTTP API over HTTPS with this PEM certificate chain (with --tls-key)."""
    tls_key: Annotated[Path | None, Parameter(show_default="none")] = None
    """The PEM private key for --tls-cert (both or neither)."""
    # Web pages (http/origin.py)
    allowed_hosts: Annotated[
        tuple[str, ...], _COMMA_LIST, Parameter(show_default="IP addresses, localhost, the --http host")
    ] = ()
    """Comma-separated extra Host names the HTTP API and the metrics port answer to ("*": any);
    other Host headers (a DNS-rebinding web page) get 403 (SECURITY.md "Web pages")."""
    cors_origins: Annotated[
        tuple[str, ...] | None,
        _COMMA_LIST,
        Parameter(show_default="local pages, app://*, tauri://*, vscode-webview://*"),
    ] = None
    """Comma-separated browser origins allowed to call the HTTP API, "\\*" as a wildcard inside
    one (http://localhost:\\*; a closing ":\\*" also matches no port). The default allows
    http(s)://localhost:\\*, 127.0.0.1, [::1] and app and editor webviews. Requests from other
    origins, and Origin: null, get 403."""

    # Access control (docs/SECURITY.md)
    allowed_uids: Annotated[
        tuple[int, ...] | None,
        Parameter(name="--allow-uid", negative_iterable=(), show_default="anyone who can open the socket"),
    ] = None
    """Serve only socket clients running as this user id; repeat for more (UMA_ALLOW_UID:
    space-separated). The list is complete: the daemon's own uid is not added. A client of
    another uid, or one whose uid cannot be read, gets E_AUTH_001 and is disconnected. It only
    narrows who is served: the socket stays 0600. Logged at start-up. Does not apply to
    --http."""

    def __post_init__(self) -> None:
        # NaN passes every comparison below (each is False) and broke later: a deadline of NaN.
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        nan = [_flag(n) for n, v in values.items() if v != v]  # NaN only
        if nan:
            raise ConfigError(f"not a number: {', '.join(nan)}")
        # Quantities, not timeouts (where inf reads "never"): an infinite window could not be
        # written in the metrics' JSON, and `top` failed on it for the daemon's whole life.
        quantities = ("tick_ms", "tick_ms_min", "latency_cap", "bmt_budget_gbps", "metrics_window_s")
        infinite = [_flag(n) for n in quantities if values[n] in (math.inf, -math.inf)]
        if infinite:
            raise ConfigError(f"must be finite: {', '.join(infinite)}")
        positive = {
            "--n-ctx": self.n_ctx, "--n-batch": self.n_batch, "--n-ubatch": self.engine_n_ubatch,
            "--tick-ms": self.tick_ms,
            "--max-sessions": self.max_sessions, "--max-connections": self.max_connections,
            "--http-max-connections": self.http_max_connections,
            "--max-in-flight": self.max_in_flight, "--max-frame-bytes": self.max_frame_bytes,
            "--max-prompt-tokens": self.max_prompt_tokens, "--max-tokens": self.max_tokens,
            "--idle-timeout": self.idle_timeout_s, "--stall-timeout": self.stall_timeout_s,
            "--frame-timeout": self.frame_timeout_s, "--metrics-interval": self.metrics_interval_s,
            "--metrics-window": self.metrics_window_s, "--max-loaded": self.max_loaded,
        }  # fmt: skip
        bad = [name for name, value in positive.items() if value <= 0]
        if self.sse_keepalive_s < 0:
            bad.append("--sse-keepalive (or 0: never)")
        if bad:
            raise ConfigError(f"must be positive: {', '.join(bad)}")
        if self.n_batch < self.max_sessions:
            # Every running request decodes a token a tick: the batch holds one of each at
            # least (llama.cpp aborts at start-up otherwise: n_outputs_max).
            raise ConfigError(
                f"--n-batch ({self.n_batch}) must be at least --max-sessions ({self.max_sessions})"
            )
        if self.stream_buffer < 2:
            raise ConfigError("stream_buffer must be at least 2")
        negative = {"--max-queue": self.max_queue, "--shutdown-grace": self.shutdown_grace_s,
                    "--keep-alive": self.keep_alive_s}  # fmt: skip
        if bad := [name for name, value in negative.items() if value < 0]:
            raise ConfigError(f"must not be negative: {', '.join(bad)}")
        if not MIN_FRAME_BYTES <= self.max_frame_bytes <= MAX_FRAME_BYTES:
            # A frame's length prefix is 4 bytes; a limit under a small request's size refused them all.
            raise ConfigError(f"--max-frame-bytes must be {MIN_FRAME_BYTES} to {MAX_FRAME_BYTES}")
        if self.latency_cap < 1.0:
            raise ConfigError("--latency-cap must be at least 1.0")
        if not 0 <= self.burst_quiet_ms <= self.burst_max_ms:
            raise ConfigError("burst_quiet_ms must be between 0 and burst_max_ms")
        if self.tick_ms_min <= 0 or self.tick_ms_min > self.tick_ms:
            raise ConfigError("--tick-ms-min must be positive and at most --tick-ms")
        if self.bmt_budget_gbps is not None and self.bmt_budget_gbps < 0:
            raise ConfigError("--bmt-budget-gbps must not be negative")
        if self.kv_type is not None and self.kv_type not in KV_TYPE_NAMES:
            raise ConfigError(f"--kv-type must be one of {', '.join(KV_TYPE_NAMES)}")
        self._check_placement()
        if self.memory_budget is not None:
            parse_memory_budget(self.memory_budget, 1)  # refused at start-up, not at the first load
        if self.deterministic:
            self._check_deterministic()
        if self.prefix_cache_cells is not None and self.prefix_cache_cells < 0:
            raise ConfigError("--prefix-cache-cells must not be negative (0 turns the cache off)")
        if self.interactive_reserve < 0:
            raise ConfigError("--interactive-reserve must not be negative")
        if self.metrics is not None:
            if self.metrics_port is not None:
                raise ConfigError("give --metrics or --metrics-port, not both")
            _host_port(self.metrics, "--metrics")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("--metrics-port must be a TCP port (0: any free one)")
        if self.threads is not None and self.threads <= 0:
            raise ConfigError("--threads must be positive")
        if self.http is not None:
            self.http_address  # noqa: B018 - validates
        if self.ollama is not None:
            self.ollama_address  # noqa: B018 - validates
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key must not be empty")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.allowed_uids is not None:
            if not self.allowed_uids:
                raise ConfigError("--allow-uid must not be empty (leave it out: whoever can open the socket)")
            if any(not isinstance(uid, int) or uid < 0 for uid in self.allowed_uids):
                raise ConfigError("--allow-uid must be user ids (integers, 0 or more)")

    def _check_placement(self) -> None:
        parse_gpu_layers(self.gpu_layers)  # raises, naming the flag
        if self.flash_attn not in get_args(FlashAttn):
            raise ConfigError(f"--flash-attn must be auto, on or off, not {self.flash_attn!r}")
        if self.split_mode not in get_args(SplitMode):
            raise ConfigError(f"--split-mode must be none, layer, row or tensor, not {self.split_mode!r}")
        if self.main_gpu < 0:
            raise ConfigError(f"--main-gpu must be a device index (0 or more), not {self.main_gpu}")
        if self.tensor_split is not None and not valid_shares(self.tensor_split):
            raise ConfigError("--tensor-split must be non-negative shares such as 3,1")
        if self.split_mode == "tensor" and self.flash_attn == "off":
            raise ConfigError(
                "--split-mode tensor needs flash attention (llama.cpp computes a split layer's "
                "attention only that way): leave --flash-attn auto or on"
            )
        if self.flash_attn == "off" and self.engine_kv_type != "f16":
            raise ConfigError(
                f"--flash-attn off needs --kv-type f16 (a {self.engine_kv_type} V cache needs it)"
            )

    def _check_deterministic(self) -> None:
        if self.kv_type == "f16":
            raise ConfigError("--deterministic needs a quantized KV cache (--kv-type q8_0 or q4_0), not f16")
        if self.engine_n_ubatch > DETERMINISTIC_MAX_UBATCH:
            raise ConfigError(f"--deterministic needs --n-ubatch under 64, not {self.engine_n_ubatch}")
        if self.kv_unified:
            raise ConfigError("--deterministic needs one KV stream per session: drop --kv-unified")
        if self.flash_attn == "off":
            raise ConfigError(
                "--deterministic needs flash attention (a quantized V cache): drop --flash-attn off"
            )

    def engine_kv_unified(self, all_layers_on_gpu: bool) -> bool:
        """The KV layout in force: the one asked for, else the mode's for this placement."""
        if self.kv_unified is not None:
            return self.kv_unified
        return all_layers_on_gpu and not self.deterministic

    @property
    def engine_kv_type(self) -> KvType:
        """The KV type in force: the one asked for, else the mode's."""
        if self.kv_type is not None:
            return self.kv_type
        return DETERMINISTIC_KV_TYPE if self.deterministic else FAST_KV_TYPE

    @property
    def engine_n_ubatch(self) -> int:
        """The micro-batch in force: the one asked for, else the mode's (never above n_batch)."""
        if self.n_ubatch is not None:
            return min(self.n_ubatch, self.n_batch)
        return min(DETERMINISTIC_N_UBATCH if self.deterministic else FAST_N_UBATCH, self.n_batch)

    @property
    def engine_flash_attn(self) -> FlashAttn:
        """Deterministic mode needs flash attention on (its quantized V cache does)."""
        return "on" if self.deterministic and self.flash_attn == "auto" else self.flash_attn

    @property
    def http_address(self) -> tuple[str, int] | None:
        """``http`` as (host, port): "8080" and ":8080" mean 127.0.0.1:8080; IPv6 in brackets."""
        return None if self.http is None else _host_port(self.http, "--http")

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where Prometheus text is served: ``--metrics``, or loopback ``--metrics-port``."""
        if self.metrics is not None:
            return _host_port(self.metrics, "--metrics")
        return None if self.metrics_port is None else ("127.0.0.1", self.metrics_port)

    @property
    def ollama_address(self) -> tuple[str, int] | None:
        """``ollama`` as (host, port), read as ``http`` is."""
        return None if self.ollama is None else _host_port(self.ollama, "--ollama")


def _host_port(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "", value
    bracketed = host.startswith("[") and host.endswith("]")
    host = (host[1:-1] if bracketed else host) or "127.0.0.1"
    if not _DIGITS.fullmatch(port) or not 0 <= int(port) <= 65535 or (":" in host and not bracketed):
        raise ConfigError(f"{flag} must be HOST:PORT with a TCP port (0: any free one): {value!r}")
    return host, int(port)


def read_api_keys(path: Path) -> tuple[str, ...]:
    """The keys in an ``--api-key-file``: one per line, blank lines and ``#`` comments
    skipped.  ``ValueError`` naming the file when it cannot be read or holds none."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read --api-key-file {path}: {exc.strerror or exc}") from None
    keys = tuple(k for line in text.splitlines() if (k := line.split("#", 1)[0].strip()))
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key")
    return keys


def _flag(field_name: str) -> str:
    """The command-line flag of a ServerConfig field (``stall_timeout_s`` → ``--stall-timeout``)."""
    return "--" + field_name.removesuffix("_s").replace("_", "-")
