"""Plain-text tables, as `Plan.summary` and the command line print them (private).

Tables fit `WIDTH` columns: a column of layer names gets what the other
columns leave (`free_width`), and a run of links is named by its first and
last layer call and a count (`span_name`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__: list[str] = []

WIDTH = 100
"""The most characters a table's line takes unless every name is asked for."""

_LEAST_NAMES = 16  # the names column never gets less, even if the line then runs over
_GAP = "  "


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
    widths = _widths(header, rows)

    def line(row: Sequence[str]) -> str:
        cells = [
            text.rjust(width) if k in right else text.ljust(width)
            for k, (text, width) in enumerate(zip(row, widths))
        ]
        return _GAP.join(cells).rstrip()

    return "\n".join([line(header), *(line(row) for row in rows)])


def _widths(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[int]:
    return [max(len(row[k]) for row in [header, *rows]) for k in range(len(header))]


def free_width(
    header: Sequence[str], rows: Sequence[Sequence[str]], column: int, *, width: int = WIDTH
) -> int:
    """The characters `column` may take for the table to fit `width` (at least 16).

    The cells of `column` in `rows` are ignored (fill them in afterwards).

    Example:
        >>> free_width(("#", "name", "bytes"), [("0", "", "1.00 KiB")], 1, width=40)
        27
    """
    widths = _widths(header, rows)
    others = sum(w for k, w in enumerate(widths) if k != column)
    return max(width - others - len(_GAP) * (len(header) - 1), _LEAST_NAMES)


def shorten(text: str, width: int) -> str:
    """`text`, its middle replaced by "…" if it is longer than `width` characters.

    A third of what is kept is the start, the rest the end (the end of a
    layer name tends to tell it from its neighbours).

    Example:
        >>> shorten("stage_2_block_7_depthwise_conv", 16)
        'stage…hwise_conv'
    """
    if len(text) <= width:
        return text
    head = (width - 1) // 3
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


def span_name(names: Sequence[str], width: int | None = None) -> str:
    """The names of a run of links, in at most `width` characters (no limit for None).

    A link merged from several layer calls is named by its calls joined with
    "+". A run of one or two calls keeps its full name if it fits; a longer
    one is named by its first and last call and a count of links (of calls
    for a single link, whose last call drops the start it shares with the
    first), cut in the middle where needed; a link of two calls is named by both.

    Example:
        >>> span_name(["conv1+bn+relu"])
        'conv1 … relu (3 calls)'
        >>> span_name(["a", "b+c", "d"])
        'a … d (3 links)'
        >>> span_name(["block_0_pointwise_conv+block_0_gelu"], 24)
        'block_0…ntwise_conv+gelu'
    """
    calls = [call for name in names for call in name.split("+")]
    full = ", ".join(names)
    limit = len(full) if width is None else width
    if len(calls) == 1 or (len(calls) == 2 and len(full) <= limit):
        return shorten(full, limit)
    # The calls of one link tend to share their layer's prefix: the last one drops it.
    last = calls[-1] if len(names) > 1 else _own_part(calls[-1], calls[0])
    if len(calls) == 2 and len(names) == 1:  # one link of two calls: both, the end kept
        return shorten(f"{calls[0]}+{last}", limit)
    count = f"({len(names)} links)" if len(names) > 1 else f"({len(calls)} calls)"
    first = calls[0]
    if width is not None:
        last = shorten(last, max((width - len(count) - 4) // 2, 8))
        first = shorten(first, width - len(f" … {last} {count}"))
    return f"{first} … {last} {count}"


def _own_part(name: str, other: str) -> str:
    """`name` without the start it shares with `other`, cut after a "_", "/" or "."."""
    shared = 0
    for k, (a, b) in enumerate(zip(name, other)):
        if a != b:
            break
        if a in "_/.":
            shared = k + 1
    return name[shared:] or name
