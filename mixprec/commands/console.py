"""The console every command prints through.

rich sizes tables to the terminal; when output goes to a file, a pipe or a CI log there is no terminal and
rich would assume 80 columns, squeezing wide tables into unreadable stubs. Plain output gets a width that
fits the widest table of any command instead (and no colour codes, which rich already drops)."""

from __future__ import annotations

from rich.console import Console

PLAIN_WIDTH = 160  # the widest command table (mixprec compare's ladder) fits without wrapping


def make_console() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = PLAIN_WIDTH
    return console
