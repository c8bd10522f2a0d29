"""Plain-text tables, as `Plan.summary` and the command line print them (private)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__: list[str] = []


def table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, right: Collection[int] = ()
) -> str:
    """Columns padded to their widest cell, two spaces apart; `right` columns right-aligned.

    Example:
        >>> print(table(("name", "bytes"), [("a", "1"), ("bcd", "22")], right={1}))
        name  bytes
        a         1
        bcd      22
    """
    widths = [max(len(row[k]) for row in [header, *rows]) for k in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [
            text.rjust(width) if k in right else text.ljust(width)
            for k, (text, width) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), *(line(row) for row in rows)])
