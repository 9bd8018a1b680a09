"""Results as text tables, Markdown and JSON: the sweep with ratio columns, memory, module, the targets.

A run's document is ``{"format": FORMAT, "meta": {...}, "rows": [...], "memory": [...], "module": [...]}``
where ``rows`` are attention cells in the field names of h100_peers.json (impl, dtype, d, h, b, n,
causal, fwd_tflops, bwd_tflops, fwd_bwd_tflops) plus times, per-mode status and the output check.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict

from mhattn.benchmark import protocol
from mhattn.benchmark.timing import SUSPECT_DIFF

FORMAT = "mhattn-bench/1"

# PERFORMANCE.md's targets: (backend, mode) -> (required, stretch, head dims) as ratios to sdpa-cudnn (the
# kernel torch's SDPA runs by default on Hopper), over bf16 cells with N >= 1k, causal or not.
SPEED_TARGET_PEER = "sdpa-cudnn"
SPEED_TARGETS = {
    ("triton", "fwd"): (1.0, 1.1, (64, 128, 256)),
    ("triton", "bwd"): (1.0, 1.1, (64, 128, 256)),
    ("cupy", "fwd"): (0.9, 1.0, (64, 128)),
    ("cupy", "bwd"): (0.8, 1.0, (64, 128)),
}
TARGET_HEAD_DIMS = (64, 128)  # the head dims of a backend without a target of its own
TARGET_MIN_SEQLEN = 1024
MEMORY_TARGET = (1.2, 1.0)          # peak at the largest N (32k) relative to sdpa-flash: required, stretch
REFERENCE_SPEEDUP = (9.0, 4096, 64)  # fwd+bwd at least 9x faster than the reference at N=4k, d=64


# ---- the document -----------------------------------------------------------------------------------------


def make_document(meta: dict, results: list) -> dict:
    return {
        "format": FORMAT,
        "meta": meta,
        "rows": [r for r in results if r.get("kind") == "attn"],
        "memory": [r for r in results if r.get("kind") == "memory"],
        "module": [r for r in results if r.get("kind") == "module"],
    }


def write_json(path, document: dict) -> None:
    from mhattn.benchmark.worker import clean_for_json

    text = json.dumps(clean_for_json(document), indent=1, allow_nan=False)
    with open(path, "w") as f:
        f.write(text + "\n")


def read_json(path) -> dict:
    with open(path) as f:
        document = json.load(f)
    if document.get("format") != FORMAT:
        raise ValueError(f"{path}: expected a '{FORMAT}' document written by mhattn bench, got format "
                         f"{document.get('format')!r}")
    return document


# ---- small helpers ------------------------------------------------------------------------------------------


def short_dtype(name: str) -> str:
    return protocol.canonical_dtype(name)


def seqlen_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def peer_label(name: str) -> str:
    return name[len("sdpa-"):] if name.startswith("sdpa-") else name


def impl_order(rows: list) -> list:
    """Implementations in the order they first appear (the run's display order)."""
    return list(OrderedDict.fromkeys(r["impl"] for r in rows if "impl" in r))


def subjects(rows: list) -> list:
    """The mhattn backends other than the reference: the columns the ratios are given for."""
    seen = OrderedDict()
    for r in rows:
        if r.get("family") == "mhattn" and not r.get("is_reference"):
            seen[r["impl"]] = True
    return list(seen)


def status_code(status) -> str:
    """The short table entry of a status string."""
    if status is None:
        return "-"
    if status == "ok":
        return ""
    head = status.split(":", 1)[0].strip()
    return {"n/a": "n/a", "OOM": "OOM", "error": "err"}.get(head, "-")


def suspect(row: dict) -> bool:
    diff = row.get("max_abs_diff")
    return diff == "non-finite" or (isinstance(diff, (int, float)) and diff > SUSPECT_DIFF)


def cell_value(row, mode):
    """(TFLOP/s or None, status string) of ``row`` for ``mode``."""
    if row is None:
        return None, None
    status = (row.get("status") or {}).get(mode)
    return row.get(f"{mode}_tflops"), status


def format_cell(row, mode) -> str:
    value, status = cell_value(row, mode)
    if value is None:
        return status_code(status) or "-"
    return format_number(value) + ("!" if suspect(row) else "")


def format_number(value: float) -> str:
    """One decimal from 10 up (284.2), three significant digits below (3.27, 0.0412)."""
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def ratio(a, b):
    if a is None or b is None or not b > 0:
        return None
    return a / b


def format_ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def geomean(values):
    values = [v for v in values if v is not None and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _table(header: list, body: list, align_left=0) -> list:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *body)] if body else [len(h) for h in header]
    lines = []
    for cells in [header] + body:
        parts = []
        for i, (cell, width) in enumerate(zip(cells, widths)):
            parts.append(str(cell).ljust(width) if i < align_left else str(cell).rjust(width))
        lines.append("  ".join(parts).rstrip())
    return lines


