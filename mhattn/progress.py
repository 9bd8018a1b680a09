"""The one progress display of ``mhattn conformance``, ``bench`` and ``tune``: a plain bar on stderr, one
redrawn line on a terminal, a line now and then in a log file."""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """``start(label)`` before a task, ``advance()`` after it, ``write(text)`` for a log line in between;
    ``advance(failure=text)`` counts a failed task and prints ``text`` at once.

    On a terminal the bar is redrawn in place (at most 10 times a second); otherwise (a log file) a line
    is printed every ``log_every`` seconds and at the end, so logs stay short.
    """

    def __init__(self, total: int, *, stream=None, enabled: bool = True, width: int = 28, log_every: float = 15.0,
                 title: str = ""):
        self.total = max(0, int(total))
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.log_every = log_every
        self.title = title
        self.done = 0
        self.failed = 0          # tasks advanced with a failure, shown on the bar
        self.label = ""
        self.started = time.monotonic()
        self._last_draw = 0.0
        self._last_log = self.started
        self._drawn = False
        self._last_line = ""
        try:
            self.tty = bool(self.stream.isatty())
        except Exception:
            self.tty = False

    # ---- events ----------------------------------------------------------------------------------------
    def start(self, label: str) -> None:
        self.label = label
        self._draw(force=self.tty)

    def advance(self, count: int = 1, failure: str = "") -> None:
        if failure:
            self.failed += 1
            if self.enabled:
                self.write(failure)
        self.done = min(self.total, self.done + count)
        self._draw()

    def write(self, text: str) -> None:
        """Print a line without tearing the bar."""
        if self.enabled and self.tty and self._drawn:
            self.stream.write("\r\033[K")
        self.stream.write(text.rstrip("\n") + "\n")
        self._drawn = False
        self._draw(force=self.tty)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.tty:
            self._draw(force=True)
            self.stream.write("\n")
        elif self.line() != self._last_line:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    # ---- drawing ---------------------------------------------------------------------------------------
    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        fraction = self.done / self.total if self.total else 1.0
        filled = int(round(self.width * fraction))
        bar = "#" * filled + "-" * (self.width - filled)
        eta = ""
        if 0 < self.done < self.total:
            eta = f" eta {_clock(elapsed / self.done * (self.total - self.done))}"
        title = f"{self.title} " if self.title else ""
        label = f"  {self.label}" if self.label and self.done < self.total else ""
        failed = f" {self.failed} failed" if self.failed else ""
        return f"{title}[{bar}] {self.done}/{self.total}{failed} {_clock(elapsed)}{eta}{label}"

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if not force and now - self._last_draw < 0.1 and self.done < self.total:
                return
            self.stream.write("\r\033[K" + self.line()[: 160])
            self._drawn = True
            self._last_draw = now
        elif now - self._last_log >= self.log_every:
            self._last_line = self.line()
            self.stream.write(self._last_line + "\n")
            self._last_log = now
        self.stream.flush()
