"""The long-context KV sweep (the seeds' benchmark B): decode tokens/s at several context
depths with the KV cache stored as f16, q8_0 or q4_0.

    python benches/long_ctx.py [--depths 2048 8192] [--kv-types f16 q8_0 q4_0]
                               [--streams 1] [--steps 64] [--repeats 3] [--n-ubatch 32]
                               [--fill text|random]

For each KV type the script opens one :class:`~uma_trio.engine.llama.LlamaEngine` on the
default model (SmolLM2-135M, n_ctx_train 8192) and fills sequence 0 with synthetic tokens,
depth by depth in increasing order: it prefills up to the first depth (in ``n_batch``
chunks, the last one sampling the first new token greedily), measures, prefills on to the
next depth, and so on, so each type prefills the largest depth exactly once.  A measurement
at depth D copies sequence 0 into sequences 1..S-1 (``copy_seq``) for S ``--streams``, then
runs ``--warmup`` + ``--steps`` greedy decode steps of one token per stream, timing only the
last ``--steps``; afterwards it trims sequence 0 back to D cells and frees the copies, so the
next measurement and the next prefill segment start from exactly the same KV state.  Each
measurement runs ``--repeats`` times and keeps the fastest (anything else running on the
machine can only slow a run down; with llama.cpp's threads on every core a busy neighbour
can slow it 10-100 fold), and the median goes to the CSV.  ``cpu`` in the table is the CPU
time the process got over wall time × threads (the lower of the decode's and the prefill
segment's): llama.cpp's threads spin, so about 1.0 means the run had the cores to itself
and anything well below (say < 0.9) means something else was running.

Reported per (kv_type, depth, streams):

* decode tok/s and ms per step (wall time around ``step_sync``: llama_decode, greedy
  sampling and the hand-off to the engine's compute thread), and the ratio to f16's tok/s
  at the same depth and streams;
* KV MB: the KV bytes one decode step reads (S × D cells × bytes per cell, bytes per cell
  from :func:`~uma_trio.engine.memory_profile.memory_profile` with ``KV_TYPES``' element
  size), plus the whole context's allocation in the CSV; ``GB/s``: (weights + KV read) per
  step over the step time, the ΣBMT view the seeds ask for (does throughput track bytes?);
* agree: how many of the first 16 greedy tokens generated after the deep context (the one
  sampled at the end of the prefill included) match f16's at the same depth, counted as
  the length of the common prefix, since once one token differs the rest follow a
  different text.  This is agreement with f16, not with the truth: for decode with one
  stream and an f16 cache of 512+ cells, ggml's CPU flash attention takes its split-KV path
  (keys split across threads, values summed in f16 per chunk); two or more streams, and
  quantized caches, take the one-chunk path instead.  So f16's own tokens differ between 1
  and 2+ streams at depth, and each stream count is compared with f16 at that count;
* prefill tok/s of the segment that brought the context to D (n_ubatch-sized micro-batches,
  each attending to everything before it, so later segments are slower).

The fill is either ``text`` (default: sentences drawn at random, seeded, from a small
built-in set; natural locally, never periodic) or ``random`` (seeded random token ids away
from the special tokens).  Both are the same for every KV type.  Depths above the model's
trained context (8192 for SmolLM2-135M; 16384 works, with n_ctx_seq sized to fit) run, but
RoPE positions beyond training make the output text meaningless; decode speed is still
valid.  Writes ``benches/results/long_ctx.csv`` and, with matplotlib, ``long_ctx.png``.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
from bench_output import write_csv

from uma_trio.engine.base import BatchEntry, TokenArray
from uma_trio.engine.llama import KV_TYPES, ContextConfig, LlamaEngine, LlamaModel
from uma_trio.engine.memory_profile import memory_profile
from uma_trio.engine.sampling import Sampler, SamplingParams
from uma_trio.model_files import ensure_default_model

RESULTS = Path(__file__).parent / "results"
AGREE_TOKENS = 16  # greedy tokens compared with f16

SENTENCES = [
    "The lighthouse keeper climbed the spiral stairs every evening before the sun went down.",
    "Fishermen in the harbour mended their nets while gulls argued over scraps on the pier.",
    "A storm rolled in from the west, and the rain drummed on the slate roofs of the village.",
    "She kept a logbook of every ship that passed, its name, its flag and the hour it was seen.",
    "In winter the island was cut off for weeks, and the supply boat came only when the sea allowed.",
    "The old lamp burned paraffin, and its brass fittings had to be polished by hand each morning.",
    "Children from the mainland sometimes visited in summer and asked to see the great lens turn.",
    "He wrote letters to his sister in the city, describing the colours of the sky at dawn.",
    "When the fog came down, the horn sounded every thirty seconds until the air cleared again.",
    "The garden behind the cottage grew potatoes, cabbages and a stubborn row of sweet peas.",
    "Once a year an inspector arrived to check the clockwork, the fuel stores and the records.",
    "At night the beam swept across the water, touching the rocks, the waves and the far shore.",
    "A cat had arrived on a fishing boat one spring and decided to stay for the rest of its life.",
    "The radio crackled with weather reports, shipping forecasts and, rarely, music from abroad.",
    "Nobody remembered who had carved the initials into the railing at the top of the tower.",
    "By the end of the season the keeper knew every sound the building made in the wind.",
]


@dataclass
class Measurement:
    kv_type: str
    depth: int
    streams: int
    steps: int
    decode_tok_s: float  # the fastest of --repeats runs
    median_tok_s: float
    ms_per_step: float
    llama_ms_per_step: float  # StepResult.decode_s: llama_decode plus sampling
    cpu_share: float  # CPU time this process got / (wall time × threads); well under 1: contended
    ratio_vs_f16: float | None
    kv_bytes_per_cell: int
    kv_read_mb: float  # KV one decode step reads: streams * depth cells
    kv_alloc_mb: float  # the whole context's KV cache
    step_mb: float  # weights + KV read: the bytes one decode step moves (ΣBMT)
    gb_per_s: float  # (weights + KV read) per step / step time
    agree_f16: int | None  # common prefix with f16's first AGREE_TOKENS greedy tokens
    prefill_tokens: int  # the segment that brought seq 0 to this depth
    prefill_s: float
    prefill_tok_s: float
    prefill_cpu_share: float
    first_text: str  # the first AGREE_TOKENS generated tokens, as text


def fill_tokens(model: LlamaModel, n: int, kind: str, seed: int) -> TokenArray:
    """``n`` synthetic context tokens, the same for every run with the same seed."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        # Well clear of the control tokens at the low ids and any at the top.
        return rng.integers(1000, model.n_vocab - 1000, size=n, dtype=np.int32)
    pieces: list[TokenArray] = []
    have = 0
    while have < n:
        text = " ".join(SENTENCES[i] for i in rng.permutation(len(SENTENCES)))
        tokens = model.tokenize(" " + text)
        pieces.append(tokens)
        have += len(tokens)
    return np.concatenate(pieces)[:n].astype(np.int32)