def _index(rows):
    """(dtype, d, causal, n, impl) -> row."""
    return {(short_dtype(r["dtype"]), r["d"], bool(r["causal"]), r["n"], r["impl"]): r for r in rows}


def _shapes(rows, dtype):
    keys = OrderedDict()
    for r in rows:
        if short_dtype(r["dtype"]) == dtype:
            keys[(r["d"], bool(r["causal"]), r["n"])] = (r["b"], r["h"])
    return sorted(keys.items(), key=lambda item: (item[0][0], item[0][1], item[0][2]))


def _modes(rows):
    present = set()
    for r in rows:
        present.update((r.get("status") or {}).keys())
    return [m for m in protocol.MODES if m in present]


def describe_timing(meta: dict) -> str:
    timing = meta.get("timing", {})
    parts = [meta.get("timer", "do_bench median")]
    if "warmup_ms" in timing and "rep_ms" in timing:
        parts.append(f"warmup {timing['warmup_ms']:g} ms, rep {timing['rep_ms']:g} ms")
    if meta.get("bwd_method_text"):
        parts.append(meta["bwd_method_text"])
    return "; ".join(parts)


# ---- the sweep ------------------------------------------------------------------------------------------------


def sweep_tables(document: dict) -> str:
    """One table per (dtype, mode): TFLOP/s of every implementation by (d, causal, N), then for each mhattn
    backend its ratio to sdpa-flash and to sdpa-cudnn."""
    rows = document.get("rows", [])
    if not rows:
        return ""
    meta = document.get("meta", {})
    impls = impl_order(rows)
    subject_names = subjects(rows)
    peers = [p for p in protocol.RATIO_PEERS if p in impls]
    index = _index(rows)
    out = []
    dtypes = list(OrderedDict.fromkeys(short_dtype(r["dtype"]) for r in rows))
    for dtype in dtypes:
        for mode in _modes(rows):
            header = ["d", "causal", "N"] + impls
            ratio_columns = [(s, p) for s in subject_names for p in peers]
            if ratio_columns:
                header += ["|"] + [f"{s}/{peer_label(p)}" for s, p in ratio_columns]
            body = []
            for (d, causal, n), _ in _shapes(rows, dtype):
                line = [str(d), "yes" if causal else "no", seqlen_label(n)]
                line += [format_cell(index.get((dtype, d, causal, n, impl)), mode) for impl in impls]
                if ratio_columns:
                    line.append("|")
                    for s, p in ratio_columns:
                        a = cell_value(index.get((dtype, d, causal, n, s)), mode)[0]
                        b = cell_value(index.get((dtype, d, causal, n, p)), mode)[0]
                        line.append(format_ratio(ratio(a, b)))
                body.append(line)
            out.append(f"{dtype} {protocol.MODE_LABELS[mode]}, TFLOP/s (B*N = {meta.get('tokens', protocol.TOKENS)}, "
                       f"H = {protocol.HIDDEN}/d; {describe_timing(meta)})")
            out += _table(header, body)
            out.append("")
    legend = ("n/a = cannot run this shape, OOM = out of memory, err = failed, - = not run; "
              f"! = forward output differs from torch SDPA by more than {SUSPECT_DIFF} (max abs)")
    out.append(legend)
    notes = failure_notes(rows)
    if notes:
        out.append("")
        out.append("why cells are empty:")
        out += ["  " + n for n in notes]
    return "\n".join(out).rstrip() + "\n"


