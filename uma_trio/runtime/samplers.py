"""A request's sampler: its sampling parameters, constrained by its grammar if it has one."""

from __future__ import annotations

from ..engine.base import Engine
from ..engine.constraints import (
    ConstraintError,
    OutputConstraint,
    grammar_constraint,
    json_schema_constraint,
)
from ..engine.sampling import Sampler, SamplingParams
from ..protocol.errors import ErrorCode, UmaError
from ..protocol.messages import GenerateRequest, JsonObjectFormat, JsonSchemaFormat
from .off_loop import off_loop


def sampling_params(request: GenerateRequest) -> SamplingParams:
    return SamplingParams(
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
        min_p=request.min_p, seed=request.seed,
    )  # fmt: skip


def output_constraint(request: GenerateRequest) -> OutputConstraint | None:
    """What the request's output must match (pure); raises :class:`ConstraintError`."""
    if request.grammar is not None:
        return grammar_constraint(request.grammar)
    fmt = request.response_format
    if isinstance(fmt, JsonSchemaFormat):
        return json_schema_constraint(fmt.json_schema.schema)
    if isinstance(fmt, JsonObjectFormat):
        return json_schema_constraint(fmt.schema)
    return None


async def sampler_for(
    engine: Engine, request: GenerateRequest, tool_grammar: OutputConstraint | None = None
) -> Sampler:
    """The request's sampler, under its schema or grammar (or ``tool_grammar``, the one its
    tools need), compiled off the event loop.  An invalid one is an :class:`UmaError` naming
    the problem (``E_GRAMMAR_001``)."""
    params = sampling_params(request)
    try:
        constraint = tool_grammar or output_constraint(request)
        if constraint is None:
            return Sampler(params)
        vocabulary = engine.grammar_vocabulary
        if vocabulary is None:
            raise UmaError(
                ErrorCode.MODEL,
                "this engine cannot constrain output (it has no vocabulary)",
                request_id=request.id,
            )
        return await off_loop(engine, lambda: vocabulary.sampler(params, constraint))
    except ConstraintError as exc:
        raise UmaError(ErrorCode.GRAMMAR, str(exc), request_id=request.id) from None
