"""docs/CONFIG.md's table of ``serve`` flags, written from the flags themselves.

The rows come from what cyclopts builds for ``uma-trio serve`` out of ``ServerConfig``'s
fields (and serve's own ``--model`` / ``--log-level``): the flag, its default and its help
text, so the table cannot drift from the code.  ``python -m uma_trio.config_doc`` rewrites
the table in place; tests/test_config_docs.py fails when the file and the code disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path

START = "<!-- serve flags: written by `python -m uma_trio.config_doc` from uma_trio/config.py -->"
END = "<!-- end of serve flags -->"
CONFIG_MD = Path(__file__).resolve().parent.parent / "docs" / "CONFIG.md"


def _default_text(shown: object, default: object) -> str:
    if isinstance(shown, str):
        return shown
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    if isinstance(default, int | str):
        return str(default)
    raise ValueError(f"give this flag's default a show_default text: {default!r}")


def serve_flags() -> list[tuple[str, str, str]]:
    """(flag, default, help) for every flag ``uma-trio serve`` takes, in declaration order."""
    from .cli import app

    rows = []
    for argument in app["serve"].assemble_argument_collection(parse_docstring=True):
        if argument.children or not argument.parse:  # the flattened dataclass itself; hidden fields
            continue
        help_text = " ".join((argument.parameter.help or "").split())
        if not help_text:
            raise ValueError(f"{argument.name} has no help text (a docstring under its field)")
        default = _default_text(argument.parameter.show_default, argument.field_info.default)
        rows.append((argument.name, default, help_text))
    return rows


def render() -> str:
    lines = [START, "", "| flag | default | meaning |", "| --- | --- | --- |"]
    for flag, default, help_text in serve_flags():
        lines.append(f"| `{flag}` | {default.replace('|', '&#124;')} | {help_text.replace('|', '&#124;')} |")
    return "\n".join([*lines, "", END])


def documented(text: str) -> str:
    """The generated section of a CONFIG.md text, markers included."""
    start, end = text.index(START), text.index(END) + len(END)
    return text[start:end]


def write(path: Path = CONFIG_MD) -> bool:
    """Rewrite the table in ``path``; True when it changed."""
    text = path.read_text()
    new = text.replace(documented(text), render())
    path.write_text(new)
    return new != text


if __name__ == "__main__":
    changed = write(Path(sys.argv[1]) if len(sys.argv) > 1 else CONFIG_MD)
    print("rewrote the serve flag table" if changed else "the serve flag table was up to date")