def _compact_values(values, fmt=str) -> str:
    values = sorted(set(values))
    return ",".join(fmt(v) for v in values)


def failure_notes(rows: list, *, width: int = 400) -> list:
    """One line per (implementation, reason): where the cells of ``rows`` did not give a number, and why."""
    groups = OrderedDict()
    for r in rows:
        statuses = r.get("status")
        statuses = statuses.items() if isinstance(statuses, dict) else [("", statuses)]
        for mode, status in statuses:
            if not status or status == "ok":
                continue
            entry = groups.setdefault((r.get("impl", r.get("variant")), status), {"d": set(), "n": set(), "c": set(),
                                                                                  "m": set(), "t": set()})
            entry["d"].add(r.get("d"))
            entry["n"].add(r.get("n"))
            entry["c"].add(bool(r.get("causal")))
            entry["m"].add(mode)
            entry["t"].add(short_dtype(r["dtype"]) if r.get("dtype") else "")
    notes = []
    for (impl, status), where in groups.items():
        parts = []
        if any(where["t"]):
            parts.append(_compact_values(t for t in where["t"] if t))
        if any(d is not None for d in where["d"]):
            parts.append("d=" + _compact_values(d for d in where["d"] if d is not None))
        if any(n is not None for n in where["n"]):
            parts.append("N=" + _compact_values((n for n in where["n"] if n is not None), seqlen_label))
        if len(where["c"]) == 1 and rows and "causal" in rows[0]:
            parts.append("causal" if True in where["c"] else "non-causal")
        modes = [m for m in where["m"] if m]
        if modes:
            parts.append("/".join(m for m in protocol.MODES if m in modes))
        text = " ".join(status.split())
        if len(text) > width:
            text = text[: width - 3] + "..."
        notes.append(f"{impl} [{' '.join(parts)}]: {text}")
    return notes


# ---- PERFORMANCE.md-style compact table ----------------------------------------------------------------------


def compact_rows(document: dict, dtype: str = "bf16"):
    """(header, body) with one row per (d, N, causal) and each implementation's 'fwd / bwd' TFLOP/s."""
    rows = [r for r in document.get("rows", []) if short_dtype(r["dtype"]) == dtype]
    impls = impl_order(rows)
    index = _index(rows)
    ratio_columns = [s for s in subjects(rows) if "sdpa-flash" in impls]
    header = ["d", "N", "causal"] + impls + [f"{s}/flash" for s in ratio_columns]
    body = []
    for (d, causal, n), _ in _shapes(rows, dtype):
        line = [str(d), seqlen_label(n), "yes" if causal else "no"]
        for impl in impls:
            row = index.get((dtype, d, causal, n, impl))
            line.append(_pair(format_cell(row, "fwd"), format_cell(row, "bwd")))
        flash = index.get((dtype, d, causal, n, "sdpa-flash"))
        for s in ratio_columns:
            mine = index.get((dtype, d, causal, n, s))
            line.append(_pair(*(format_ratio(ratio(cell_value(mine, m)[0], cell_value(flash, m)[0]))
                                 for m in ("fwd", "bwd"))))
        body.append(line)
    return header, body


def _pair(forward: str, backward: str) -> str:
    """'fwd / bwd', or one entry when both say the same thing without a number (n/a, OOM, -)."""
    if forward == backward and not forward[:1].isdigit():
        return forward
    return f"{forward} / {backward}"


