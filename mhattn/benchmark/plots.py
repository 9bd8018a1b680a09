"""PNG plots in the style of the FlashAttention-2 paper's figures (matplotlib, imported only here).

``plot_sweep``: one figure per dtype; a panel per (mode, head dim, causal), x = sequence length, grouped
bars of TFLOP/s, one bar per implementation, its value written above it. ``plot_memory_module``: peak
extra memory against N (log-log) and, when the module benchmark ran, its tokens/s and peak memory.
Each function returns the path it wrote, or raises :class:`PlotUnavailable` when matplotlib is missing.
"""

from __future__ import annotations

from collections import OrderedDict

from mhattn.benchmark import protocol
from mhattn.benchmark.report import (cell_value, impl_order, seqlen_label, short_dtype, status_code, suspect)

# One colour per implementation, stable across figures (the first in the run's order gets the first colour).
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")


class PlotUnavailable(RuntimeError):
    """matplotlib cannot be imported here."""


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as error:
        raise PlotUnavailable(f"matplotlib is not available ({type(error).__name__}: {error}); "
                              "install it with pip install 'mhattn[bench]'") from None
    return plt


def colours(names) -> dict:
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def _grouped_bars(ax, groups, series, values, labels_of, colour_of, *, annotate=True, fontsize=5):
    """Bars: for each group (x position) one bar per series; values[(group, series)] = height or None,
    labels_of[(group, series)] = the text written where there is no bar."""
    count = max(1, len(series))
    width = 0.84 / count
    top = max([v for v in values.values() if v is not None] or [1.0])
    for j, name in enumerate(series):
        xs, heights = [], []
        for i, group in enumerate(groups):
            xs.append(i - 0.42 + width * (j + 0.5))
            value = values.get((group, name))
            heights.append(value if value is not None else 0.0)
        bars = ax.bar(xs, heights, width=width * 0.95, color=colour_of[name], label=name)
        if not annotate:
            continue
        for x, group, bar in zip(xs, groups, bars):
            value = values.get((group, name))
            if value is None:
                text = labels_of.get((group, name), "")
            else:
                text = f"{value:.0f}" if top >= 50 else f"{value:.1f}"
            if not text:
                continue
            y = (value if value is not None else 0.0) + top * 0.01
            ax.text(x, y, text, ha="center", va="bottom", rotation=90, fontsize=fontsize,
                    color="black" if value is not None else "#888888")
    ax.set_xticks(range(len(groups)))
    ax.set_ylim(0, top * 1.22)


