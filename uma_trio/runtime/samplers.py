"""A request's sampler: its sampling parameters, constrained by its grammar if it has one."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from ..engine.base import Engine
from ..engine.constraints import (
    ConstraintError,
    OutputConstraint,
    check_alone,
    check_grammar_size,
    grammar_constraint,
    json_schema_constraint,
    needs_converting,
    on_big_stack,
)
from ..engine.sampling import Sampler, SamplingParams, banned
from ..protocol.errors import ErrorCode, UmaError
from ..protocol.messages import GenerateRequest
from ..protocol.response_format import JsonObjectFormat, JsonSchemaFormat
from ..protocol.strict_schema import closed
from ..protocol.tools import TOOL_GRAMMAR_ERROR, tool_error_words, tool_fault, tool_schema
from .gbnf_convert import gbnf_as_lark
from .off_loop import compile_limiter, off_loop

if TYPE_CHECKING:
    import llguidance


def sampling_params(request: GenerateRequest) -> SamplingParams:
    """The request's sampling settings.  A bias of 0 changes nothing, so it is dropped: kept, it
    would move the request onto llama.cpp's sampler chain, whose random draws differ from
    numpy's, and a seeded answer would change."""
    r = request
    return SamplingParams(
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p, seed=r.seed,
        repeat_penalty=r.repeat_penalty, repeat_last_n=r.repeat_last_n,
        frequency_penalty=r.frequency_penalty, presence_penalty=r.presence_penalty,
        typical_p=r.typical_p, dry_multiplier=r.dry_multiplier, dry_base=r.dry_base,
        dry_allowed_length=r.dry_allowed_length, dry_penalty_last_n=r.dry_penalty_last_n,
        xtc_probability=r.xtc_probability, xtc_threshold=r.xtc_threshold, mirostat=r.mirostat,
        mirostat_tau=r.mirostat_tau, mirostat_eta=r.mirostat_eta,
        logit_bias=tuple(sorted((int(t), banned(bias)) for t, bias in r.logit_bias.items() if bias != 0)),
    )  # fmt: skip


def output_constraint(request: GenerateRequest, lark: str | None = None) -> OutputConstraint | None:
    """What the request's output must match (pure; ``lark``: its GBNF grammar converted);
    raises :class:`ConstraintError`."""
    if request.grammar is not None:
        return grammar_constraint(request.grammar, lark)
    if formatted(request):
        return json_schema_constraint(format_schema(request))
    return None


def formatted(request: GenerateRequest) -> bool:
    """Whether the answer must be JSON (a ``response_format`` other than text)."""
    return isinstance(request.response_format, JsonSchemaFormat | JsonObjectFormat)


def format_schema(request: GenerateRequest) -> dict[str, Any] | None:
    """The JSON schema of a :func:`formatted` request's ``response_format``, its objects
    closed (a strict one's all, another's where they list their properties, as llama.cpp's
    converter reads them: protocol/strict_schema.py); None: any JSON object.  Raises
    :class:`ConstraintError`."""
    fmt = request.response_format
    if isinstance(fmt, JsonSchemaFormat):
        schema, strict = fmt.json_schema.schema, bool(fmt.json_schema.strict)
    elif isinstance(fmt, JsonObjectFormat):
        schema, strict = fmt.schema, False
    else:
        return None
    if schema is None:
        return None
    try:
        return closed(schema, bare=strict)  # type: ignore[no-any-return]
    except RecursionError:
        raise ConstraintError("invalid JSON schema: nested too deeply") from None


def blame_a_tool(request: GenerateRequest) -> None:
    """Raises the first offered tool's own schema error, compiled alone (a call grammar that
    fails names no tool, or points into the grammar built here), naming its field; returns
    if each compiles."""
    for i, tool in enumerate(request.tools or ()):
        try:
            check_alone(json_schema_constraint(tool_schema(tool)))
        except ConstraintError as exc:
            raise ConstraintError(tool_fault(i, str(exc).removeprefix("invalid JSON schema: "))) from None


async def sampler_for(
    engine: Engine, request: GenerateRequest, tool_grammar: OutputConstraint | None = None
) -> Sampler:
    """The request's sampler, under its schema or grammar (or ``tool_grammar``, the one its
    tools need), compiled off the event loop.  An invalid one is an :class:`UmaError` naming
    the problem (``E_GRAMMAR_001``)."""
    params = sampling_params(request)
    if params.repeat_last_n > engine.n_ctx_seq:  # a look-back past the context: the context
        params = replace(params, repeat_last_n=engine.n_ctx_seq)
    try:
        # Turning a grammar or schema into llguidance's takes time (GBNF's converter is
        # quadratic in its rules): done off the event loop, below, never on it.
        constrained = tool_grammar is not None or request.grammar is not None or formatted(request)
        top = request.top_logprobs if request.logprobs else None
        if not constrained and not params.needs_chain and top is None:
            return Sampler(params)
        vocabulary = engine.vocabulary
        if vocabulary is None:
            raise UmaError(
                ErrorCode.MODEL,
                "this engine has no vocabulary: it cannot constrain output or run llama.cpp's samplers",
                request_id=request.id,
            )
        outside = [t for t, _ in params.logit_bias if t >= vocabulary.n_vocab]
        if outside:
            raise UmaError(
                ErrorCode.SCHEMA,
                f"logit_bias names token {outside[0]}, which is not in the vocabulary "
                f"(0-{vocabulary.n_vocab - 1})",
                request_id=request.id,
            )
        if not constrained:
            return vocabulary.sampler(params, top_logprobs=top)  # microseconds to build

        # llguidance's tokenizer is built once from llama.cpp's vocabulary: never abandoned
        # (the model may be freed at shutdown).  The compile itself is llguidance's alone and
        # can take seconds (a 4,000-rule grammar: ~20 s on 2 cores): a shutdown or a hang-up
        # stops waiting for it.
        await off_loop(engine, vocabulary.tokenizer, small=vocabulary.has_tokenizer)
        lark = None
        if request.grammar is not None and engine.tokenizer_blocks and needs_converting(request.grammar):
            check_grammar_size(request.grammar)
            lark = await gbnf_as_lark(request.grammar)  # in a process of its own: killed on cancel

        def compile_matcher() -> llguidance.LLMatcher:
            if tool_grammar is not None and (answer := output_constraint(request, lark)) is not None:
                check_alone(answer)  # the format's own faults, named as its, not the tools'
            constraint = tool_grammar or output_constraint(request, lark)
            assert constraint is not None  # constrained, above
            try:
                return vocabulary.matcher(constraint)
            except ConstraintError:
                if tool_grammar is not None:
                    blame_a_tool(request)
                raise

        compiling = partial(on_big_stack, compile_matcher)
        matcher = await off_loop(engine, compiling, abandon=True, limiter=compile_limiter())
        return vocabulary.sampler(params, top_logprobs=top, matcher=matcher)
    except ConstraintError as exc:
        message = str(exc)
        # The call grammar's own words (not a tool's, named by blame_a_tool), in the request's.
        if message.startswith(TOOL_GRAMMAR_ERROR) and "`tools[" not in message:
            message = tool_error_words(message)
        raise UmaError(ErrorCode.GRAMMAR, message, request_id=request.id) from None