def compact_table(document: dict, dtype: str = "bf16") -> str:
    header, body = compact_rows(document, dtype)
    if not body:
        return ""
    return "\n".join([f"{dtype} TFLOP/s, forward / backward (ratios: to sdpa-flash, forward / backward)"]
                     + _table(header, body)) + "\n"


# ---- targets ----------------------------------------------------------------------------------------------------


def _verdict(worst, required, stretch):
    if worst is None:
        return "no data"
    if stretch is not None and worst >= stretch:
        return "meets stretch"
    return "meets" if worst >= required else "misses"


def target_lines(document: dict) -> list:
    """Each mhattn backend against PERFORMANCE.md's targets, from the bf16 cells of this run."""
    rows = [r for r in document.get("rows", []) if short_dtype(r["dtype"]) == "bf16"]
    index = _index(rows)
    header = ["backend", "mode", "cells", "min vs cudnn", "at", "geomean vs cudnn", "geomean vs flash", "target",
              "verdict"]
    body = []
    for subject in subjects(rows):
        for mode in ("fwd", "bwd", "fwd_bwd"):
            target = SPEED_TARGETS.get((subject, mode))
            if mode == "fwd_bwd" and target is None:
                continue
            head_dims = target[2] if target else TARGET_HEAD_DIMS
            to_cudnn, to_flash, expected = [], [], 0
            for (d, causal, n), _ in _shapes(rows, "bf16"):
                if d not in head_dims or n < TARGET_MIN_SEQLEN:
                    continue
                expected += 1
                mine = cell_value(index.get(("bf16", d, causal, n, subject)), mode)[0]
                flash = cell_value(index.get(("bf16", d, causal, n, "sdpa-flash")), mode)[0]
                cudnn = cell_value(index.get(("bf16", d, causal, n, SPEED_TARGET_PEER)), mode)[0]
                where = f"d={d} N={seqlen_label(n)}{' causal' if causal else ''}"
                to_cudnn.append((ratio(mine, cudnn), where))
                to_flash.append(ratio(mine, flash))
            if expected == 0:
                continue
            measured = [(r, w) for r, w in to_cudnn if r is not None]
            worst = min(measured) if measured else (None, "")
            required, stretch = (target[0], target[1]) if target else (None, None)
            verdict = "-" if target is None else _verdict(worst[0], required, stretch)
            if target is not None and measured and len(measured) < expected and verdict != "misses":
                verdict += f" (only {len(measured)} of {expected} cells)"
            body.append([subject, mode, f"{len(measured)}/{expected}", format_ratio(worst[0]), worst[1],
                         format_ratio(geomean(r for r, _ in to_cudnn)), format_ratio(geomean(to_flash)),
                         "-" if target is None else f">= {required:g}x (stretch {stretch:g}x)", verdict])
    lines = []
    if body:
        lines.append(f"speed vs PERFORMANCE.md (bf16, N >= {seqlen_label(TARGET_MIN_SEQLEN)}, causal and not; "
                     f"ratios to {SPEED_TARGET_PEER}; triton d in 64/128/256, cupy d in 64/128)")
        lines += _table(header, body, align_left=2)
    lines += _memory_target_lines(document)
    lines += _reference_target_lines(document)
    return lines


def _memory_target_lines(document):
    rows = [r for r in document.get("memory", []) if r.get("status") == "ok"]
    if not rows:
        return []
    flash = {r["n"]: r["peak_extra_bytes"] for r in rows if r["impl"] == "sdpa-flash"}
    if not flash:
        return []
    largest = max(flash)
    required, stretch = MEMORY_TARGET
    lines = [f"memory vs PERFORMANCE.md (fwd+bwd peak extra at N={seqlen_label(largest)}, relative to sdpa-flash; "
             f"required <= {required:g}x)"]
    for subject in subjects(document.get("memory", [])):
        mine = next((r["peak_extra_bytes"] for r in rows if r["impl"] == subject and r["n"] == largest), None)
        value = ratio(mine, flash[largest])
        if value is None:
            verdict = "no data"
        else:
            verdict = "meets stretch" if value <= stretch else ("meets" if value <= required else "misses")
        lines.append(f"  {subject:<10} {format_ratio(value):>7}  {verdict}")
    return lines


