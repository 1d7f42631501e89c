"""Fill-in-the-middle: an editor's prefix, suffix and other files as the prompt a code model
was trained on, with its FIM tokens (as llama-server's ``format_infill`` lays it out):

    [<fim_rep>project\\n <fim_sep>file\\ntext ...] <fim_pre>prefix<fim_suf>suffix<fim_mid>

The texts are tokenized as plain text (a ``<fim_pre>`` typed into the code stays text).
A model without the three FIM tokens cannot infill: :class:`NoFimTokens`.

Given a ``budget`` of tokens, a prompt that would pass it is cut as llama-server cuts an
infill, so an editor's growing context never turns completions into errors: the other files
go first, oldest (first listed) first, then the prefix loses its start and the suffix its
end (the suffix keeping at least a quarter of what is left, as llama-server gives it); the
FIM tokens and the middle already written are never cut."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .base import TokenArray

log = logging.getLogger(__name__)

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
    budget: int | None = None,
) -> TokenArray:
    """The infill prompt; ``extra`` is (file name, text) of other files, as context, and
    ``middle`` the start of the middle, already written (llama-server's ``prompt``).  With
    ``budget``, cut to at most that many tokens where it can be (the module docstring); as
    it is where even the FIM tokens and the middle pass it."""
    if fim is None:
        raise NoFimTokens(NO_FIM_TOKENS)
    head: list[int] = [] if bos is None else [bos]
    # Other files: the repository's name before them, each with its separator first, and a
    # separator after them.
    project: list[int] = []
    files: list[list[int]] = []
    trailer: list[int] = []
    if extra and fim.rep is not None and fim.sep is not None:
        project = [fim.rep, *tokenize("project\n")]
        files = [[fim.sep, *tokenize(f"{name}\n{text}")] for name, text in extra]
        trailer = [fim.sep]
    elif extra:  # no repository tokens: the files as commented-out context before the prefix
        prefix = "".join(f"{text}\n" for _, text in extra) + prefix
    before, after = list(tokenize(prefix)), list(tokenize(suffix))
    written = list(tokenize(middle))
    fixed = len(head) + 3 + len(written)  # tokens never cut: BOS, the FIM tokens, the middle
    texts = len(before) + len(after)
    extra_len = len(project) + sum(map(len, files)) + len(trailer)
    was = fixed + texts + extra_len
    if budget is not None and was > budget:
        listed, cut_from = len(files), (len(before), len(after))
        while files and fixed + texts + extra_len > budget:
            extra_len -= len(files.pop(0))
        if not files:
            project, trailer = [], []
        room = budget - fixed
        if fixed + texts > budget and room > 0:
            take_after = min(len(after), max(room // 4, room - len(before)))
            take_before = min(len(before), room - take_after)
            before, after = before[len(before) - take_before :], after[:take_after]
    tokens = [*head, *project, *(t for file in files for t in file), *trailer]
    tokens += [fim.pre, *before, fim.suf, *after, fim.mid, *written]
    if len(tokens) < was:
        log.warning(
            "infill prompt of %d tokens cut to %d for a budget of %d: %d of its %d other files "
            "dropped, its prefix of %d tokens to %d, its suffix of %d to %d", was, len(tokens),
            budget, listed - len(files), listed, cut_from[0], len(before), cut_from[1], len(after),
        )  # fmt: skip
    return np.asarray(tokens, dtype=np.int32)
