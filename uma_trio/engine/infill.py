"""Fill-in-the-middle: an editor's prefix, suffix and other files as the prompt a code model
was trained on, with its FIM tokens (as llama-server's ``format_infill`` lays it out):

    [<fim_rep>project\\n <fim_sep>file\\ntext ...] <fim_pre>prefix<fim_suf>suffix<fim_mid>

The texts are tokenized as plain text (a ``<fim_pre>`` typed into the code stays text).
A model without the three FIM tokens cannot infill: :class:`NoFimTokens`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .base import TokenArray

NO_FIM_TOKENS = "this model has no fill-in-the-middle tokens (FIM): infill needs a code model that has them"


class NoFimTokens(ValueError):
    """The model has no fill-in-the-middle tokens."""


@dataclass(frozen=True, slots=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    rep: int | None = None  # repository name: other files of the project follow
    sep: int | None = None  # file separator


def infill_tokens(
    fim: FimTokens | None,
    tokenize: Callable[[str], Sequence[int]],
    prefix: str,
    suffix: str,
    extra: Sequence[tuple[str, str]] = (),
    bos: int | None = None,
    middle: str = "",
) -> TokenArray:
    """The infill prompt; ``extra`` is (file name, text) of other files, as context, and
    ``middle`` the start of the middle, already written (llama-server's ``prompt``)."""
    if fim is None:
        raise NoFimTokens(NO_FIM_TOKENS)
    tokens: list[int] = [] if bos is None else [bos]
    if extra and fim.rep is not None and fim.sep is not None:
        tokens += [fim.rep, *tokenize("project\n")]
        for name, text in extra:
            tokens += [fim.sep, *tokenize(f"{name}\n{text}")]
        tokens += [fim.sep]
    elif extra:  # no repository tokens: the files as commented-out context before the prefix
        prefix = "".join(f"{text}\n" for _, text in extra) + prefix
    tokens += [fim.pre, *tokenize(prefix), fim.suf, *tokenize(suffix), fim.mid, *tokenize(middle)]
    return np.asarray(tokens, dtype=np.int32)