def _reference_target_lines(document):
    need, n, d = REFERENCE_SPEEDUP
    rows = [r for r in document.get("rows", []) if short_dtype(r["dtype"]) == "bf16" and r["n"] == n and r["d"] == d]
    reference = {bool(r["causal"]): r for r in rows if r.get("is_reference")}
    if not reference:
        return []
    lines = [f"speed-up over the naive reference (bf16 fwd+bwd, N={seqlen_label(n)}, d={d}; required >= {need:g}x)"]
    for subject in subjects(rows):
        parts = []
        for causal in sorted(reference):
            mine = next((r for r in rows if r["impl"] == subject and bool(r["causal"]) == causal), None)
            value = ratio(cell_value(mine, "fwd_bwd")[0], cell_value(reference[causal], "fwd_bwd")[0])
            verdict = "no data" if value is None else ("meets" if value >= need else "misses")
            parts.append(f"{'causal' if causal else 'non-causal'} {format_ratio(value)} {verdict}")
        lines.append(f"  {subject:<10} " + "; ".join(parts))
    return lines


# ---- memory and module ------------------------------------------------------------------------------------------


def memory_table(document: dict) -> str:
    rows = document.get("memory", [])
    if not rows:
        return ""
    impls = impl_order(rows)
    subject_names = subjects(rows)
    by_key = {(r["impl"], r["n"]): r for r in rows}
    first = rows[0]
    header = ["N"] + impls
    if "sdpa-flash" in impls and subject_names:
        header += ["|"] + [f"{s}/flash" for s in subject_names]
    body = []
    for n in sorted({r["n"] for r in rows}):
        line = [seqlen_label(n)]
        for impl in impls:
            r = by_key.get((impl, n))
            if r is not None and r.get("status") == "ok":
                line.append(f"{r['peak_extra_bytes'] / 2**20:.0f}")
            else:
                line.append(status_code(r.get("status") if r else None) or "-")
        if len(header) > len(impls) + 1:
            line.append("|")
            flash = by_key.get(("sdpa-flash", n), {}).get("peak_extra_bytes")
            for s in subject_names:
                line.append(format_ratio(ratio(by_key.get((s, n), {}).get("peak_extra_bytes"), flash)))
        body.append(line)
    title = (f"peak extra memory of one forward+backward, MiB ({short_dtype(first['dtype'])}, "
             f"{'causal' if first['causal'] else 'non-causal'}, B={first['b']}, H={first['h']}, d={first['d']}; "
             "out, lse, dq, dk, dv and scratch, over the inputs)")
    lines = [title] + _table(header, body)
    notes = [n for n in failure_notes(rows) if "not tried" not in n]
    if notes:
        lines.append("why cells are empty:")
        lines += ["  " + n for n in notes]
    return "\n".join(lines) + "\n"


def module_table(document: dict) -> str:
    rows = document.get("module", [])
    if not rows:
        return ""
    first = rows[0]
    torch_rows = {r["n"]: r for r in rows if r["variant"] == "torch" and r.get("status") == "ok"}
    header = ["N", "batch", "attention module", "ms/step", "tokens/s", "peak GiB", "speed vs torch", "memory vs torch"]
    body = []
    for r in sorted(rows, key=lambda r: r["n"]):
        base = torch_rows.get(r["n"])
        if r.get("status") == "ok":
            body.append([seqlen_label(r["n"]), str(r["batch"]), _variant_label(r["variant"]), f"{r['step_ms']:.1f}",
                         f"{r['tokens_per_s']:,.0f}",
                         "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**30:.2f}",
                         format_ratio(ratio(r["tokens_per_s"], base and base["tokens_per_s"])),
                         format_ratio(ratio(r.get("peak_bytes"), base and base.get("peak_bytes")))])
        else:
            body.append([seqlen_label(r["n"]), str(r["batch"]), _variant_label(r["variant"]),
                         status_code(r.get("status")) or "-", "", "", "", ""])
    title = (f"training step of a {first['layers']}-layer encoder (d_model {first['d_model']}, {first['heads']} heads, "
             f"{first.get('precision', 'bf16 autocast')}, {first['batch'] * first['n']} tokens/step)")
    lines = [title] + _table(header, body, align_left=3)
    notes = failure_notes([{**r, "impl": _variant_label(r["variant"])} for r in rows])
    if notes:
        lines.append("why cells are empty:")
        lines += ["  " + n for n in notes]
    return "\n".join(lines) + "\n"


