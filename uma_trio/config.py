"""Daemon settings: one frozen dataclass, filled by the CLI (flags and ``UMA_*``)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args


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
SplitMode = Literal["none", "layer", "row"]

# The engine settings of the two modes (docs/CONFIG.md): fast, as llama-server runs, or
# deterministic, where greedy output does not depend on batching, chunking or the cache.
FAST_N_UBATCH = 512
FAST_KV_TYPE: KvType = "f16"
DETERMINISTIC_N_UBATCH = 32
DETERMINISTIC_KV_TYPE: KvType = "q8_0"
DETERMINISTIC_MAX_UBATCH = 63  # llama.cpp's CPU matrix kernels change arithmetic at 64 tokens


GpuLayersMode = Literal["auto", "all"]


def parse_gpu_layers(value: str) -> GpuLayersMode | int:
    """``auto``, ``all`` or a layer count (0 or more); anything else is a ValueError that
    names the flag."""
    text = value.strip().lower()
    if text in ("auto", "all"):
        return "auto" if text == "auto" else "all"
    if text.isdigit():
        return int(text)
    raise ValueError(f"--gpu-layers must be auto, all or a number of layers (0 or more), not {value!r}")


@dataclass(frozen=True)
class ServerConfig:
    socket_path: Path = DEFAULT_SOCKET
    # Engine
    n_ctx: int = 4096  # KV cells per request (prompt + max_tokens); KV holds n_ctx * max_sessions
    # One KV stream for all sessions (not batch-invariant); None: on when every layer is on a
    # GPU in the fast mode, where llama.cpp would otherwise run a tick that mixes decode tokens
    # and a prompt chunk as two micro-batches (docs/BENCHMARKS.md "GPU"), else off.
    kv_unified: bool | None = None
    # K and V cache element type; None: f16 (fast), or q8_0 with --deterministic, which keeps
    # greedy output exact across batching, chunking and cache hits (docs/CONFIG.md).
    kv_type: KvType | None = None
    # Exact, batch-invariant greedy output (q8_0 KV, micro-batches under 64, one KV stream per
    # session) instead of llama-server's fast settings.
    deterministic: bool = False
    # Let the compute thread start the next decode of a steady batch before the event loop
    # has seen the last one (runtime/run_ahead.py); None: on when every layer is on a GPU.
    run_ahead: bool | None = None
    tick_trace: Path | None = None  # one JSON line per engine step (runtime/tick_trace.py)
    # Placement (docs/CONFIG.md "GPU"): "auto" | "all" | a layer count
    gpu_layers: str = "auto"
    flash_attn: FlashAttn = "auto"
    main_gpu: int = 0
    split_mode: SplitMode = "layer"
    tensor_split: tuple[float, ...] | None = None
    # Prefix cache (docs/SCHEDULER.md): most KV cells finished requests may leave cached for
    # reuse; None: any cells no request needs; 0: off.
    prefix_cache_cells: int | None = None
    snapshot_dir: Path | None = None  # KV snapshots; None: the per-user state directory
    n_batch: int = 2048  # most tokens per tick (llama-server's default: a burst of prompts fits)
    n_ubatch: int | None = None  # llama.cpp micro-batch; None: 512, or 32 with --deterministic
    threads: int | None = None  # llama.cpp threads; default all cores
    # Scheduling (docs/SCHEDULER.md)
    tick_ms: float = 50.0  # tick budget when no interactive stream decodes (throughput mode)
    latency_cap: float = 1.2  # tick budget = latency_cap × predicted interactive decode tick
    tick_ms_min: float = 5.0  # floor of the tick budget
    # Woken from idle, the decode task waits this long after each arrival (at most
    # burst_max_ms) so a burst of requests shares its first tick (runtime/decode_loop.py).
    burst_quiet_ms: float = 1.0
    burst_max_ms: float = 5.0
    interactive_reserve: int = 1  # seq ids background requests never take (they keep at least one)
    bmt_budget_gbps: float | None = None  # ΣBMT guard bandwidth; None: probed at start-up; 0: off
    cost_model: Path | None = None  # `uma-trio calibrate` output; None: built-in coefficients
    # Limits that protect the daemon
    max_sessions: int = 8  # requests decoding at once (one KV seq id and stream each)
    max_queue: int = 64  # accepted requests waiting for a session slot
    max_connections: int = 64
    http_max_connections: int = 256  # open HTTP connections (keep-alive ones too); more wait to be accepted
    max_in_flight: int = 16  # per connection
    max_frame_bytes: int = 1 << 20
    max_prompt_tokens: int = 4096
    max_tokens: int = 2048  # per request
    idle_timeout_s: float = 300.0  # a connection with nothing in flight
    stall_timeout_s: float = 30.0  # a connection that reads none of its events for this long is cut off
    frame_timeout_s: float = 10.0  # a frame begun must arrive whole within this
    shutdown_grace_s: float = 10.0
    stream_buffer: int = 16  # token events held per request before it is parked
    # Observability (docs/METRICS.md)
    metrics_interval_s: float = 10.0  # scorecard log line (and CSV row) period
    metrics_window_s: float = 60.0  # sliding window of the windowed percentiles and the scorecard
    metrics_port: int | None = None  # Prometheus text on http://127.0.0.1:PORT/metrics; 0: any free port
    scorecard_csv: Path | None = None  # append a scorecard row every metrics_interval_s
    # HTTP gateway (docs/HTTP.md)
    http: str | None = None  # "HOST:PORT" (or "PORT", on 127.0.0.1) for the OpenAI-compatible API
    api_key: str | None = field(default=None, repr=False)  # HTTP requests need "Authorization: Bearer <key>"
    api_key_file: Path | None = field(default=None, repr=False)  # more keys, one per line ("#": a comment)
    tls_cert: Path | None = None  # serve the HTTP API over TLS with this certificate chain...
    tls_key: Path | None = None  # ...and this private key (both or neither)
    # Web pages (http/origin.py): Host names besides IP addresses, localhost and the --http
    # host ("*": any); browser origins allowed (None: local pages, app and editor webviews).
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] | None = None
    # Access control (docs/SECURITY.md): peer uids the socket serves; None: whoever can open
    # the 0600 socket (our uid and root).  Authoritative: our own uid is not added.
    allowed_uids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        positive = {
            "n_ctx": self.n_ctx, "n_batch": self.n_batch, "n_ubatch": self.engine_n_ubatch,
            "tick_ms": self.tick_ms,
            "max_sessions": self.max_sessions, "max_connections": self.max_connections,
            "http_max_connections": self.http_max_connections,
            "max_in_flight": self.max_in_flight, "max_frame_bytes": self.max_frame_bytes,
            "max_prompt_tokens": self.max_prompt_tokens, "max_tokens": self.max_tokens,
            "idle_timeout_s": self.idle_timeout_s, "stall_timeout_s": self.stall_timeout_s,
            "frame_timeout_s": self.frame_timeout_s, "metrics_interval_s": self.metrics_interval_s,
            "metrics_window_s": self.metrics_window_s,
        }  # fmt: skip
        bad = [name for name, value in positive.items() if value <= 0]
        if bad:
            raise ValueError(f"must be positive: {', '.join(bad)}")
        if self.stream_buffer < 2:
            raise ValueError("stream_buffer must be at least 2")
        if self.max_queue < 0 or self.shutdown_grace_s < 0:
            raise ValueError("max_queue and shutdown_grace_s must not be negative")
        if self.latency_cap < 1.0:
            raise ValueError("latency_cap must be at least 1.0")
        if not 0 <= self.burst_quiet_ms <= self.burst_max_ms:
            raise ValueError("burst_quiet_ms must be between 0 and burst_max_ms")
        if self.tick_ms_min <= 0 or self.tick_ms_min > self.tick_ms:
            raise ValueError("tick_ms_min must be positive and at most tick_ms")
        if self.bmt_budget_gbps is not None and self.bmt_budget_gbps < 0:
            raise ValueError("bmt_budget_gbps must not be negative")
        if self.kv_type is not None and self.kv_type not in KV_TYPE_NAMES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_TYPE_NAMES)}")
        self._check_placement()
        if self.deterministic:
            self._check_deterministic()
        if self.prefix_cache_cells is not None and self.prefix_cache_cells < 0:
            raise ValueError("prefix_cache_cells must not be negative (0 turns the cache off)")
        if self.interactive_reserve < 0:
            raise ValueError("interactive_reserve must not be negative")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be a TCP port (0: any free one)")
        if self.threads is not None and self.threads <= 0:
            raise ValueError("threads must be positive")
        if self.http is not None:
            self.http_address  # noqa: B018 - validates
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.allowed_uids is not None:
            if not self.allowed_uids:
                raise ValueError("allowed_uids must not be empty (None: whoever can open the socket)")
            if any(not isinstance(uid, int) or uid < 0 for uid in self.allowed_uids):
                raise ValueError("allowed_uids must be user ids (integers, 0 or more)")

    def _check_placement(self) -> None:
        parse_gpu_layers(self.gpu_layers)  # raises, naming the flag
        if self.flash_attn not in get_args(FlashAttn):
            raise ValueError(f"--flash-attn must be auto, on or off, not {self.flash_attn!r}")
        if self.split_mode not in get_args(SplitMode):
            raise ValueError(f"--split-mode must be none, layer or row, not {self.split_mode!r}")
        if self.main_gpu < 0:
            raise ValueError(f"--main-gpu must be a device index (0 or more), not {self.main_gpu}")
        if self.tensor_split is not None and (
            not self.tensor_split or any(not s >= 0 for s in self.tensor_split) or sum(self.tensor_split) <= 0
        ):
            raise ValueError("--tensor-split must be non-negative shares such as 3,1")
        if self.flash_attn == "off" and self.engine_kv_type != "f16":
            raise ValueError(
                f"--flash-attn off needs --kv-type f16 (a {self.engine_kv_type} V cache needs it)"
            )

    def _check_deterministic(self) -> None:
        if self.kv_type == "f16":
            raise ValueError("--deterministic needs a quantized KV cache (--kv-type q8_0 or q4_0), not f16")
        if self.engine_n_ubatch > DETERMINISTIC_MAX_UBATCH:
            raise ValueError(f"--deterministic needs --n-ubatch under 64, not {self.engine_n_ubatch}")
        if self.kv_unified:
            raise ValueError("--deterministic needs one KV stream per session: drop --kv-unified")
        if self.flash_attn == "off":
            raise ValueError(
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
        if self.http is None:
            return None
        host, sep, port = self.http.rpartition(":")
        if not sep:
            host, port = "", self.http
        bracketed = host.startswith("[") and host.endswith("]")
        host = (host[1:-1] if bracketed else host) or "127.0.0.1"
        if not port.isdigit() or not 0 <= int(port) <= 65535 or (":" in host and not bracketed):
            raise ValueError(f"http must be HOST:PORT with a TCP port (0: any free one), not {self.http!r}")
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
