"""A progress bar on stderr with plain ``\\r`` updates (no dependency), and failures printed as they happen.

On a terminal the bar redraws in place; when stderr is a file or a pipe it prints one line per tenth
of the run instead, so a captured log stays short.
"""

from __future__ import annotations

import shutil
import sys
import time


class Progress:
    def __init__(self, total: int, stream=None, enabled: bool = True):
        self.total = max(total, 0)
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done_count = 0
        self.failed = 0
        self.unsupported = 0
        self.label = ""
        self.started = time.monotonic()
        self._last_decile = -1
        self._drawn = False

    def _elapsed(self) -> str:
        seconds = int(time.monotonic() - self.started)
        return f"{seconds // 60}:{seconds % 60:02d}"

    def _line(self) -> str:
        width = 24
        filled = int(width * self.done_count / self.total) if self.total else width
        bar = "#" * filled + "-" * (width - filled)
        failed = f" {self.failed} failed" if self.failed else ""
        return f"[{bar}] {self.done_count}/{self.total}{failed} {self._elapsed()}  {self.label}"

    def _draw(self):
        if not self.tty:
            return
        columns = shutil.get_terminal_size((100, 20)).columns
        line = self._line()[: columns - 1]
        self.stream.write("\r" + line.ljust(columns - 1))
        self.stream.flush()
        self._drawn = True

    def _clear(self):
        if self.tty and self._drawn:
            columns = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r" + " " * (columns - 1) + "\r")
            self._drawn = False

    def message(self, text: str) -> None:
        """Print a line above the bar."""
        if not self.enabled:
            return
        self._clear()
        self.stream.write(text + "\n")
        self.stream.flush()
        self._draw()

    def start(self, label: str) -> None:
        self.label = label
        self._draw()

    def finish_case(self, result) -> None:
        """Count ``result`` (a CaseResult); a failure is printed at once with its reproduce command."""
        self.done_count += 1
        if result.status == "fail":
            self.failed += 1
            summary = result.summary()
            summary = summary if len(summary) <= 400 else summary[:396] + " ..."
            self.message(f"FAIL {result.case.backend} {result.case.feature} [{result.case.describe()}]: "
                         f"{summary}\n  reproduce: {result.case.command()}")
        elif result.status == "unsupported":
            self.unsupported += 1
        if self.tty:
            self._draw()
        elif self.enabled and self.total:
            decile = 10 * self.done_count // self.total
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(f"progress: {self._line()}\n")
                self.stream.flush()

    def close(self) -> None:
        self._clear()