def _variant_label(variant: str) -> str:
    if variant == "torch":
        return "torch.nn.MultiheadAttention"
    if variant.startswith("mhattn:"):
        return f"mhattn.MultiheadAttention[{variant.split(':', 1)[1]}]"
    return "mhattn.MultiheadAttention[auto]"


# ---- everything --------------------------------------------------------------------------------------------------


def header_text(meta: dict) -> str:
    lines = [f"mhattn bench  {meta.get('date', '')}"]
    if meta.get("device"):
        lines.append(f"device: {meta['device']}")
    if meta.get("versions"):
        lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()))
    if meta.get("full_command") or meta.get("command"):
        lines.append(f"command: {meta.get('full_command') or meta['command']}")
    if meta.get("protocol"):
        lines.append(f"protocol: {meta['protocol']}")
    if meta.get("timing_note"):
        lines.append(f"timing: {meta['timing_note']}")
    return "\n".join(lines) + "\n"


def full_report(document: dict) -> str:
    """Everything a run printed: header, sweep tables, memory, module, targets."""
    parts = [header_text(document.get("meta", {})), sweep_tables(document), memory_table(document),
             module_table(document)]
    targets = target_lines(document)
    if targets:
        parts.append("\n".join(targets) + "\n")
    return "\n".join(p for p in parts if p)


def summary_report(document: dict) -> str:
    """The short table printed last: the bf16 forward / backward table, the targets, memory and module."""
    parts = []
    for dtype in OrderedDict.fromkeys(short_dtype(r["dtype"]) for r in document.get("rows", [])):
        parts.append(compact_table(document, dtype))
    targets = target_lines(document)
    if targets:
        parts.append("\n".join(targets) + "\n")
    parts.append(memory_table(document))
    parts.append(module_table(document))
    return "\n".join(p for p in parts if p)


# ---- Markdown ---------------------------------------------------------------------------------------------------


def _markdown_table(header, body) -> list:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in line) + " |" for line in body]
    return lines


def markdown_report(document: dict, plots=()) -> str:
    """A Markdown section for the README or a notes file: date, device, command, plots and tables."""
    meta = document.get("meta", {})
    versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())
    lines = [f"Measured {meta.get('date', '?')} on {meta.get('device', '?')}" + (f" ({versions})" if versions else "")
             + ".", ""]
    if meta.get("command"):
        lines += ["```bash", meta["command"], "```", ""]
    if meta.get("protocol"):
        lines += [f"Protocol: {meta['protocol']}. Timing: {describe_timing(meta)}.", ""]
    for plot in plots:
        lines += [f"![{plot}]({plot})", ""]
    for dtype in OrderedDict.fromkeys(short_dtype(r["dtype"]) for r in document.get("rows", [])):
        header, body = compact_rows(document, dtype)
        lines += [f"{dtype}, TFLOP/s, forward / backward:", ""] + _markdown_table(header, body) + [""]
    targets = target_lines(document)
    if targets:
        lines += ["```text"] + targets + ["```", ""]
    for section in (memory_table(document), module_table(document)):
        if section:
            lines += ["```text", section.rstrip(), "```", ""]
    return "\n".join(lines)
