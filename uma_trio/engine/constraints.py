"""Constrained decoding: structured output and grammars, through llguidance.

A request's constraint (a JSON schema, "any JSON object", or a GBNF / Lark grammar) is
compiled once, off the event loop, into an llguidance matcher over the model's own
vocabulary (:class:`ModelVocabulary`, built from llama.cpp's vocab the first time a request
needs it).  Its :class:`ConstrainedSampler` masks the logits row to the tokens the grammar
allows, lets the request's ordinary sampler choose among them, and tells the matcher what
was chosen.  Once the grammar is complete the mask allows only end-of-generation tokens, so
the request stops as any other does.  Computing a mask takes microseconds (llguidance's
token trie); it runs on the compute thread beside sampling.
"""

from __future__ import annotations

import inspect
import json
import math
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import llguidance
import numpy as np
import numpy.typing as npt
import outcome
from llguidance.gbnf_to_lark import is_lark_syntax

from .logprobs import LogprobSampler
from .sampling import Sampler, SamplingParams

T = TypeVar("T")

# The largest grammar or schema text a request may send (a protection, not a format limit).
MAX_GRAMMAR_BYTES = 256 * 1024
# GBNF is turned into Lark by llguidance's Python converter, whose time grows with the square
# of the rules (230 KB of them: 19 s of a core): a cap well above any hand-written grammar.
MAX_GBNF_RULES = 4096
# llguidance compiles a grammar recursively, a level per rule it goes through: a chain of
# 4,000 rules (62 KB) overflowed a worker thread's 8 MiB stack and killed the process.  A
# stack this size (reserved, touched only as deep as a grammar goes) holds any chain that
# fits MAX_GRAMMAR_BYTES (~21,000 rules).
COMPILE_STACK_BYTES = 512 << 20
# JSON as models write it ({"a": 1, "b": 2}), and no free whitespace: with it a small model
# can fill its whole budget with newlines between two keys.  ``oneOf`` is read as ``anyOf``,
# as llama.cpp's and Ollama's schema converters read it (llguidance refused it, and with it
# Qwen Code's whole tool set).  A schema's own "x-guidance" options override these.
JSON_STYLE = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
    "coerce_one_of": True,
}


class ConstraintError(ValueError):
    """The schema or grammar cannot be compiled; the message names the problem."""


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """What a request's output must match, as llguidance grammar text."""

    grammar: str
    kind: str  # "JSON schema", "JSON object" or "grammar": for messages and logs


def json_schema_constraint(schema: dict[str, Any] | None) -> OutputConstraint:
    """Output that is one JSON value matching ``schema``; ``None``: any JSON object."""
    try:
        text = json.dumps(schema if schema is not None else {"type": "object"})
    except RecursionError:  # not a ValueError: it dropped the connection with no answer
        raise ConstraintError("invalid JSON schema: nested too deeply") from None
    if len(text) > MAX_GRAMMAR_BYTES:
        raise ConstraintError(f"the JSON schema is over {MAX_GRAMMAR_BYTES} bytes")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_STYLE)  # type: ignore[arg-type]
        return OutputConstraint(grammar, "JSON schema" if schema is not None else "JSON object")
    except ValueError as exc:
        raise ConstraintError(f"invalid JSON schema: {exc}") from None


def check_grammar_size(text: str) -> None:
    """:class:`ConstraintError` for a grammar over the limits, before any work on it."""
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise ConstraintError(f"the grammar is over {MAX_GRAMMAR_BYTES} bytes")
    if (rules := text.count("::=")) > MAX_GBNF_RULES:
        raise ConstraintError(f"the grammar has {rules} rules; at most {MAX_GBNF_RULES}")


def needs_converting(text: str) -> bool:
    """Whether ``text`` is GBNF, which llguidance's Python converter turns into Lark first."""
    return not is_lark_syntax(text)


