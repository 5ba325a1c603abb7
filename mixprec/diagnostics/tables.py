"""The diagnostics' tables: rich tables that the built-in ``print`` shows as plain text too.

``rich.print(table)`` (or a rich Console) renders a rich Table in colour; the built-in ``print`` showed
``<rich.table.Table object at 0x...>`` (a user trial printed ``CastTrace.table()`` so). :class:`PlainTable`
is a rich Table whose ``str()`` is its plain-text rendering.
"""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

__all__ = ["PlainTable"]

# Wide enough for the widest diagnostics table (the gradient report's eleven columns) without wrapping
TEXT_WIDTH = 160


class PlainTable(Table):
    """A rich Table; ``str(table)`` and ``print(table)`` give its plain-text rendering."""

    def __str__(self) -> str:
        buffer = io.StringIO()
        Console(file=buffer, width=TEXT_WIDTH, color_system=None).print(self)
        return buffer.getvalue().rstrip("\n")
