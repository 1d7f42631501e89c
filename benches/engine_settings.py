"""Engine settings against each other: micro-batch, KV type and flash attention (issue 16).

For each combination of ``--n-ubatch`` (32/128/512), ``--kv-type`` (f16/q8_0) and
``--flash-attn`` (on/off; off only with f16) this loads the engine (the daemon's own
``LlamaEngine``, no server) and measures

* prefill tokens/s of a 1,500-token prompt in ``n_batch`` chunks (what TTFT is made of), and
* decode tokens/s of 1, 8 and 16 streams at ~200 cells of context (greedy, 64 steps).

It prints a table and writes ``OUT/engine_settings.csv``; GPU layers follow ``--gpu-layers``.

    python benches/engine_settings.py [--model PATH] [--gpu-layers N] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import time
from pathlib import Path

import numpy as np

from uma_trio.engine.base import BatchEntry
from uma_trio.engine.llama import ContextConfig, LlamaEngine, LlamaModel, Placement
from uma_trio.engine.sampling import Sampler, SamplingParams
from uma_trio.model_files import ensure_default_model

TEXT = "The history of the lighthouse keepers of the northern coast, told chapter by chapter. " * 200


def prefill_rate(engine: LlamaEngine, tokens: np.ndarray) -> float:
    started = time.perf_counter()
    for pos in range(0, len(tokens), engine.n_batch):
        chunk = tokens[pos : pos + engine.n_batch]
        engine.step_sync([BatchEntry(0, chunk, pos, None)])
    took = time.perf_counter() - started
    engine.free_seq(0)
    return len(tokens) / took


def decode_rate(engine: LlamaEngine, tokens: np.ndarray, streams: int, steps: int) -> float:
    greedy = Sampler(SamplingParams(temperature=0.0))
    depth = 200
    for seq in range(streams):
        engine.step_sync([BatchEntry(seq, tokens[:depth], 0, None)])
    last = {seq: int(tokens[depth]) for seq in range(streams)}
    started = time.perf_counter()
    for k in range(steps):
        step = [BatchEntry(s, np.array([last[s]], np.int32), depth + k, greedy) for s in range(streams)]
        last = {x.seq_id: x.token_id for x in engine.step_sync(step).sampled}
    took = time.perf_counter() - started
    for seq in range(streams):
        engine.free_seq(seq)
    return streams * steps / took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--gpu-layers", type=int, default=0)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("benches/results/engine_settings"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = LlamaModel(args.model or ensure_default_model(), Placement(n_gpu_layers=args.gpu_layers))
    rows = []
    try:
        for ubatch, kv, fa in itertools.product((32, 128, 512), ("f16", "q8_0"), ("on", "off")):
            if fa == "off" and kv != "f16":
                continue
            config = ContextConfig(n_ctx_seq=2048, n_seq_max=16, n_ubatch=ubatch, kv_type=kv, flash_attn=fa)  # type: ignore[arg-type]
            engine = LlamaEngine(model, config)
            try:
                tokens = engine.tokenize(TEXT)[:1500]
                row: dict[str, object] = {"n_ubatch": ubatch, "kv_type": kv, "flash_attn": fa}
                prefill_rate(engine, tokens[:64])  # warm-up
                row["prefill_1500_tok_s"] = round(prefill_rate(engine, tokens), 1)
                for n in (1, 8, 16):
                    row[f"decode_{n}_tok_s"] = round(decode_rate(engine, tokens, n, args.steps), 1)
            finally:
                engine.close()
            print(row, flush=True)
            rows.append(row)
    finally:
        model.close()
    with (args.out / "engine_settings.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{'ubatch':>6} {'kv':>5} {'fa':>3} {'prefill':>8} {'dec1':>7} {'dec8':>7} {'dec16':>7}")
    for r in rows:
        print(
            f"{r['n_ubatch']:>6} {r['kv_type']:>5} {r['flash_attn']:>3} {r['prefill_1500_tok_s']:>8} "
            f"{r['decode_1_tok_s']:>7} {r['decode_8_tok_s']:>7} {r['decode_16_tok_s']:>7}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