def grammar_constraint(text: str, lark: str | None = None) -> OutputConstraint:
    """Output matching a grammar in llama.cpp's GBNF or in Lark (llguidance's syntax);
    ``lark``: the GBNF ``text`` already converted (runtime/gbnf_convert.py)."""
    check_grammar_size(text)
    try:
        if lark is not None:
            return OutputConstraint(llguidance.LLMatcher.grammar_from_lark(lark), "grammar")
        return OutputConstraint(llguidance.grammar_from("gbnf", text), "grammar")
    except ValueError as exc:
        raise ConstraintError(f"invalid grammar: {exc}") from None


def lark_constraint(text: str, kind: str) -> OutputConstraint:
    """A grammar in llguidance's Lark dialect (which may embed JSON schemas with ``%json``)."""
    return OutputConstraint(llguidance.LLMatcher.grammar_from_lark(text), kind)


def on_big_stack(build: Callable[[], T]) -> T:
    """``build()`` in a thread of its own with a :data:`COMPILE_STACK_BYTES` stack (blocking:
    call it off the event loop)."""
    result: list[outcome.Outcome[T]] = []
    # A daemon thread: a shutdown that stopped waiting for a long compile need not wait at exit.
    thread = threading.Thread(
        target=lambda: result.append(outcome.capture(build)), name="uma-grammar", daemon=True
    )
    with _STACK_SIZE:  # set only while this one starts (another starting then gets it too: harmless)
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    return result[0].unwrap()


_STACK_SIZE = threading.Lock()


class ModelVocabulary:
    """The model's vocabulary as llguidance sees it.  Building it reads every token (a quarter
    of a second for 49k tokens, about a second for 128k), so it happens once, on first use,
    in whichever thread asks first; the others wait for it."""

    def __init__(
        self, vocab: Any, n_vocab: int, end_tokens: Sequence[int], piece: Callable[[int], bytes]
    ) -> None:
        self._vocab = vocab  # llama_vocab_p, owned by the model
        self.n_vocab = n_vocab
        # Its model's own method, held weakly: the model holds this vocabulary, and the cycle
        # freed an unloaded model (its tokenizer, templates, pieces: MBs) only at the garbage
        # collector's rare full passes, so each load and unload grew the daemon by 3-7 MB.
        self._piece: Callable[[], Callable[[int], bytes] | None] = (
            weakref.WeakMethod(piece) if inspect.ismethod(piece) else lambda: piece
        )
        self._end_tokens = list(end_tokens)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._special: dict[str, int | None] = {}  # special_token's answers

    @property
    def has_tokenizer(self) -> bool:
        """Whether :meth:`tokenizer` has been built (it reads llama.cpp's vocabulary once)."""
        return self._tokenizer is not None

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                from llguidance.llamacpp import lltokenizer_from_vocab  # imports llama_cpp

                with warnings.catch_warnings():  # it calls a deprecated llama_cpp alias per token
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._tokenizer = lltokenizer_from_vocab(self._vocab, eos_token=self._end_tokens)
            return self._tokenizer

    def special_token(self, text: str) -> int | None:
        """The id of the one token whose text is ``text`` where llguidance reads that token as
        special (a control token, or a user-defined one in angle brackets, as Qwen's
        ``<tool_call>``), which a grammar must name as a token, never spell as text: the text
        tokenizes to that token, which the text's bytes never match.  None otherwise.  Read
        once per text (a tool request asks for its family's markers every time)."""
        if text not in self._special:
            self._special[text] = self._read_special_token(text)
        return self._special[text]

    def _read_special_token(self, text: str) -> int | None:
        from llama_cpp import llama_cpp as llama  # as lltokenizer_from_vocab reads the vocab

        data = text.encode()
        buf = (llama.llama_token * (len(data) + 2))()
        if llama.llama_tokenize(self._vocab, data, len(data), buf, len(data) + 2, False, True) != 1:
            return None
        token = int(buf[0])
        attr = llama.llama_vocab_get_attr(self._vocab, token)
        angled = text.startswith("<") and text.endswith(">")
        if attr & llama.LLAMA_TOKEN_ATTR_CONTROL or (attr & llama.LLAMA_TOKEN_ATTR_USER_DEFINED and angled):
            return token
        return None

    def sampler(
        self,
        params: SamplingParams,
        constraint: OutputConstraint | None = None,
        top_logprobs: int | None = None,
        *,
        matcher: llguidance.LLMatcher | None = None,
    ) -> Sampler:
        """A request's sampler: numpy's, or llama.cpp's chain where the parameters need it
        (engine/sampler_chain.py), under ``constraint`` (or its ``matcher``, compiled
        already) if given.  Blocking: milliseconds, more for a huge schema, and the grammar
        vocabulary's build the first time."""
        from .sampler_chain import ChainSampler  # imports llama_cpp

        inner = ChainSampler(params, self._vocab, self.n_vocab) if params.needs_chain else Sampler(params)
        if constraint is not None and matcher is None:
            matcher = self.matcher(constraint)
        if matcher is not None:
            inner = ConstrainedSampler(inner, matcher, self.n_vocab)
        if top_logprobs is not None:  # outermost: the model's row before any mask or penalty
            piece = self._piece()
            assert piece is not None, "the model is gone"  # it owns this vocabulary
            inner = LogprobSampler(inner, top_logprobs, piece)
        return inner

    def matcher(self, constraint: OutputConstraint) -> llguidance.LLMatcher:
        """A fresh matcher for one request."""
        tokenizer = self.tokenizer()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(constraint.grammar, tokenizer)
        if failed:
            raise ConstraintError(f"invalid {constraint.kind}: {messages[0]}")
        matcher = llguidance.LLMatcher(tokenizer, constraint.grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"invalid {constraint.kind}: {first_line(matcher.get_error())}")
        # The first token's mask, once: a grammar that can never produce anything (`root ::=
        # root`, a schema `{"$ref": "#"}`) compiles, and failed only at the first sample, after
        # the request took a session, with llguidance's state dump as the message.
        mask = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if matcher.is_error():
            raise ConstraintError(
                f"invalid {constraint.kind}: it matches no text ({first_line(matcher.get_error())})"
            )
        return matcher


