"""The model file as llama.cpp loads it: weights and vocabulary (:class:`LlamaModel`),
where its layers go (:class:`Placement`), and the shape that sizes its KV cache, read
from the GGUF's metadata (:func:`shape_of`; without the weights: model_card.read_shape)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ..config import SplitMode
from .base import ChatTurn, TemplateArgs, TokenArray, Tools, split_prefill, turn_fields
from .builtin_chat import builtin_chat_text
from .chat_escape import ControlTextEscaper
from .chat_template import ChatTemplateError, JinjaChatTemplate
from .constraints import ModelVocabulary
from .devices import LlamaLog, init_backend, offloaded_layers
from .infill import FimTokens, infill_tokens
from .libllama import llama
from .pooling import pooling_mode

log = logging.getLogger(__name__)

_SPLIT_MODE = {
    "none": llama.LLAMA_SPLIT_MODE_NONE,
    "layer": llama.LLAMA_SPLIT_MODE_LAYER,
    "row": llama.LLAMA_SPLIT_MODE_ROW,
    "tensor": llama.LLAMA_SPLIT_MODE_TENSOR,
}


@dataclass(frozen=True)
class Placement:
    """Where the weights go: llama_model_params' device fields, passed through."""

    n_gpu_layers: int = 0
    main_gpu: int = 0  # the GPU that holds everything with split_mode none (and the scratch)
    split_mode: SplitMode = "layer"  # across several GPUs: whole layers, each layer split (tensor), rows
    tensor_split: tuple[float, ...] | None = None  # share of the model per GPU; None: by free memory
    reason: str = "CPU only"  # why this many layers (the offload decision, for the log and info)
    mmap: bool = True  # False: llama_model_params.load_mode NONE (--no-mmap: see ServerConfig.mmap)


@dataclass(frozen=True)
class ModelShape:
    """What sizing the KV cache and the offload needs, read without loading weights."""

    n_layer: int
    n_head_kv: int
    key_length: int
    value_length: int
    n_ctx_train: int
    file_bytes: int

    def kv_bytes_per_cell(self, kv_type_bytes: float) -> int:
        """K and V of one token over every layer (layer 0's head counts stand for all)."""
        return round(self.n_layer * self.n_head_kv * (self.key_length + self.value_length) * kv_type_bytes)


def _meta_int(model: Any, key: str) -> int | None:
    buf = ctypes.create_string_buffer(64)
    if llama.llama_model_meta_val_str(model, key.encode(), buf, len(buf)) < 0:
        return None
    try:
        return int(buf.value.decode())
    except ValueError:
        return None


def _meta_str(model: Any, key: str) -> str | None:
    buf = ctypes.create_string_buffer(128)
    n = llama.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return None if n < 0 else buf.value.decode(errors="replace")


def shape_of(model: Any, path: Path) -> ModelShape:
    """A model's layer and head sizes from its GGUF metadata (which a vocab-only load
    reads too; llama.cpp's hparams getters need the weights).  The head sizes come from
    ``<arch>.attention.key_length`` / ``value_length`` when the GGUF has them (models
    whose K and V heads differ set them), else ``n_embd / n_head``; a per-layer KV head
    array falls back to the head count (an upper bound)."""
    arch = _meta_str(model, "general.architecture") or ""

    def key(name: str) -> int | None:
        return _meta_int(model, f"{arch}.{name}")

    n_head = key("attention.head_count") or 0
    n_embd = key("embedding_length") or 0
    head = n_embd // n_head if n_head > 0 else 0
    return ModelShape(
        n_layer=key("block_count") or 0,
        n_head_kv=key("attention.head_count_kv") or n_head,
        key_length=key("attention.key_length") or head,
        value_length=key("attention.value_length") or head,
        n_ctx_train=key("context_length") or 0,
        file_bytes=path.stat().st_size,
    )


class ModelLoadError(Exception):
    """llama.cpp refused the model file."""


class ModelFileChanged(OSError):
    """The file at the model's path is no longer the one loaded: its sha256 names other weights."""