def plot_sweep(document: dict, path: str, dtype: str = "bf16", modes=None) -> str:
    """One PNG for ``dtype``: rows = modes, columns = (head dim, causal); grouped bars per implementation."""
    plt = _pyplot()
    rows = [r for r in document.get("rows", []) if short_dtype(r["dtype"]) == dtype]
    if not rows:
        raise ValueError(f"no attention rows for dtype {dtype}")
    impls = impl_order(document.get("rows", []))
    colour_of = colours(impls)
    present_modes = set()
    for r in rows:
        present_modes.update((r.get("status") or {}).keys())
    modes = [m for m in (modes or protocol.MODES) if m in present_modes]
    panels = sorted({(r["d"], bool(r["causal"])) for r in rows})
    seqlens = sorted({r["n"] for r in rows})
    index = {(r["d"], bool(r["causal"]), r["n"], r["impl"]): r for r in rows}
    shown = [i for i in impls if any(r["impl"] == i for r in rows)]

    figure, axes = plt.subplots(len(modes), len(panels), figsize=(max(4.0, 3.9 * len(panels)), 3.1 * len(modes) + 0.8),
                                squeeze=False)
    for row_index, mode in enumerate(modes):
        for col_index, (d, causal) in enumerate(panels):
            ax = axes[row_index][col_index]
            values, labels = {}, {}
            for n in seqlens:
                for impl in shown:
                    row = index.get((d, causal, n, impl))
                    value, status = cell_value(row, mode)
                    values[(n, impl)] = value
                    labels[(n, impl)] = status_code(status) if value is None else ""
                    if value is not None and row is not None and suspect(row):
                        labels[(n, impl)] = "!"
            _grouped_bars(ax, seqlens, shown, values, labels, colour_of, fontsize=4.5 if len(shown) > 4 else 6)
            ax.set_xticklabels([seqlen_label(n) for n in seqlens], fontsize=7)
            ax.tick_params(axis="y", labelsize=7)
            ax.set_title(f"{protocol.MODE_LABELS[mode]}, head dim {d}, {'causal' if causal else 'non-causal'}",
                         fontsize=8)
            ax.grid(axis="y", alpha=0.3)
            if col_index == 0:
                ax.set_ylabel("TFLOP/s", fontsize=8)
            if row_index == len(modes) - 1:
                ax.set_xlabel("sequence length", fontsize=8)
    meta = document.get("meta", {})
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour_of[i]) for i in shown]
    figure.legend(handles, shown, loc="upper center", ncol=len(shown), fontsize=8, frameon=False,
                  bbox_to_anchor=(0.5, 0.995))
    figure.suptitle(f"attention {dtype} on {meta.get('device', '?')} ({meta.get('date', '')[:10]}): "
                    f"B*N = {meta.get('tokens', protocol.TOKENS)}, H = {protocol.HIDDEN}/d",
                    fontsize=9, y=0.97)
    figure.tight_layout(rect=(0, 0, 1, 0.955))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_memory_module(document: dict, path: str) -> str:
    """One PNG: peak extra memory against N (log-log), and the module benchmark's tokens/s and peak memory."""
    plt = _pyplot()
    memory_rows = document.get("memory", [])
    module_rows = document.get("module", [])
    if not memory_rows and not module_rows:
        raise ValueError("no memory or module rows to plot")
    panels = (1 if memory_rows else 0) + (2 if module_rows else 0)
    figure, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.0), squeeze=False)
    axes = list(axes[0])
    if memory_rows:
        ax = axes.pop(0)
        impls = impl_order(memory_rows)
        colour_of = colours(impl_order(document.get("rows", [])) + [i for i in impls if i not in
                                                                    impl_order(document.get("rows", []))])
        for impl in impls:
            points = sorted((r["n"], r["peak_extra_bytes"] / 2**20) for r in memory_rows
                            if r["impl"] == impl and r.get("status") == "ok" and r.get("peak_extra_bytes"))
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl, color=colour_of[impl])
            failed = sorted(r["n"] for r in memory_rows if r["impl"] == impl and r.get("status") != "ok"
                            and str(r.get("status", "")).startswith("OOM"))
            if failed and points:
                ax.annotate("OOM", (points[-1][0], points[-1][1]), textcoords="offset points", xytext=(4, 4),
                            fontsize=7, color=colour_of[impl])
        first = memory_rows[0]
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        seqlens = sorted({r["n"] for r in memory_rows})
        ax.set_xticks(seqlens)
        ax.set_xticklabels([seqlen_label(n) for n in seqlens])
        ax.set_xlabel("sequence length")
        ax.set_ylabel("peak extra memory, MiB")
        ax.set_title(f"forward+backward, {'causal' if first['causal'] else 'non-causal'}, B={first['b']}, "
                     f"H={first['h']}, d={first['d']}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no measurement", ha="center", va="center", transform=ax.transAxes)
    if module_rows:
        variants = list(OrderedDict.fromkeys(r["variant"] for r in module_rows))
        colour_of = colours(variants)
        seqlens = sorted({r["n"] for r in module_rows})
        index = {(r["n"], r["variant"]): r for r in module_rows}
        for ax, key, scale, ylabel in ((axes[0], "tokens_per_s", 1e3, "thousand tokens/s"),
                                       (axes[1], "peak_bytes", 2**30, "peak memory, GiB")):
            values, labels = {}, {}
            for n in seqlens:
                for variant in variants:
                    row = index.get((n, variant))
                    ok = row is not None and row.get("status") == "ok" and row.get(key) is not None
                    values[(n, variant)] = row[key] / scale if ok else None
                    labels[(n, variant)] = "" if ok else status_code(row.get("status") if row else None)
            _grouped_bars(ax, seqlens, variants, values, labels, colour_of, fontsize=6)
            ax.set_xticklabels([seqlen_label(n) for n in seqlens])
            ax.set_xlabel("sequence length")
            ax.set_ylabel(ylabel)
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=7)
        first = module_rows[0]
        axes[0].set_title(f"training step, {first['layers']}-layer encoder, d_model {first['d_model']}, "
                          f"{first['heads']} heads", fontsize=9)
        axes[1].set_title("peak memory of the training step", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
