"""The result of a conformance run as a table: features down, backend x dtype across.

Each cell says ``pass`` with the worst error ratio (err / bound, <= 1 passes) of its cases, ``FAIL`` with
how many of its cases failed and the worst ratio, or ``unsupported`` with a numbered reason from the
backend's own ``unsupported()``. Written as plain text (the terminal), Markdown or JSON, with the run's
wall time, its number of jobs and the slowest cases (where the time went).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional

from mhattn.conformance.cases import COLUMN_DESCRIPTIONS, COLUMNS
from mhattn.conformance.runner import FAIL, NOT_RUN, PASS, UNSUPPORTED, CaseResult


@dataclass
class ExtraCheck:
    """A check that is not an attention case (the NVRTC compile of the CUDA sources, say)."""

    name: str
    status: str          # "pass", "fail", "not available", "skipped"
    detail: str = ""


@dataclass
class Report:
    mode: str                                       # "quick", "full" or "case"
    device: str                                     # "cuda" or "cpu"
    environment: dict
    results: list = field(default_factory=list)     # CaseResult
    unavailable: dict = field(default_factory=dict)  # backend name -> reasons it ran nothing
    notes: list = field(default_factory=list)       # what was and was not run, in sentences
    extra: list = field(default_factory=list)       # ExtraCheck
    seconds: float = 0.0                            # wall time of the run (of every run, merged)
    jobs: Optional[int] = None                      # worker processes at once; None: not recorded (an older
                                                    # JSON report) or merged runs that differ

    @property
    def failures(self) -> list:
        return [r for r in self.results if r.status == FAIL]

    @property
    def ok(self) -> bool:
        """Nothing failed (unsupported and unavailable are not failures)."""
        return not self.failures and all(x.status != "fail" for x in self.extra)

    @property
    def not_run(self) -> list:
        """Cases the time limit left out."""
        return [r for r in self.results if r.status == NOT_RUN]


@dataclass
class Cell:
    results: list

    @property
    def counts(self):
        by = {PASS: 0, FAIL: 0, UNSUPPORTED: 0, NOT_RUN: 0}
        for r in self.results:
            by[r.status] = by.get(r.status, 0) + 1
        return by

    @property
    def worst_ratio(self) -> float:
        return max((r.worst_ratio for r in self.results if r.status in (PASS, FAIL)), default=0.0)

    @property
    def reasons(self) -> list:
        seen = []
        for r in self.results:
            if r.status == UNSUPPORTED:
                text = "; ".join(r.reasons)
                if text not in seen:
                    seen.append(text)
        return seen

    @property
    def status(self) -> str:
        counts = self.counts
        if counts[FAIL]:
            return FAIL
        if counts[PASS]:
            return PASS
        if counts[UNSUPPORTED]:
            return UNSUPPORTED
        return NOT_RUN


def _ratio(x: float) -> str:
    if math.isinf(x) or math.isnan(x):
        return "inf"
    return f"{x:.2f}" if x < 100 else f"{x:.3g}"


def column_labels(report: Report) -> list:
    """'backend dtype' for every pair that has results, in the order they were run."""
    labels = []
    for r in report.results:
        label = f"{r.case.backend} {r.case.dtype}"
        if label not in labels:
            labels.append(label)
    return labels


def build_cells(report: Report) -> dict:
    """(feature, 'backend dtype') -> Cell."""
    cells = {}
    for r in report.results:
        cells.setdefault((r.case.feature, f"{r.case.backend} {r.case.dtype}"), Cell([])).results.append(r)
    return cells


class _Footnotes:
    """Numbers each distinct unsupported reason, per backend."""

    def __init__(self):
        self.items = []

    def number(self, backend: str, reason: str) -> int:
        key = (backend, reason)
        if key not in self.items:
            self.items.append(key)
        return self.items.index(key) + 1


def _cell_text(cell: Cell, backend: str, notes: _Footnotes) -> str:
    if cell is None:
        return "-"
    counts = cell.counts
    marks = "".join(f"[{notes.number(backend, reason)}]" for reason in cell.reasons)
    if cell.status == NOT_RUN:
        return "not run"
    if cell.status == UNSUPPORTED:
        text = f"unsupported {marks}"
    else:
        run = counts[PASS] + counts[FAIL]
        if cell.status == FAIL:
            text = f"FAIL {counts[FAIL]}/{run} ratio {_ratio(cell.worst_ratio)}"
        else:
            text = f"pass {_ratio(cell.worst_ratio)}"
        if counts[UNSUPPORTED]:
            text += f" +{counts[UNSUPPORTED]} unsupported {marks}"
    if counts[NOT_RUN]:
        text += f" +{counts[NOT_RUN]} not run"
    return text


def table_rows(report: Report):
    """(header, rows, footnotes): rows are [feature, cell, cell, ...] strings."""
    labels = column_labels(report)
    cells = build_cells(report)
    notes = _Footnotes()
    rows = []
    for feature in COLUMNS:
        if not any((feature, label) in cells for label in labels):
            continue
        rows.append([feature] + [_cell_text(cells.get((feature, label)), label.split()[0], notes) for label in labels])
    footnotes = [f"[{i + 1}] {backend}: {reason}" for i, (backend, reason) in enumerate(notes.items)]
    return ["feature"] + labels, rows, footnotes


def _header_lines(report: Report) -> list:
    lines = [f"{name}: {value}" for name, value in report.environment.items()]
    return lines


def slowest(report: Report, count: int = 5) -> list:
    """The ``count`` results that took longest, longest first (cases that ran, or died, only)."""
    timed = [r for r in report.results if r.seconds > 0]
    return sorted(timed, key=lambda r: -r.seconds)[:count]


def _timing(report: Report) -> str:
    jobs = "" if report.jobs is None else f", {report.jobs} job{'s' if report.jobs != 1 else ''}"
    return f"{report.seconds:.0f} s wall time{jobs}"


def _case_seconds(report: Report) -> str:
    """How long the cases took, added up (more than the wall time when jobs ran at once)."""
    return f"the {len(report.results)} cases took {sum(r.seconds for r in report.results):.1f} s in all"


def _summary_line(report: Report) -> str:
    counts = {PASS: 0, FAIL: 0, UNSUPPORTED: 0, NOT_RUN: 0}
    for r in report.results:
        counts[r.status] += 1
    verdict = "FAILED" if not report.ok else ("INCOMPLETE" if counts[NOT_RUN] else "PASSED")
    not_run = f", {counts[NOT_RUN]} not run (time limit)" if counts[NOT_RUN] else ""
    return (f"{verdict}: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[UNSUPPORTED]} unsupported{not_run} "
            f"({report.mode}, {report.device}, {_timing(report)})")


def _clip(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def render_text(report: Report, max_failures: int = 30) -> str:
    """The report for a terminal: environment, notes, failures with reproduce commands, then the table
    and the verdict last (so the end of a captured log holds the table)."""
    out = ["", "mhattn conformance", *("  " + line for line in _header_lines(report))]
    if report.notes:
        out.append("")
        out += [f"note: {n}" for n in report.notes]
    slow = slowest(report)
    if slow:
        out.append("")
        out.append(f"slowest cases ({_timing(report)}; {_case_seconds(report)}):")
        for r in slow:
            out.append(f"  {r.seconds:8.2f} s  {r.case.backend} {r.case.feature} [{r.case.describe()}]")
            out.append(f"    reproduce: {r.case.command()}")
    failures = report.failures
    if failures:
        out.append("")
        out.append(f"failures ({len(failures)}):")
        for r in failures[:max_failures]:
            out.append(f"  {r.case.backend} {r.case.feature} [{r.case.describe()}]: {_clip(r.summary())}")
            out.append(f"    reproduce: {r.case.command()}")
        if len(failures) > max_failures:
            out.append(f"  ... {len(failures) - max_failures} more (write them all with --report FILE.md)")
    header, rows, footnotes = table_rows(report)
    if rows:
        widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
        out.append("")
        out.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
        out.append("  ".join("-" * w for w in widths))
        for row in rows:
            out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    if footnotes:
        out.append("")
        out += footnotes
    kernels = _kernel_lines(report)
    if kernels:
        out.append("")
        out += ["kernel families that ran the cases:"] + [f"  {line}" for line in kernels]
    for name, reasons in report.unavailable.items():
        out.append(f"{name}: not run: " + "; ".join(reasons))
    for x in report.extra:
        out.append(f"{x.name}: {x.status}" + (f" ({x.detail})" if x.detail else ""))
    out.append("")
    out.append(_summary_line(report))
    return "\n".join(out)


def kernel_counts(report: Report) -> dict:
    """backend -> {kernel family: number of cases run through it} over the cases that ran (pass or fail)."""
    counts: dict = {}
    for r in report.results:
        if r.status in (PASS, FAIL):
            for family in r.kernels:
                per_backend = counts.setdefault(r.case.backend, {})
                per_backend[family] = per_backend.get(family, 0) + 1
    return counts


def _kernel_lines(report: Report) -> list:
    return [f"{backend}: {family}: {count} cases" for backend, families in kernel_counts(report).items()
            for family, count in families.items()]


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(report: Report) -> str:
    out = ["# mhattn conformance", "", _summary_line(report), "", "## Machine", ""]
    out += [f"- {name}: {value}" for name, value in report.environment.items()]
    if report.notes:
        out += ["", "## What ran", ""] + [f"- {n}" for n in report.notes]
    header, rows, footnotes = table_rows(report)
    if rows:
        out += ["", "## Results", "", "Cells: worst error ratio err / bound of the cell's cases (<= 1 passes); "
                "FAIL n/m: n of the m cases run failed.", ""]
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "---|" * len(header))
        for row in rows:
            out.append("| " + " | ".join(_md_escape(c) for c in row) + " |")
    if footnotes:
        out += ["", "### Unsupported", ""] + [f"- {_md_escape(f)}" for f in footnotes]
    kernels = _kernel_lines(report)
    if kernels:
        out += ["", "### Kernel families", "", "Which of a backend's kernels ran the cases (as the backend names them from "
                "each case's problem):", ""] + [f"- {_md_escape(line)}" for line in kernels]
    if report.unavailable or report.extra:
        out += ["", "### Not run / other checks", ""]
        out += [f"- {name}: not run: {'; '.join(reasons)}" for name, reasons in report.unavailable.items()]
        out += [f"- {x.name}: {x.status}" + (f" ({x.detail})" if x.detail else "") for x in report.extra]
    out += ["", "### Features", ""] + [f"- {name}: {COLUMN_DESCRIPTIONS[name]}" for name in COLUMNS]
    slow = slowest(report)
    if slow:
        out += ["", "## Time", "", f"{_timing(report)}; {_case_seconds(report)}. The slowest:", ""]
        out += ["| seconds | backend | feature | case | reproduce |", "|---|---|---|---|---|"]
        out += [f"| {r.seconds:.2f} | {r.case.backend} | {r.case.feature} | {_md_escape(r.case.describe())} | "
                f"`{_md_escape(r.case.command())}` |" for r in slow]
    failures = report.failures
    if failures:
        out += ["", f"## Failures ({len(failures)})", ""]
        for r in failures:
            out.append(f"### {r.case.backend} {r.case.feature}: {r.case.describe()}")
            out.append("")
            out.append("```")
            out.append(r.case.command())
            out.append("```")
            for c in r.checks:
                out.append(f"- {c}")
            if r.error:
                out.append(f"- error: {r.error}")
            out.append("")
    return "\n".join(out) + "\n"


def to_json(report: Report) -> dict:
    header, rows, footnotes = table_rows(report)
    return {
        "ok": report.ok,
        "mode": report.mode,
        "device": report.device,
        "seconds": round(report.seconds, 2),
        "jobs": report.jobs,
        "environment": report.environment,
        "notes": report.notes,
        "unavailable": report.unavailable,
        "extra_checks": [x.__dict__ for x in report.extra],
        "table": {"header": header, "rows": rows, "footnotes": footnotes},
        "results": [r.to_dict() for r in report.results],
    }


def write_report(report: Report, path: str) -> None:
    """Markdown for *.md, JSON for *.json (anything else: Markdown)."""
    if path.lower().endswith(".json"):
        text = json.dumps(to_json(report), indent=1, allow_nan=False) + "\n"
    else:
        text = render_markdown(report)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def read_json_report(path: str) -> Report:
    """A :class:`Report` back from a file written by ``--report FILE.json``."""
    with open(path, "r", encoding="utf-8") as f:
        data = json.load(f)
    return Report(
        mode=data["mode"], device=data["device"], environment=dict(data.get("environment", {})),
        results=[CaseResult.from_dict(d) for d in data.get("results", [])],
        unavailable=dict(data.get("unavailable", {})), notes=list(data.get("notes", [])),
        extra=[ExtraCheck(**x) for x in data.get("extra_checks", [])], seconds=float(data.get("seconds", 0.0)),
        jobs=data.get("jobs"),  # absent from reports written before --jobs
    )


def merge_reports(reports: list) -> Report:
    """One report from several runs: results in order (a case run twice keeps its last result), the first
    run's environment (a note names any run on another device), unavailable backends that no run ran."""
    by_case = {}
    for report in reports:
        for r in report.results:
            by_case[(r.case.backend, r.case.spec())] = r
    first = reports[0]
    notes = []
    for report in reports:
        for note in report.notes:
            if note not in notes:
                notes.append(note)
        if report.environment.get("device") != first.environment.get("device"):
            notes.append(f"merged from runs on different devices: also {report.environment.get('device')}")
    ran = {backend for backend, _ in by_case}
    unavailable = {}
    for report in reports:
        for name, reasons in report.unavailable.items():
            if name not in ran:
                unavailable[name] = reasons
    extra = {}
    for report in reports:
        for x in report.extra:
            extra[x.name] = x
    modes = sorted({report.mode for report in reports})
    jobs = {report.jobs for report in reports}
    return Report(mode="+".join(modes), device=first.device, environment=first.environment,
                  results=list(by_case.values()), unavailable=unavailable, notes=notes, extra=list(extra.values()),
                  seconds=sum(report.seconds for report in reports), jobs=jobs.pop() if len(jobs) == 1 else None)