class FileFingerprint:
    """The sha256 of a file as it was when loaded, hashed on first use (about a third of a
    second per 100 MB), once however many threads ask.  The file's identity (size, mtime,
    inode) is taken at load: a file replaced since (``uma-trio pull`` of the same name) is
    refused, as its sha256 would name weights the daemon does not run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.loaded = _identity(path.stat())
        self._lock = threading.Lock()
        self._sha256: str | None = None

    def sha256(self) -> str:
        with self._lock:
            if self._sha256 is None:
                with self.path.open("rb") as file:
                    self._check(os.fstat(file.fileno()))
                    digest = hashlib.file_digest(file, "sha256").hexdigest()
                    self._check(os.fstat(file.fileno()))  # not written to while hashed
                self._sha256 = digest
            return self._sha256

    def _check(self, info: os.stat_result) -> None:
        if _identity(info) != self.loaded:
            raise ModelFileChanged(
                f"{self.path} was replaced or changed since the daemon loaded it; "
                "restart the daemon to save or restore snapshots"
            )


def _identity(info: os.stat_result) -> tuple[int, int, int]:
    return info.st_size, info.st_mtime_ns, info.st_ino


_FAILURE_WORDS = (
    "error", "invalid", "failed", "not enough", "out of memory", "unable", "cannot", "not implemented",
    "does not support", "needs >=",
)  # fmt: skip


def load_failure(lines: list[str]) -> str:
    """What llama.cpp said when a load failed: its last line that names a failure, other
    than the closing "failed to load model", without the function's name (a placement it
    cannot make says so there, e.g. ``invalid value for main_gpu``), else a guess."""
    said = [
        line.strip()
        for line in lines
        if any(word in line.lower() for word in _FAILURE_WORDS)
        and not line.rstrip().endswith("failed to load model")
    ]
    if not said:
        return "corrupt or unsupported GGUF"
    return said[-1].split(": ", 1)[1] if ": " in said[-1] else said[-1]


class LlamaModel:
    """Weights and vocabulary, loaded once; read-only, so safe from any thread."""

    def __init__(self, path: Path, placement: Placement = Placement()) -> None:
        init_backend()
        self.path = path
        self.placement = placement
        self._file = FileFingerprint(path)  # before the load: the weights are this file's
        params = llama.llama_model_default_params()
        params.n_gpu_layers = placement.n_gpu_layers
        params.main_gpu = placement.main_gpu
        params.split_mode = _SPLIT_MODE[placement.split_mode]
        if not placement.mmap:  # read into the daemon's memory (the default, AUTO, maps the file)
            params.load_mode = llama.LLAMA_LOAD_MODE_NONE
        if placement.tensor_split is not None:
            # llama.cpp reads llama_max_devices() floats; keep the array alive with the params.
            shares = (ctypes.c_float * max(int(llama.llama_max_devices()), len(placement.tensor_split)))()
            for i, share in enumerate(placement.tensor_split):
                shares[i] = share
            self._tensor_split = shares
            params.tensor_split = ctypes.cast(shares, ctypes.POINTER(ctypes.c_float))
        with LlamaLog.capture() as lines:
            self._model = llama.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {path}: {load_failure(lines)}")
        self.shape = shape_of(self._model, path)
        # llama.cpp says how many layers it placed on a GPU; without a GPU backend, none.
        said = offloaded_layers(lines)
        self.layers_offloaded, self.layers_total = said or (0, self.shape.n_layer + 1)
        self.weight_bytes = int(llama.llama_model_size(self._model))
        self.description = model_description(self._model)
        self._vocab = llama.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(llama.llama_model_n_ctx_train(self._model))
        # An embedding's size and how its tokens pool (engine/pooling.py).
        self.n_embd = int(llama.llama_model_n_embd_out(self._model))
        arch = _meta_str(self._model, "general.architecture") or ""
        self.gguf_pooling = _meta_int(self._model, f"{arch}.pooling_type")  # None: it names none
        self.pooling = pooling_mode(self.gguf_pooling)
        self._add_bos = bool(llama.llama_vocab_get_add_bos(self._vocab))
        self._pieces: dict[int, bytes] = {}
        ends = {int(llama.llama_vocab_eos(self._vocab)), int(llama.llama_vocab_eot(self._vocab))} - {-1}
        self.vocabulary = ModelVocabulary(
            self._vocab, self.n_vocab, sorted(ends), self.piece
        )  # built on first use
        self.fim = fim_tokens(self._vocab)
        template = llama.llama_model_chat_template(self._model, None)
        self.chat_template: bytes | None = template or None
        # The model's template rendered with Jinja (engine/chat_template.py); llama.cpp's
        # built-in formatter where Jinja cannot compile it.
        self.jinja: JinjaChatTemplate | None = None
        self.template_source: str | None = None
        self.tool_jinja: JinjaChatTemplate | None = None  # the GGUF's tool_use template
        self.tool_template_source: str | None = None
        if self.chat_template is not None:
            try:
                self.use_chat_template(self.chat_template.decode("utf-8", errors="replace"))
            except ChatTemplateError as exc:
                log.warning("%s; llama.cpp's built-in chat formatting is used instead", exc)
        self._use_tool_template(llama.llama_model_chat_template(self._model, b"tool_use"))
        self._max_token_bytes: int | None = None
        self._escaper: ControlTextEscaper | None = None
        self._control_escaper()  # read here, off the event loop (a large vocabulary: ~40 ms)

    @property
    def handle(self) -> Any:  # llama_model_p (an opaque ctypes pointer)
        return self._model

    def tokenize(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> TokenArray:
        """``text`` as tokens; ``special`` parses control-token text (``<|im_end|>``) into
        control tokens, which only text we wrote ourselves may do."""
        data = text.encode("utf-8")
        bos = self._add_bos if add_bos is None else add_bos and self._add_bos
        capacity = len(data) + 2  # a BPE token covers at least one byte, plus BOS/EOS
        buf = (llama.llama_token * capacity)()
        n = llama.llama_tokenize(self._vocab, data, len(data), buf, capacity, bos, special)
        if n < 0:  # cannot happen with this capacity, but llama.cpp says how much it needs
            buf = (llama.llama_token * -n)()
            n = llama.llama_tokenize(self._vocab, data, len(data), buf, -n, bos, special)
        return np.array(buf[:n], dtype=np.int32)

    @property
    def max_token_bytes(self) -> int:
        """The longest token's text in bytes (read from the vocabulary once, ~50 ms)."""
        if self._max_token_bytes is None:
            n_vocab = llama.llama_vocab_n_tokens(self._vocab)
            self._max_token_bytes = max(1, max(len(self.piece(t)) for t in range(n_vocab)))
        return self._max_token_bytes

    def tokenize_chat(
        self, messages: Sequence[ChatTurn], tools: Tools = None, args: TemplateArgs = None
    ) -> TokenArray:
        """A chat as tokens: the template rendered with the clients' text and tokenized whole,
        as llama-server does, except that client text spelling a control token
        (``<|im_end|>``) stays plain text, so it cannot close its turn or open another
        (engine/chat_escape.py).  A last assistant message is continued
        (:func:`~.base.split_prefill`): the chat before it is rendered up to the assistant's
        turn, and its text follows with no end of turn."""
        escaper = self._control_escaper()
        head, prefill = split_prefill([turn_fields(m) for m in messages])
        turns = [escaper.escape(t) for t in head]
        escaped_args = escaper.escape(dict(args)) if args else None  # client text, as the turns
        text = self.apply_chat_template(turns, escaper.escape(list(tools)) if tools else None, escaped_args)
        text += escaper.escape(prefill)
        pieces, first = [], True
        for piece, template in escaper.pieces(text):
            if piece:
                pieces.append(self.tokenize(piece, add_bos=first, special=template))
                first = False
        return np.concatenate(pieces) if pieces else self.tokenize("", add_bos=True)

    def _control_escaper(self) -> ControlTextEscaper:
        """The vocabulary's control-token spellings, read once (12 ms for 49,152 tokens)."""
        if self._escaper is None:
            flags = llama.LLAMA_TOKEN_ATTR_CONTROL | llama.LLAMA_TOKEN_ATTR_UNKNOWN
            controls = [
                (llama.llama_vocab_get_text(self._vocab, t) or b"").decode("utf-8", errors="replace")
                for t in range(self.n_vocab)
                if llama.llama_vocab_get_attr(self._vocab, t) & flags
            ]
            self._escaper = ControlTextEscaper(controls)
        return self._escaper

    def piece(self, token: int) -> bytes:
        """The bytes a token renders to (empty for control tokens); cached."""
        cached = self._pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = llama.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
            cached = self._pieces[token] = buf.raw[:n]
        return cached

    def tokenize_infill(
        self, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (), middle: str = "",
        budget: int | None = None,
    ) -> TokenArray:  # fmt: skip
        """The fill-in-the-middle prompt (engine/infill.py); :class:`NoFimTokens` without FIM."""
        bos = int(llama.llama_vocab_bos(self._vocab)) if self._add_bos else None
        plain = partial(self.tokenize, add_bos=False, special=False)
        return infill_tokens(
            self.fim, lambda text: plain(text).tolist(), prefix, suffix, extra, bos, middle, budget
        )

    def fingerprint(self) -> str:
        """The sha256 of the model file as loaded: what a KV snapshot must match
        (:class:`FileFingerprint`; :class:`ModelFileChanged` once the file is another)."""
        return self._file.sha256()

    def is_eog(self, token: int) -> bool:
        return bool(llama.llama_vocab_is_eog(self._vocab, token))

    def use_chat_template(self, source: str) -> None:
        """Render chats with the Jinja template ``source`` (the model's own, or
        ``--chat-template``); :class:`ChatTemplateError` if it does not compile."""
        self.jinja, self.template_source = self._compiled(source), source
        self.tool_jinja, self.tool_template_source = None, None  # --chat-template serves every request

    def _use_tool_template(self, named: bytes | None) -> None:
        """The GGUF's template named ``tool_use``, for requests that offer tools; left out
        (with a warning) where it does not compile."""
        try:
            if named:
                source = named.decode("utf-8", errors="replace")
                self.tool_jinja, self.tool_template_source = self._compiled(source), source
        except ChatTemplateError as exc:
            log.warning("%s (the GGUF's tool_use template); requests with tools get the default one", exc)

    def _compiled(self, source: str) -> JinjaChatTemplate:
        bos = self._token_text(llama.llama_vocab_bos(self._vocab))
        eos = self._token_text(llama.llama_vocab_eos(self._vocab))
        return JinjaChatTemplate(source, bos_token=bos, eos_token=eos)

    def chat_template_in_use(self, file: Path | None = None) -> str:
        """Which chat formatting requests get, in words (the start-up log)."""
        if self.jinja is not None:
            return f"Jinja, from {file}" if file is not None else "Jinja, the model's own"
        if self.chat_template is not None:
            return "llama.cpp's built-in formatter (the model's template does not compile in Jinja)"
        return "none (the model has no chat template: send `prompt`)"

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return bytes(llama.llama_vocab_get_text(self._vocab, token) or b"").decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[ChatTurn], tools: Tools = None, args: TemplateArgs = None
    ) -> str:
        turns = [turn_fields(m) for m in messages]
        # A request offering tools gets the GGUF's tool_use template where it has one, as
        # llama.cpp gives it (Hermes 2 Pro / 3, Command-R: their default one has no tools).
        jinja = self.tool_jinja if tools and self.tool_jinja is not None else self.jinja
        if jinja is not None:
            text = jinja.render(turns, tools=tools, extra=args)
            bos = jinja.bos_token
            # A template that writes the BOS text itself (Llama 3) would get a second one from
            # the tokenizer, which adds it already.
            return text[len(bos) :] if self._add_bos and bos and text.startswith(bos) else text
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send `prompt` instead")
        return builtin_chat_text(self.chat_template, turns, tools)

    def close(self) -> None:
        if self._model:
            llama.llama_model_free(self._model)
            self._model = None


def model_description(model: Any) -> str:
    buf = ctypes.create_string_buffer(256)
    n = llama.llama_model_desc(model, buf, len(buf))
    return buf.value.decode(errors="replace") if n > 0 else ""


def fim_tokens(vocab: Any) -> FimTokens | None:
    """The vocabulary's fill-in-the-middle tokens, if it has the three a prompt needs."""

    def token(name: str) -> int | None:
        value = int(getattr(llama, f"llama_vocab_fim_{name}")(vocab))
        return value if value >= 0 else None

    pre, suf, mid = token("pre"), token("suf"), token("mid")
    if pre is None or suf is None or mid is None:
        return None
    return FimTokens(pre, suf, mid, token("rep"), token("sep"))
