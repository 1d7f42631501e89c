"""uma-trio's engine (``LlamaEngine.step_sync``, what the compute thread runs each tick) in a
plain loop, no daemon: B sequences with a 128-token prompt each, then DECODE greedy steps of
one token per sequence.  Each step splits into ``llama_decode`` plus the wait for the device
and the rest (batch fill, logits or device-picked tokens, argmax, pieces).  Configurations:
``host`` argmaxes greedy rows on the host (the default), ``device`` with llama.cpp's backend
sampler (``--gpu-sampling``).  Prints one line per run and appends JSON lines to OUT.

Usage: python benches/gpu/step_probe.py MODEL.gguf OUT.jsonl [--streams 1,16] [--decode 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

import uma_trio.engine.llama as engine_module
from uma_trio.engine.base import BatchEntry
from uma_trio.engine.libllama import llama
from uma_trio.engine.llama import ContextConfig, LlamaEngine
from uma_trio.engine.llama_model import LlamaModel, Placement

DECODE_TIMES: list[float] = []
_decode = llama.llama_decode


def timed_decode(ctx: Any, batch: Any) -> int:
    """llama_decode and the wait for the device (it returns before a GPU is done)."""
    began = time.perf_counter()
    status = int(_decode(ctx, batch))
    llama.llama_synchronize(ctx)
    DECODE_TIMES.append(time.perf_counter() - began)
    return status


CONFIGS: dict[str, dict[str, Any]] = {
    "host": {},
    "device": {"device_greedy": True},
}


def probe(engine: LlamaEngine, streams: int, decode: int, rng: np.random.Generator) -> dict[str, float]:
    from uma_trio.engine.sampling import Sampler, SamplingParams

    samplers = [Sampler(SamplingParams(temperature=0.0)) for _ in range(streams)]
    vocab = engine.model.n_vocab
    prompts = [rng.integers(1000, min(vocab, 30000), 128).astype(np.int32) for _ in range(streams)]
    first = engine.step_sync([BatchEntry(s, prompts[s], 0, samplers[s]) for s in range(streams)])
    last = {x.seq_id: x.token_id for x in first.sampled}
    pos = [128] * streams
    steps, decodes = [], []
    for _ in range(decode):
        entries = [BatchEntry(s, np.array([last[s]], np.int32), pos[s], samplers[s]) for s in range(streams)]
        DECODE_TIMES.clear()
        began = time.perf_counter()
        result = engine.step_sync(entries)
        steps.append(time.perf_counter() - began)
        decodes.append(sum(DECODE_TIMES))
        last.update({x.seq_id: x.token_id for x in result.sampled})
        pos = [p + 1 for p in pos]
    for s in range(streams):
        engine.free_seq(s)
    step, dec = statistics.median(steps[8:]), statistics.median(decodes[8:])
    return {
        "step_ms_p50": round(1000 * step, 3), "decode_ms_p50": round(1000 * dec, 3),
        "rest_ms_p50": round(1000 * (step - dec), 3),
        "tok_s": round(streams * (len(steps) - 8) / sum(steps[8:]), 1),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--streams", default="1,4,8,16")
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--configs", default="host,device")
    args = ap.parse_args()
    engine_module.llama.llama_decode = timed_decode  # the engine looks it up on the module per call
    model = LlamaModel(args.model, Placement(n_gpu_layers=999))
    with args.out.open("a") as out:
        for name in args.configs.split(","):
            config = ContextConfig(
                n_ctx_seq=512, n_seq_max=16, n_batch=2048, kv_unified=True, **CONFIGS[name]
            )
            engine = LlamaEngine(model, config)
            for streams in (int(x) for x in args.streams.split(",")):
                row = {
                    "config": name,
                    "streams": streams,
                    **probe(engine, streams, args.decode, np.random.default_rng(3)),
                }
                out.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
            engine.close()
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
