"""What a stack says while it runs: a live table at a terminal, plain lines elsewhere."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TextIO

from hold_supervisor.width import columns, fit, terminal_columns


class Display:
    """What the stack says while it runs.

    At a terminal, a table (unit, state, pid, port, waited, last output line)
    redrawn in place while units start; elsewhere, one plain line per change.
    ``write`` receives whole lines (without the newline).
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        prefix: str = "hold up",
        write: Callable[[str], None] | None = None,
        live: bool | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.prefix = prefix
        self._write = write
        self.live = (self.stream.isatty() and write is None) if live is None else live
        self._drawn = 0
        self._lock = threading.Lock()
        self.table_on = False
        self._last_rows: list[list[str]] = []

    def line(self, text: str) -> None:
        with self._lock:
            rows = self._drawn
            self._erase()
            self._emit(f"{self.prefix}: {text}")
            if self.table_on and rows:
                self._drawn = 0
                self._draw_locked(self._last_rows)

    def _emit(self, text: str) -> None:
        if self._write is not None:
            self._write(text)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def table(self, rows: list[list[str]]) -> None:
        """Redraw the live table (a no-op where there is no terminal)."""
        if not self.live:
            return
        with self._lock:
            self.table_on = True
            self._last_rows = rows
            self._erase()
            self._draw_locked(rows)

    def end_table(self) -> None:
        with self._lock:
            self.table_on = False
            self._drawn = 0

    def _erase(self) -> None:
        if self._drawn:
            self.stream.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0

    def _draw_locked(self, rows: list[list[str]]) -> None:
        # The one rule (supervisor/width.py): the stream's terminal, else COLUMNS or 80.
        width = columns(self.stream) or terminal_columns()
        head = ["UNIT", "STATE", "PID", "PORT", "WAITED", "LAST OUTPUT"]
        all_rows = [head, *rows]
        widths = [max(len(r[i]) for r in all_rows) for i in range(5)]
        out = []
        for r in all_rows:
            text = "  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5]
            out.append(fit(text, width))
        self.stream.write("\n".join(out) + "\n")
        self.stream.flush()
        self._drawn = len(out)
