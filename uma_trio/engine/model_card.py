"""What a model file says about itself, read without its weights (a vocab-only load: its
shape for the KV cache and the offload, :func:`read_shape`, and its card): Ollama's ``/api/show``
answers from it for every model of the store, loaded or not (an app such as VS Code's
Ollama provider or Continue reads the capabilities and context length of every model it
lists, before it loads any).

A vocab-only load (``read_card``) reads the GGUF's metadata and vocabulary: ~0.1 s for
SmolLM2, well under a second for an 8B model's 128k-token vocabulary; no weights."""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .devices import init_backend
from .libllama import llama
from .llama_model import ModelLoadError, ModelShape, fim_tokens, shape_of

_INTEGER = re.compile(r"-?[0-9]+")
_REAL = re.compile(r"-?[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?")
NO_POOLING = {None, -1, 0}  # unspecified, or LLAMA_POOLING_TYPE_NONE: a generative model
# llama.h's file types by number ("Q4_K_M"), from the binding's own constants.
FILE_TYPES = {
    int(getattr(llama, name)): name.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_")
    for name in dir(llama)
    if name.startswith("LLAMA_FTYPE_") and name != "LLAMA_FTYPE_GUESSED"
}


@dataclass(frozen=True)
class ModelCard:
    """A GGUF's self-description."""

    metadata: Mapping[str, str]  # every scalar key/value, as llama.cpp renders it (arrays left out)
    chat_template: str  # the template the file carries ("" when none)
    fill_in_middle: bool  # its vocabulary has the FIM tokens /infill and Ollama's suffix need
    pooling: int | None  # ``<arch>.pooling_type``: an embedding model names one

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    @property
    def size_label(self) -> str:
        """``general.size_label`` ("135M", "8B"), "" when the file names none."""
        return self.metadata.get("general.size_label", "")

    @property
    def quantization(self) -> str:
        """The file type's name ("Q4_1"), "" when it names none."""
        value = self.metadata.get("general.file_type", "")
        return FILE_TYPES.get(int(value), "") if _INTEGER.fullmatch(value) else ""

    @property
    def embedding_length(self) -> int | None:
        """The size of its hidden states, which its embeddings have (None: the file says not)."""
        value = self.metadata.get(f"{self.architecture}.embedding_length", "")
        return int(value) if _INTEGER.fullmatch(value) else None

    @property
    def embedding_only(self) -> bool:
        """An encoder that pools its tokens (BERT, nomic-embed): it embeds, it does not chat."""
        return self.pooling not in NO_POOLING

    def model_info(self) -> dict[str, Any]:
        """The metadata with numbers as numbers and booleans as booleans, as Ollama shows it
        (the chat template is shown on its own)."""
        return {k: typed(v) for k, v in self.metadata.items() if not k.startswith("tokenizer.chat_template")}


def typed(value: str) -> int | float | bool | str:
    """A value as llama.cpp renders it (every GGUF scalar becomes text), typed back."""
    if _INTEGER.fullmatch(value):
        return int(value)
    if _REAL.fullmatch(value):
        return float(value)
    if value in ("true", "false"):
        return value == "true"
    return value


@contextmanager
def vocab_only(path: Path) -> Iterator[Any]:
    """``path`` loaded without its weights (its metadata and vocabulary): llama.cpp's model
    handle, freed on leaving; :class:`ModelLoadError` where llama.cpp cannot read it."""
    init_backend()
    params = llama.llama_model_default_params()
    params.vocab_only = True
    params.n_gpu_layers = 0
    handle = llama.llama_model_load_from_file(str(path).encode(), params)
    if not handle:
        raise ModelLoadError(f"llama.cpp could not load {path} (corrupt or unsupported GGUF)")
    try:
        yield handle
    finally:
        llama.llama_model_free(handle)


def read_shape(path: Path) -> ModelShape:
    """:class:`ModelShape` from the GGUF's metadata alone (a vocab-only load: no weights)."""
    with vocab_only(path) as handle:
        return shape_of(handle, path)


def read_card(path: Path) -> ModelCard:
    """``path``'s :class:`ModelCard` by a vocab-only load (blocking: run it off the event loop);
    :class:`ModelLoadError` where llama.cpp cannot read the file."""
    with vocab_only(path) as handle:
        metadata = _metadata(handle)
        template = llama.llama_model_chat_template(handle, None) or b""
        pooling = metadata.get(f"{metadata.get('general.architecture', '')}.pooling_type")
        return ModelCard(
            metadata=metadata,
            chat_template=template.decode("utf-8", errors="replace"),
            fill_in_middle=fim_tokens(llama.llama_model_get_vocab(handle)) is not None,
            pooling=int(pooling) if pooling is not None and _INTEGER.fullmatch(pooling) else None,
        )


def card_of(path: Path) -> ModelCard | None:
    """:func:`read_card`, read once per version of the file (its size and mtime); None for a
    file llama.cpp cannot read, remembered too (a broken file in --models-dir was read again,
    and its error logged, on every /api/tags).  OSError where the file is gone."""
    stat = path.stat()
    return _cached(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _cached(path: Path, size: int, mtime_ns: int) -> ModelCard | None:
    try:
        return read_card(path)
    except ModelLoadError:
        return None


def _metadata(handle: Any) -> dict[str, str]:
    """Every key/value llama.cpp kept of the GGUF's metadata (it keeps scalars only)."""
    found: dict[str, str] = {}
    for i in range(int(llama.llama_model_meta_count(handle))):
        found[_text(llama.llama_model_meta_key_by_index, handle, i)] = _text(
            llama.llama_model_meta_val_str_by_index, handle, i
        )
    return found


def _text(read: Any, handle: Any, index: int) -> str:
    """One string through llama.cpp's snprintf-style getters: asked again at the length it
    says when the first buffer was short (a name or chat template can be long)."""
    size = 256
    while True:
        buf = ctypes.create_string_buffer(size)
        n = int(read(handle, index, buf, size))
        if n < 0:
            return ""
        if n < size:
            return buf.value.decode("utf-8", errors="replace")
        size = n + 1