def check_alone(constraint: OutputConstraint) -> None:
    """Raises :class:`ConstraintError` if ``constraint`` does not compile by itself (with no
    vocabulary: quick); a part of a bigger grammar is so named in the error, whole (a JSON
    schema's has no grammar text of ours to leave out).  Recursive, as a compile: off the
    event loop, on a big stack (:func:`on_big_stack`)."""
    if error := llguidance.LLMatcher.validate_grammar(constraint.grammar):
        raise ConstraintError(f"invalid {constraint.kind}: {error.strip()}")


def first_line(error: str) -> str:
    """llguidance's error without the parser state it appends (hundreds of characters of
    internals, after the first line)."""
    return error.strip().splitlines()[0] if error.strip() else "unknown error"


class ConstrainedSampler(Sampler):
    """A request's sampler restricted to what its grammar allows next."""

    def __init__(self, inner: Sampler, matcher: llguidance.LLMatcher, n_vocab: int) -> None:
        super().__init__(inner.params)
        self.inner = inner
        self.matcher = matcher
        self._n_vocab = n_vocab
        self._bitmask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        allowed = self.allowed()
        np.putmask(logits, allowed == 0, np.float32(-np.inf))  # the row is this step's own
        token = self.inner.sample(logits)
        if not self.matcher.consume_token(token):
            why = first_line(self.matcher.get_error())
            if self._all_banned(allowed):  # llguidance's words ("forced bytes") say nothing of it
                why = "the request's logit_bias bans every token the grammar allows next"
            raise ConstraintError(f"the grammar refused token {token}: {why}")
        return token

    def _all_banned(self, allowed: npt.NDArray[np.uint8]) -> bool:
        bans = {token for token, bias in self.params.logit_bias if bias == -math.inf}
        return bool(bans) and set(np.flatnonzero(allowed).tolist()) <= bans

    def allowed(self) -> npt.NDArray[np.uint8]:
        """1 for each token the grammar allows next, else 0."""
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if self.matcher.is_error():
            raise ConstraintError(f"the grammar failed: {first_line(self.matcher.get_error())}")
        return np.unpackbits(self._bitmask.view(np.uint8), bitorder="little", count=self._n_vocab)
