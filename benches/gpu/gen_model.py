#!/usr/bin/env python3
"""Write a random-weight Llama GGUF (F16) of a given shape, with a real tokenizer.

The tokenizer (Llama-3 BPE: tokens, types, merges, bos/eos) is copied from a vocab-only GGUF
such as llama.cpp's models/ggml-vocab-llama-bpe.gguf.  Weights are N(0, 0.02) values drawn
once into a 64M-value pool; each tensor is a window of that pool (the speed of a forward pass
does not depend on the values, and this writes an 8B model at disk speed).  Norm weights are 1.

Rows of output.weight are zero for every token that is not a NORMAL token made only of
printable ASCII (byte-level BPE: '!'..'~' and 'Ġ' for space).  Their logit is then exactly 0,
which never wins against the tens of thousands of random positive ones, so greedy generation
never emits an end-of-generation token (no `ignore_eos` needed) and every generated token
renders to visible text (one SSE chunk per token on both servers).

Usage (Llama-3-8B shape, the default):
  PYTHONPATH=<llama.cpp>/gguf-py python3 gen_model.py --vocab ggml-vocab-llama-bpe.gguf --out m-f16.gguf
Tiny test shape:
  ... --layers 2 --embd 256 --heads 4 --kv-heads 2 --ffn 512
"""

from __future__ import annotations

import argparse
import sys
import time

import gguf
import numpy as np


def tokenizer_fields(path: str) -> dict:
    r = gguf.GGUFReader(path)
    out = {}
    for key, field in r.fields.items():
        if key.startswith("tokenizer."):
            out[key] = field.contents()
    return out


def nice_mask(tokens: list[str], types: np.ndarray) -> np.ndarray:
    ok = np.zeros(len(tokens), dtype=bool)
    for i, t in enumerate(tokens):
        if types[i] != 1 or not t:
            continue
        ok[i] = all(("!" <= c <= "~") or c == "\u0120" for c in t)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--embd", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--name", default="random-llama3-8b-shape")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()

    t0 = time.time()
    tok = tokenizer_fields(a.vocab)
    tokens = list(tok["tokenizer.ggml.tokens"])
    types = np.asarray(tok["tokenizer.ggml.token_type"], dtype=np.int32)
    n_vocab = len(tokens)
    allowed = nice_mask(tokens, types)
    print(
        f"vocab {n_vocab} tokens, {int(allowed.sum())} printable-ASCII NORMAL tokens may be generated",
        flush=True,
    )

    head_dim = a.embd // a.heads
    n_embd_kv = head_dim * a.kv_heads
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name(a.name)
    w.add_context_length(a.ctx)
    w.add_embedding_length(a.embd)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ffn)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model(str(tok["tokenizer.ggml.model"]))
    w.add_tokenizer_pre(str(tok.get("tokenizer.ggml.pre", "llama-bpe")))
    w.add_token_list(tokens)
    w.add_token_types([int(x) for x in types])
    w.add_token_merges(list(tok["tokenizer.ggml.merges"]))
    w.add_bos_token_id(int(tok["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(tok["tokenizer.ggml.eos_token_id"]))
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    # tensor list, in llama.cpp's usual order; numpy shapes are (rows=out, cols=in)
    f16, f32 = np.float16, np.float32
    specs: list[tuple[str, tuple[int, ...], type]] = [("token_embd.weight", (n_vocab, a.embd), f16)]
    for i in range(a.layers):
        p = f"blk.{i}."
        specs += [
            (p + "attn_norm.weight", (a.embd,), f32),
            (p + "attn_q.weight", (a.embd, a.embd), f16),
            (p + "attn_k.weight", (n_embd_kv, a.embd), f16),
            (p + "attn_v.weight", (n_embd_kv, a.embd), f16),
            (p + "attn_output.weight", (a.embd, a.embd), f16),
            (p + "ffn_norm.weight", (a.embd,), f32),
            (p + "ffn_gate.weight", (a.ffn, a.embd), f16),
            (p + "ffn_up.weight", (a.ffn, a.embd), f16),
            (p + "ffn_down.weight", (a.embd, a.ffn), f16),
        ]
    specs += [("output_norm.weight", (a.embd,), f32), ("output.weight", (n_vocab, a.embd), f16)]
    for name, shape, dt in specs:
        w.add_tensor_info(name, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize)
    n_params = sum(int(np.prod(s)) for _, s, _ in specs)
    print(f"{len(specs)} tensors, {n_params / 1e9:.3f} B parameters", flush=True)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    rng = np.random.default_rng(a.seed)
    P = 1 << 26
    pool = (rng.standard_normal(P, dtype=np.float32) * 0.02).astype(f16)
    pool2 = np.concatenate([pool, pool])

    def window(n: int) -> np.ndarray:
        off = int(rng.integers(0, P))
        if n <= P:
            return pool2[off : off + n]
        return np.resize(pool2[off:], n)

    written = 0
    for name, shape, dt in specs:
        n = int(np.prod(shape))
        if dt is f32:
            data = np.ones(shape, dtype=f32)
        else:
            data = window(n).reshape(shape)
            if name == "output.weight":
                data = data.copy()
                data[~allowed] = 0
        w.write_tensor_data(data)
        written += data.nbytes
    w.close()
    print(f"wrote {a.out}: {written / 1e9:.2f} GB of tensor data in {time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
