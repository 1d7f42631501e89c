"""Embedding requests in OpenAI's shape (``POST /v1/embeddings``) and Ollama's (``POST
/api/embed``, the older ``POST /api/embeddings``), as the daemon's own ``embed`` requests
(one per input), and their answers.  Pure: no I/O.

Every input is a :class:`~.messages.GenerateRequest` with ``embed``: it runs on the one
request path (lanes, the latency guard, cancel on disconnect), in the background lane unless
the ``X-Uma-Priority`` header says otherwise (docs/HTTP.md "Embeddings").
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from msgspec import Struct

from .messages import EosEvent, GenerateRequest, Lane
from .openai_errors import bad_request

MAX_INPUTS = 2048  # inputs in one request: OpenAI's limit


class OpenAIBody(Struct, kw_only=True):
    """``POST /v1/embeddings``; unknown fields are ignored."""

    model: str
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] | None = "float"  # null: float (OpenAI's default)
    dimensions: int | None = None
    user: str | None = None


class OllamaEmbedBody(Struct, kw_only=True):
    """``POST /api/embed``; ``keep_alive`` as on /api/chat (how long the model stays loaded
    once idle); ``options`` is accepted and has nothing to change (no sampling).  ``dimensions``
    0 is unset, as in Ollama."""

    model: str = ""  # required: ollama.required_model says so as Ollama does
    input: str | list[str] | None = None
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None  # an object, as Ollama decodes it (else a 400)
    keep_alive: Any = None


class OllamaEmbeddingsBody(Struct, kw_only=True):
    """``POST /api/embeddings``, the older endpoint: one prompt, an unnormalized vector;
    ``keep_alive`` as on /api/embed."""

    model: str = ""  # required: ollama.required_model says so as Ollama does
    prompt: str = ""
    options: dict[str, Any] | None = None  # an object, as Ollama decodes it (else a 400)
    keep_alive: Any = None


_JSON_KIND = {dict: "an object", float: "a number", bool: "a boolean", type(None): "null"}


def texts_of(value: str | list[Any] | None) -> list[str]:
    """The inputs as texts: a string is one; token ids (OpenAI allows them, in another
    model's vocabulary) are refused by name."""
    items = [value] if isinstance(value, str) else list(value or [])
    if len(items) > MAX_INPUTS:
        raise bad_request(f"`input` has {len(items)} items; at most {MAX_INPUTS} fit in one request", "input")
    for i, item in enumerate(items):
        if isinstance(item, int | list) and not isinstance(item, bool):
            raise bad_request(
                f"`input[{i}]` is not a text: token ids are not accepted (they would be another "
                "model's); send the text itself (LangChain's OpenAIEmbeddings sends tiktoken's "
                "ids unless given check_embedding_ctx_length=False)",
                "input",
            )
        if not isinstance(item, str):  # an object, a number: said as such, not as token ids
            kind = _JSON_KIND.get(type(item), "that")
            raise bad_request(f"`input[{i}]` must be a string, not {kind}", "input")
        if not item:
            raise bad_request(f"`input[{i}]` is empty: an empty text has no embedding", "input")
    return items


def ollama_texts(value: str | list[str] | None) -> list[str]:
    """/api/embed's inputs: a bare empty string is no input, as in Ollama (its client sends
    ``""`` to load a model); an empty text in a list is still refused."""
    return texts_of(value if value != "" else None)


def check_dimensions(dimensions: int | None, n_embd: int) -> None:
    """``dimensions`` is honoured only where it asks for what the model gives."""
    if dimensions is not None and dimensions != n_embd:
        raise bad_request(
            f"this model's embeddings have {n_embd} dimensions; `dimensions` {dimensions} cannot be "
            "served (it does not support shortened embeddings)",
            "dimensions",
        )


def check_ollama_dimensions(dimensions: int | None, n_embd: int) -> None:
    """Ollama's ``dimensions``: 0 (or none) is the model's own size, up to it the vector is
    shortened (:func:`shortened`); more is refused."""
    if dimensions is None or dimensions == 0:
        return
    if not 0 < dimensions <= n_embd:
        raise bad_request(
            f"`dimensions` {dimensions} is not from 1 to {n_embd}, this model's embedding size", "dimensions"
        )


def shortened(vector: list[float], dimensions: int | None) -> list[float]:
    """The first ``dimensions`` values scaled back to unit length (Ollama's truncation of a
    normalized embedding); the vector as it is for none or 0."""
    if not dimensions or dimensions >= len(vector):
        return vector
    head = vector[:dimensions]
    norm = float(np.linalg.norm(head))
    return [x / norm for x in head] if norm > 0 else head


def as_base64(embedding: list[float]) -> str:
    """OpenAI's ``encoding_format: base64``: the float32 values, little-endian, in base64."""
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode()


def embed_requests(
    texts: list[str],
    request_id: str,
    lane: Lane,
    model: str,
    *,
    normalize: bool = True,
    truncate: bool = False,
    keep_alive: float | None = None,
) -> list[GenerateRequest]:
    """One daemon request per input, ids ``<request_id>-<i>``; ``keep_alive`` (seconds) how
    long ``model`` stays loaded once idle."""
    return [
        GenerateRequest(
            id=f"{request_id}-{i}",
            prompt=text,
            embed=True,
            max_tokens=1,  # it generates nothing: the default 256 was refused under --max-tokens 255
            stream=False,
            normalize=normalize,
            truncate=truncate,
            priority=lane,
            model=model,
            keep_alive=keep_alive,
        )
        for i, text in enumerate(texts)
    ]


def openai_answer(model: str, ends: list[EosEvent], encoding: Literal["float", "base64"]) -> dict[str, Any]:
    """``/v1/embeddings``'s body, the inputs' order kept."""
    tokens = sum(e.usage.prompt_tokens for e in ends)
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": as_base64(vector) if encoding == "base64" else vector,
        }
        for i, e in enumerate(ends)
        if (vector := e.embedding) is not None
    ]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def ollama_embed_answer(
    model: str, ends: list[EosEvent], total_s: float, dimensions: int | None = None, load_s: float = 0.0
) -> dict[str, Any]:
    """``/api/embed``'s body (durations in nanoseconds, as Ollama's), each vector shortened
    to ``dimensions``; ``load_s``: the load call's wait for its model (no inputs)."""
    return {
        "model": model,
        "embeddings": [shortened(e.embedding or [], dimensions) for e in ends],
        "total_duration": int(total_s * 1e9),
        # Its inputs were asked at once: the longest wait for the model to load is the load's.
        "load_duration": int(max(((e.timings.load_ms or 0.0) for e in ends), default=load_s * 1e3) * 1e6),
        "prompt_eval_count": sum(e.usage.prompt_tokens for e in ends),
    }