def prefill(engine: LlamaEngine, tokens: TokenArray, pos0: int) -> int:
    """Append ``tokens`` to sequence 0 at ``pos0``; returns the greedy next token."""
    n_batch = engine.n_batch
    next_token = -1
    for start in range(0, len(tokens), n_batch):
        chunk = tokens[start : start + n_batch]
        last = start + n_batch >= len(tokens)
        sampler = Sampler(SamplingParams(temperature=0.0)) if last else None
        result = engine.step_sync([BatchEntry(0, chunk, pos0 + start, sampler)])
        if last:
            next_token = result.sampled[0].token_id
    return next_token


@dataclass
class DecodeRun:
    tokens: list[int]  # sequence 0's, the one sampled at the end of the prefill first
    seconds: float  # wall time of the timed steps
    llama_s: float  # their summed StepResult.decode_s
    cpu_s: float  # this process's CPU time meanwhile


def decode(engine: LlamaEngine, first: int, depth: int, streams: int, warmup: int, steps: int) -> DecodeRun:
    """Greedy-decode ``warmup + steps`` tokens per stream after ``depth`` cells of sequence 0,
    timing the last ``steps``.  Leaves the cache as it found it."""
    for seq in range(1, streams):
        engine.copy_seq(0, seq, depth)
    greedy = Sampler(SamplingParams(temperature=0.0))
    current = [first] * streams
    generated = [first]
    started = time.perf_counter()
    cpu_started = time.process_time()
    llama_s = 0.0
    try:
        for i in range(warmup + steps):
            if i == warmup:
                started = time.perf_counter()
                cpu_started = time.process_time()
                llama_s = 0.0
            entries = [
                BatchEntry(seq, np.array([current[seq]], dtype=np.int32), depth + i, greedy)
                for seq in range(streams)
            ]
            result = engine.step_sync(entries)
            llama_s += result.decode_s
            for sampled in result.sampled:
                current[sampled.seq_id] = sampled.token_id
            generated.append(current[0])
        elapsed = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started
    finally:
        engine.trim_seq(0, depth)
        for seq in range(1, streams):
            engine.free_seq(seq)
    return DecodeRun(generated, elapsed, llama_s, cpu_s)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def sweep_type(
    model: LlamaModel, kv_type: str, args: argparse.Namespace, fill: TokenArray
) -> tuple[list[Measurement], dict[tuple[int, int], list[int]]]:
    """All depths and stream counts for one KV type; also returns the generated tokens."""
    depths = sorted(args.depths)
    profile = memory_profile(model, args.n_ubatch, kv_type_bytes=KV_TYPES[kv_type][1])
    bpc = profile.kv_bytes_per_cell
    config = ContextConfig(
        # A whole number of llama.cpp's 256-cell pads, or it rounds the context and warns.
        n_ctx_seq=-(-(depths[-1] + args.warmup + args.steps + 1) // 256) * 256,
        n_batch=args.n_batch,
        n_ubatch=args.n_ubatch,
        n_seq_max=max(args.streams),
        n_threads=args.threads,
        kv_type=kv_type,
    )
    engine = LlamaEngine(model, config)
    threads = args.threads or os.cpu_count() or 1
    rows: list[Measurement] = []
    outputs: dict[tuple[int, int], list[int]] = {}
    try:
        filled = 0
        first = -1
        for depth in depths:
            t0, cpu0 = time.perf_counter(), time.process_time()
            segment = depth - filled
            if segment > 0:
                first = prefill(engine, fill[filled:depth], filled)
            prefill_s = time.perf_counter() - t0
            prefill_share = (time.process_time() - cpu0) / (prefill_s * threads)
            filled = depth
            for streams in sorted(args.streams):
                runs = [
                    decode(engine, first, depth, streams, args.warmup, args.steps)
                    for _ in range(args.repeats)
                ]
                tokens = runs[0].tokens
                if any(run.tokens != tokens for run in runs):
                    print(f"warning: {kv_type} depth {depth}: repeated runs generated different tokens")
                best = min(runs, key=lambda run: run.seconds)
                elapsed = best.seconds
                median_s = float(np.median([run.seconds for run in runs]))
                outputs[(depth, streams)] = tokens
                step_s = elapsed / args.steps
                kv_read = streams * depth * bpc
                text = b"".join(model.piece(t) for t in tokens[:AGREE_TOKENS])
                rows.append(
                    Measurement(
                        kv_type=kv_type, depth=depth, streams=streams, steps=args.steps,
                        decode_tok_s=round(streams * args.steps / elapsed, 1),
                        median_tok_s=round(streams * args.steps / median_s, 1),
                        ms_per_step=round(1e3 * step_s, 2),
                        llama_ms_per_step=round(1e3 * best.llama_s / args.steps, 2),
                        cpu_share=round(best.cpu_s / (elapsed * threads), 2),
                        ratio_vs_f16=None, kv_bytes_per_cell=bpc,
                        kv_read_mb=round(kv_read / 1e6, 1),
                        kv_alloc_mb=round(engine.n_ctx * bpc / 1e6, 1),
                        step_mb=round((profile.weight_bytes + kv_read) / 1e6, 1),
                        gb_per_s=round((profile.weight_bytes + kv_read) / step_s / 1e9, 2),
                        agree_f16=None, prefill_tokens=segment, prefill_s=round(prefill_s, 2),
                        prefill_tok_s=round(segment / prefill_s, 1) if segment > 0 else 0.0,
                        prefill_cpu_share=round(prefill_share, 2),
                        first_text=text.decode("utf-8", errors="replace").replace("\n", "\\n"),
                    )
                )  # fmt: skip
                print_row(rows[-1], flush=True)
    finally:
        engine.close()
    return rows, outputs


HEADER = (
    f"{'kv_type':>7} {'depth':>6} {'streams':>7} {'tok/s':>7} {'median':>7} {'ms/step':>8} {'vs f16':>7} "
    f"{'KV MB':>7} {'GB/s':>6} {'agree':>6} {'prefill tok/s':>13} {'cpu':>5}"
)


def print_row(m: Measurement, *, flush: bool = False) -> None:
    ratio = f"{m.ratio_vs_f16:.2f}" if m.ratio_vs_f16 is not None else "-"
    agree = f"{m.agree_f16}/{AGREE_TOKENS}" if m.agree_f16 is not None else "-"
    prefill = f"{m.prefill_tok_s:.0f}" if m.prefill_tokens else "-"
    print(
        f"{m.kv_type:>7} {m.depth:>6} {m.streams:>7} {m.decode_tok_s:>7.1f} {m.median_tok_s:>7.1f} "
        f"{m.ms_per_step:>8.2f} {ratio:>7} {m.kv_read_mb:>7.1f} {m.gb_per_s:>6.2f} {agree:>6} {prefill:>13} "
        f"{min(m.cpu_share, m.prefill_cpu_share if m.prefill_tokens else 1.0):>5.2f}",
        flush=flush,
    )


def plot(rows: list[Measurement], path: Path) -> None:
    """tok/s against depth, and ms/step against the bytes a step moves (ΣBMT)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kv_type in dict.fromkeys(m.kv_type for m in rows):
        for streams in sorted({m.streams for m in rows}):
            sel = [m for m in rows if m.kv_type == kv_type and m.streams == streams]
            label = f"{kv_type}, {streams} stream{'s' if streams > 1 else ''}"
            left.plot([m.depth for m in sel], [m.decode_tok_s for m in sel], marker="o", label=label)
            right.plot([m.step_mb for m in sel], [m.ms_per_step for m in sel], marker="o", label=label)
    left.set(xlabel="context depth (tokens)", ylabel="decode tokens/s", xscale="log", title="decode speed")
    right.set(
        xlabel="MB read per step (weights + KV)", ylabel="ms per step", title="step time vs bytes (ΣBMT)"
    )
    depths = sorted({m.depth for m in rows})
    left.set_xticks(depths, labels=[str(d) for d in depths])
    left.minorticks_off()
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    right.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--depths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--kv-types", nargs="+", choices=list(KV_TYPES), default=list(KV_TYPES))
    parser.add_argument("--streams", type=int, nargs="+", default=[1], help="concurrent sequences")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps first")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the fastest counts")
    parser.add_argument(
        "--n-ubatch",
        type=int,
        default=32,
        help="prefill micro-batch (32: --deterministic's; the daemon's fast default is 512)",
    )
    parser.add_argument("--n-batch", type=int, default=512, help="prefill chunk")
    parser.add_argument("--threads", type=int, default=None, help="default: all cores")
    parser.add_argument("--fill", choices=["text", "random"], default="text")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "long_ctx.csv")
    parser.add_argument("--png", type=Path, default=RESULTS / "long_ctx.png")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    if args.warmup + args.steps + 1 < AGREE_TOKENS:
        parser.error(f"--warmup + --steps must give at least {AGREE_TOKENS} tokens to compare")

    started = time.perf_counter()
    model = LlamaModel(ensure_default_model())
    if max(args.depths) + args.warmup + args.steps > model.n_ctx_train:
        print(
            f"note: positions up to {max(args.depths) + args.warmup + args.steps} exceed the model's "
            f"trained context ({model.n_ctx_train}); speed is valid, the generated text is not"
        )
    fill = fill_tokens(model, max(args.depths), args.fill, args.seed)
    # f16 first: the others are compared with it.
    kv_types = sorted(dict.fromkeys(args.kv_types), key=lambda t: t != "f16")
    rows: list[Measurement] = []
    reference: dict[tuple[int, int], tuple[float, list[int]]] = {}
    print(HEADER)
    for kv_type in kv_types:
        type_rows, outputs = sweep_type(model, kv_type, args, fill)
        for m in type_rows:
            key = (m.depth, m.streams)
            if kv_type == "f16":
                reference[key] = (m.decode_tok_s, outputs[key])
            if key in reference:
                f16_tok_s, f16_tokens = reference[key]
                m.ratio_vs_f16 = round(m.decode_tok_s / f16_tok_s, 3)
                m.agree_f16 = common_prefix(outputs[key][:AGREE_TOKENS], f16_tokens[:AGREE_TOKENS])
        rows.extend(type_rows)
    model.close()

    print(f"\nsummary ({args.fill} fill, n_ubatch {args.n_ubatch}, {args.steps} timed steps):")
    print(HEADER)
    for m in sorted(rows, key=lambda m: (m.depth, m.streams, kv_types.index(m.kv_type))):
        print_row(m)
    write_csv(args.out, (asdict(m) for m in rows), [f.name for f in fields(Measurement)])
    if not args.no_plot:
        plot(rows, args.png)
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
