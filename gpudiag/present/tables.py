"""The one markdown table writer: report.md, compare and gate summaries, docs/rules.md."""

from __future__ import annotations

from collections.abc import Sequence


def _cell(text: str) -> str:
    # A `|` would end the cell and a newline the row (GitHub-flavoured markdown tables).
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                   right: Sequence[bool] | int = 1) -> list[str]:
    """Lines of a markdown table. `right` says which columns align right: a flag per column,
    or the index of the first right-aligned column (every one after it too)."""
    flags = ([i >= right for i in range(len(header))] if isinstance(right, int)
             else list(right))
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |",
             "| " + " | ".join("---:" if r else "---" for r in flags) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines
