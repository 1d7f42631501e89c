"""A request's GBNF grammar turned into llguidance's Lark in a process of its own.

llguidance's converter is Python, and its time grows with the square of the rules (4,000
chained rules, within the limits: ~56 s of a core here, 80-170 s on a busy machine).  Run
in the daemon it held the GIL beside the decode for all that time, and it could not be
stopped: two clients that sent such grammars and hung up held both compile threads for two
minutes, and every JSON-constrained request of anyone else waited behind them.  In a process
of its own (engine/gbnf_worker.py) the conversion is killed as soon as its request is
cancelled (the client hangs up, the daemon stops), is refused past
:data:`CONVERT_LIMIT_S`, and runs one at a time, apart from the compiles.  The same grammar
comes again with every call of an agent: the last :data:`KEPT` conversions are kept.
"""

from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict

import trio

from ..engine.constraints import ConstraintError
from .off_loop import run_limiter

CONVERT_LIMIT_S = 30.0
CONVERTS_AT_ONCE = 1  # each takes a core while it runs
KEPT = 32
_converts: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("gbnf_converts")
_kept: OrderedDict[bytes, str] = OrderedDict()  # the grammar's digest -> its Lark


async def gbnf_as_lark(text: str) -> str:
    """``text`` (GBNF, within the size limits) as Lark; :class:`ConstraintError` if the
    converter refuses it or takes longer than :data:`CONVERT_LIMIT_S`."""
    key = hashlib.sha256(text.encode()).digest()
    if (lark := _kept.get(key)) is not None:
        _kept.move_to_end(key)
        return lark
    async with run_limiter(_converts, CONVERTS_AT_ONCE):
        with trio.move_on_after(CONVERT_LIMIT_S) as late:
            done = await trio.run_process(
                [sys.executable, "-m", "uma_trio.engine.gbnf_worker"], stdin=text.encode(),
                capture_stdout=True, capture_stderr=True, check=False,
            )  # fmt: skip
    if late.cancelled_caught:
        raise ConstraintError(
            f"the grammar took over {CONVERT_LIMIT_S:g} s to convert from GBNF (llguidance's "
            "converter takes time with the square of the rules); write it in Lark (`start: ...`) "
            "or with fewer rules"
        )
    if done.returncode != 0:
        problem = done.stderr.decode(errors="replace").strip() or f"the converter exited {done.returncode}"
        raise ConstraintError(f"invalid grammar: {problem}")
    lark = done.stdout.decode()
    _kept[key] = lark
    if len(_kept) > KEPT:
        _kept.popitem(last=False)
    return lark
