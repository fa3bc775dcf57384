"""A griffe extension for the API reference, so the docstrings render as they read in the source.

The docstrings title their doctests ``Example:``, which griffe's Google parser reads as an admonition (the ``>>>``
lines as prose): renamed ``Examples:``, they render as code, and so do doctests that follow a paragraph with no
section title. A few hold reStructuredText simple tables (rows between ``====  ====`` rules), which Markdown would
turn into headings: they are shown as preformatted text.
"""

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)
_RULE = re.compile(r"^\s*=+(\s+=+)+\s*$")


def _rst_tables_as_text(text: str) -> str:
    """Each simple table (three ``=`` rules: top, under the header, bottom) fenced as a ``text`` block."""
    lines, out, rules = text.splitlines(), [], 0
    for line in lines:
        if _RULE.match(line):
            if rules == 0:
                out.append("```text")
            rules += 1
            out.append(line)
            if rules == 3:
                out.append("```")
                rules = 0
        else:
            out.append(line)
    return "\n".join(out) if rules == 0 else text


def _bare_doctests_as_code(text: str) -> str:
    """Each doctest starting at column 0 (outside a section, whose content is indented), up to the next blank line,
    fenced as a ``pycon`` block."""
    out, inside = [], False
    for line in text.splitlines():
        if not inside and line.startswith(">>>"):
            out.append("```pycon")
            inside = True
        elif inside and not line.strip():
            out.append("```")
            inside = False
        out.append(line)
    if inside:
        out.append("```")
    return "\n".join(out)


class ExampleSections(griffe.Extension):
    """Rename ``Example:`` section titles to ``Examples:``, fence bare doctests and reStructuredText tables, before
    parsing."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            value = _EXAMPLE.sub(r"\n\1Examples:", obj.docstring.value)
            obj.docstring.value = _bare_doctests_as_code(_rst_tables_as_text(value))
