"""Aggregate decode tokens/s with 1, 4 and 8 concurrent streams, side by side:

* ``daemon``: uma-trio serving real clients over its Unix socket;
* ``bare``:   a plain llama-cpp-python batched decode loop (llama_batch_init,
  llama_decode, greedy argmax) with the same context settings: the engine's ceiling.

Both decode ``--tokens`` tokens per stream after the prompt, greedy, and count
only decode time (from each stream's first token to its last).  Prints a table
with the ratio and writes ``benches/results/decode_throughput.csv``.

    python benches/decode_throughput.py [--tokens 128] [--streams 1 4 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llama_cpp as llama
import numpy as np
import trio
from bench_output import write_csv

from uma_trio.client import UmaClient
from uma_trio.config import ServerConfig
from uma_trio.daemon import serving
from uma_trio.engine.llama import LlamaModel
from uma_trio.model_files import ensure_default_model
from uma_trio.protocol.messages import TokenEvent

PROMPT = "Write a long story about a lighthouse keeper."
N_CTX_SEQ = 1024  # KV cells per stream: the prompt plus --tokens fit easily
N_UBATCH = 32


def bare_loop(model: LlamaModel, streams: int, tokens: int, kv_unified: bool) -> float:
    """Tokens/s of a bare batched greedy decode loop over ``streams`` sequences."""
    params = llama.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = N_CTX_SEQ * streams, 512, N_UBATCH
    params.n_seq_max, params.kv_unified = streams, kv_unified
    params.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
    params.n_threads = params.n_threads_batch = os.cpu_count() or 1  # as the daemon does
    ctx = llama.llama_init_from_model(model.handle, params)
    batch = llama.llama_batch_init(512, 0, 1)
    prompt = model.tokenize(model.apply_chat_template([("user", PROMPT)]))

    def add(i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits

    try:
        n = 0
        for seq in range(streams):
            for j, tok in enumerate(prompt):
                add(n, int(tok), j, seq, j == len(prompt) - 1)
                n += 1
        batch.n_tokens = n
        assert llama.llama_decode(ctx, batch) == 0
        rows = [(seq + 1) * len(prompt) - 1 for seq in range(streams)]
        vocab = model.n_vocab
        nxt = [
            int(np.argmax(np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, r), (vocab,)))) for r in rows
        ]
        started = time.perf_counter()
        for step in range(tokens - 1):
            for seq in range(streams):
                add(seq, nxt[seq], len(prompt) + step, seq, True)
            batch.n_tokens = streams
            assert llama.llama_decode(ctx, batch) == 0
            for seq in range(streams):
                row = np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, seq), (vocab,))
                nxt[seq] = int(np.argmax(row))
        return streams * (tokens - 1) / (time.perf_counter() - started)
    finally:
        llama.llama_batch_free(batch)
        llama.llama_free(ctx)


async def daemon_run(model: LlamaModel, streams: int, tokens: int, kv_unified: bool) -> float:
    """Tokens/s the daemon delivers to ``streams`` clients decoding at once."""
    with tempfile.TemporaryDirectory(prefix="uma-bench-") as tmp:
        config = ServerConfig(
            socket_path=Path(tmp) / "b.sock", n_ctx=N_CTX_SEQ, n_ubatch=N_UBATCH, kv_unified=kv_unified,
            max_sessions=streams, max_tokens=tokens, metrics_interval_s=3600, bmt_budget_gbps=0.0,
        )  # fmt: skip
        firsts: list[float] = []
        lasts: list[float] = []
        counts: list[int] = []

        async def client(path: Path) -> None:
            async with UmaClient.connect(path) as c:
                request = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
                           "temperature": 0.0, "stop": []}  # fmt: skip
                times = []
                async with c.stream(**request) as events:
                    async for event in events:
                        if isinstance(event, TokenEvent):
                            times.append(time.perf_counter())
                firsts.append(times[0])
                lasts.append(times[-1])
                counts.append(len(times))

        async with serving(model, config), trio.open_nursery() as clients:
            for _ in range(streams):
                clients.start_soon(client, config.socket_path)
        # Decode window: once every stream has its first token, until the last token.
        window = max(lasts) - max(firsts)
        tokens_in_window = sum(c - 1 for c in counts)  # first tokens excluded
        return tokens_in_window / window if window > 0 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--kv-unified", action="store_true", help="one KV stream for all sequences")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "decode_throughput.csv"
    )
    args = parser.parse_args()

    model = LlamaModel(ensure_default_model())
    rows = []
    print(f"{'streams':>7} {'bare tok/s':>11} {'daemon tok/s':>13} {'daemon/bare':>12}")
    for streams in args.streams:
        # On a thread of its own: llama.cpp's OpenMP team lives as long as its calling
        # thread, and a lingering one would slow the daemon run (docs/BENCHMARKS.md).
        with ThreadPoolExecutor(max_workers=1) as pool:
            bare = pool.submit(bare_loop, model, streams, args.tokens, args.kv_unified).result()
        daemon = trio.run(daemon_run, model, streams, args.tokens, args.kv_unified)
        rows.append({"streams": streams, "kv_unified": args.kv_unified,
                     "bare_tok_s": round(bare, 1), "daemon_tok_s": round(daemon, 1),
                     "ratio": round(daemon / bare, 3)})  # fmt: skip
        print(f"{streams:>7} {bare:>11.1f} {daemon:>13.1f} {daemon / bare:>12.2f}")
    write_csv(args.out, rows, list(rows[0]))
    model.close()


if __name__ == "__main__":
    main()
