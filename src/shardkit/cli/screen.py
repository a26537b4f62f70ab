"""How the command line shows things to a person (Rich, imported only with this module):
lines broken at spaces only, names never split, tables only when they fit."""

from __future__ import annotations

import re
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text


class Screen(Console):
    """A console whose text is broken into lines at spaces only: a word longer than a
    line is left whole on a line of its own, for the terminal to fold (a terminal folds
    it as one line, which copies whole), where Rich would break it up with newlines.
    ``soft_wrap=True`` prints text as it is. Tables, progress bars and other
    renderables are Rich's. Not a terminal: nothing is wrapped or cut."""

    def __init__(self, **options: Any) -> None:
        super().__init__(highlight=False, emoji=False, **options)
        if not self.is_terminal:
            self.width = 1_000_000

    def print(self, *objects: Any, soft_wrap: bool | None = None, **options: Any) -> None:
        as_is = self.soft_wrap if soft_wrap is None else soft_wrap
        if as_is or not objects or not all(isinstance(each, str | Text) for each in objects):
            super().print(*objects, soft_wrap=soft_wrap, **options)
            return
        text = Text(" ").join(
            self.render_str(each, markup=options.get("markup")) if isinstance(each, str) else each
            for each in objects
        )
        super().print(at_spaces(text, self.width), soft_wrap=True, **options)


def at_spaces(text: Text, width: int) -> Text:
    """``text`` with each of its lines broken at spaces into lines of at most ``width``
    cells; a word longer than that keeps a line of its own, whole."""
    lines: list[Text] = []
    for line in text.split("\n", allow_blank=True):
        plain = line.plain
        breaks: list[int] = []
        filled = seen = words = 0  # the line being filled: its cells up to seen, its words
        for word in re.finditer(r"[^ ]+", plain):
            filled += cell_len(plain[seen : word.end()])
            seen = word.end()
            if filled > width and words:
                breaks.append(word.start())
                filled, words = cell_len(word.group()), 0
            words += 1
        for part in line.divide(breaks):
            part.rstrip()
            lines.append(part)
    return Text("\n").join(lines)


def listing(screen: Screen, table: Table) -> None:
    """Print ``table`` if each of its rows fits the screen's width on one line;
    otherwise each row as a block: its first cell on a line of its own, whole, then each
    other cell beside its column's header, indented (as ``psql``'s expanded display)."""
    natural = screen.measure(table, options=screen.options.update_width(1_000_000)).maximum
    if natural <= screen.width:
        screen.print(table)
        return
    first, *others = table.columns
    headers = [str(column.header) for column in others]
    pad = max(map(len, headers))
    for key, *cells in zip(first.cells, *(column.cells for column in others), strict=True):
        screen.print(key, style="bold", soft_wrap=True)
        for header, cell in zip(headers, cells, strict=True):
            screen.print(Text.assemble("  ", header.ljust(pad), "  ", cell))
