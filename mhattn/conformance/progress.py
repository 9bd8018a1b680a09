"""The conformance run's progress: the shared bar (:mod:`mhattn.progress`) counting cases, with each failure
printed as it happens, with its reproduce command."""

from __future__ import annotations

from mhattn.progress import Progress


class CaseProgress(Progress):
    def __init__(self, total: int, stream=None, enabled: bool = True):
        super().__init__(total, stream=stream, enabled=enabled, title="conformance")
        self.unsupported = 0

    def finish_case(self, result) -> None:
        """Count ``result`` (a CaseResult); a failure is printed at once with its reproduce command."""
        if result.status == "fail":
            self.failed += 1
            if self.enabled:
                summary = result.summary()
                summary = summary if len(summary) <= 400 else summary[:396] + " ..."
                self.write(f"FAIL {result.case.backend} {result.case.feature} [{result.case.describe()}]: "
                           f"{summary}\n  reproduce: {result.case.command()}")
        elif result.status == "unsupported":
            self.unsupported += 1
        self.advance()
