"""``python -m uma_trio.engine.gbnf_worker``: GBNF on stdin, llguidance's Lark on stdout.

llguidance turns llama.cpp's GBNF into its Lark dialect with a Python converter whose time
grows with the square of the rules (4,000 chained rules: ~56 s of a core here).  In the
daemon's process it held the GIL all that while, beside the decode, and could not be
stopped when its client hung up; in a process of its own it can be killed
(runtime/gbnf_convert.py).  A grammar the converter refuses exits 1 with its message on
stderr, worded as ``llguidance.grammar_from`` words it.
"""

from __future__ import annotations

import sys

from llguidance.gbnf_to_lark import any_to_lark


def main() -> int:
    text = sys.stdin.buffer.read().decode()
    try:
        lark = any_to_lark(text)
    except Exception as exc:  # the converter's own faults: every kind is the grammar's
        sys.stderr.write(f"Failed to convert the grammar from GBNF to Lark: {exc}")
        return 1
    sys.stdout.buffer.write(lark.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
