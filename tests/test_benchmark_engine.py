"""The benchmark engine behind `mhattn bench`, on the CPU: FLOP counts, shapes, timing bookkeeping,
error entries, tables, JSON, plots, the CLI, the worker process and its supervisor."""

import io
import json
import os
import time

import pytest
import torch

from mhattn import cli as mhattn_cli
from mhattn.benchmark import cli as bench_cli
from mhattn.benchmark import memory, module_bench, plan, protocol, report, supervisor, timing, worker
from mhattn.progress import Progress

# ---- protocol ------------------------------------------------------------------------------------------------


def test_forward_flops_is_two_matmuls_halved_when_causal():
    assert protocol.forward_flops(2, 3, 5, 7, causal=False) == 4 * 2 * 3 * 5 * 5 * 7
    assert protocol.forward_flops(2, 3, 5, 7, causal=True) == 2 * 2 * 3 * 5 * 5 * 7


def test_mode_flops_follow_the_paper():
    shape = protocol.protocol_shape("bf16", 64, 1024, causal=False)
    fwd = protocol.flops(shape, "fwd")
    assert fwd == 4 * 16 * 32 * 1024 * 1024 * 64
    assert protocol.flops(shape, "bwd") == 2.5 * fwd
    assert protocol.flops(shape, "fwd_bwd") == 3.5 * fwd
    with pytest.raises(ValueError, match="mode"):
        protocol.flops(shape, "sideways")


def test_tflops_from_milliseconds():
    assert protocol.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert protocol.tflops(1e12, 0.0) is None
    assert protocol.tflops(1e12, None) is None


@pytest.mark.parametrize("head_dim", protocol.HEAD_DIMS)
@pytest.mark.parametrize("seqlen", protocol.SEQLENS)
def test_protocol_shapes_keep_tokens_and_hidden_size(head_dim, seqlen):
    shape = protocol.protocol_shape("bfloat16", head_dim, seqlen, causal=True)
    assert shape.batch * shape.seqlen == protocol.TOKENS
    assert shape.heads * shape.head_dim == protocol.HIDDEN
    assert shape.dtype == "bf16" and shape.torch_dtype == torch.bfloat16


def test_dtype_names():
    assert protocol.canonical_dtype("float16") == "fp16"
    assert protocol.canonical_dtype("torch.bfloat16") == "bf16"
    with pytest.raises(ValueError, match="dtype"):
        protocol.canonical_dtype("int8")


def test_inputs_are_fixed_by_the_shape():
    shape = protocol.Shape("fp32", 1, 2, 8, 4, False)
    first = protocol.make_inputs(shape, "cpu")
    second = protocol.make_inputs(shape, "cpu")
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    q, k, v, dout = first
    assert q.shape == (1, 2, 8, 4) and q.requires_grad and not dout.requires_grad
    assert not torch.equal(q, k)


def test_implementation_table_order_and_defaults():
    table = protocol.implementations()
    names = list(table)
    assert names[-1] == "reference" and table["reference"].is_reference
    for peer in ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math"):
        assert table[peer].family == "sdpa"
    defaults = protocol.default_implementation_names(table)
    assert "sdpa-math" not in defaults and "reference" in defaults and "sdpa-flash" in defaults
    assert "sdpa" in defaults and "sdpa.cudnn" in table and "sdpa.cudnn" not in defaults  # variants on request
    from mhattn import registry

    for name in registry.names():
        assert table[name].family == "mhattn"


def test_reference_scratch_estimate_is_quadratic():
    reference = protocol.implementations()["reference"]
    small = reference.scratch_bytes(protocol.Shape("bf16", 1, 16, 1024, 128, True), "fwd_bwd")
    large = reference.scratch_bytes(protocol.Shape("bf16", 1, 16, 4096, 128, True), "fwd_bwd")
    assert large == 16 * small > 0
    assert protocol.implementations()["sdpa-flash"].scratch_bytes(protocol.Shape("bf16", 1, 16, 4096, 128, True),
                                                                  "fwd_bwd") == 0


# ---- timing ------------------------------------------------------------------------------------------------------


FAST = timing.TimingSettings(warmup_ms=0.5, rep_ms=1.0)
TINY = protocol.Shape("fp32", 1, 2, 16, 8, True)


def _time(impl, shape=TINY, modes=("fwd", "bwd", "fwd_bwd"), settings=FAST, check=None):
    inputs = protocol.make_inputs(shape, "cpu")
    return timing.time_attention(impl, shape, inputs, modes, settings, "cpu", check=check)


def test_time_attention_reports_every_mode_and_derives_the_backward():
    row = _time(protocol.implementations()["reference"])
    assert row["status"] == {"fwd": "ok", "bwd": "ok", "fwd_bwd": "ok"} or "not positive" in row["status"]["bwd"]
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0
    if row["status"]["bwd"] == "ok":
        assert row["bwd_ms"] == pytest.approx(row["fwd_bwd_ms"] - row["fwd_ms"])
        assert row["bwd_tflops"] == pytest.approx(protocol.flops(TINY, "bwd") / (row["bwd_ms"] * 1e-3) / 1e12)
    assert row["fwd_tflops"] == pytest.approx(protocol.flops(TINY, "fwd") / (row["fwd_ms"] * 1e-3) / 1e12)
    assert (row["impl"], row["family"], row["d"], row["n"], row["causal"]) == ("reference", "mhattn", 8, 16, True)
    assert row["dtype"] == "float32" and row["bwd_method"] == "subtract"


def test_time_attention_direct_backward_and_output_check():
    impl = protocol.implementations()["sdpa-flash"]
    inputs = protocol.make_inputs(TINY, "cpu")
    q, k, v, _ = inputs
    check = torch.nn.functional.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
    row = timing.time_attention(impl, TINY, inputs, ["bwd"], timing.TimingSettings(0.5, 1.0, "direct"), "cpu",
                                check=check)
    assert row["status"] == {"bwd": "ok"} and row["bwd_ms"] > 0
    assert "fwd_ms" not in row  # the direct method does not need the forward
    assert row["max_abs_diff"] < 1e-5


class _Raising(protocol.Implementation):
    name, family = "raising", "mhattn"

    def __init__(self, error, when="forward"):
        self.error, self.when = error, when

    def __call__(self, q, k, v, causal):
        if self.when == "forward":
            raise self.error
        out = q * 1.0

        class Boom(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, grad):
                raise self.error

        return Boom.apply(out)


def test_a_failing_forward_fills_every_mode_and_never_raises():
    row = _time(_Raising(ValueError("bad things")))
    assert set(row["status"].values()) == {"error: ValueError: bad things"}
    assert row["fwd_tflops"] is None and row["bwd_tflops"] is None


def test_a_failing_backward_keeps_the_forward():
    row = _time(_Raising(RuntimeError("no backward here"), when="backward"))
    assert row["status"]["fwd"] == "ok" and row["fwd_tflops"] > 0
    assert row["status"]["fwd_bwd"].startswith("error: RuntimeError: no backward here")
    assert row["status"]["bwd"] == row["status"]["fwd_bwd"]


def test_out_of_memory_is_reported_as_oom():
    row = _time(_Raising(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 40 GiB")))
    assert row["status"]["fwd"] == "OOM"


def test_unsupported_shapes_are_not_run(monkeypatch):
    impl = protocol.implementations()["reference"]
    monkeypatch.setattr(impl, "unsupported", lambda q, k, v, causal: ["head dim 8 is too small", "no fp32"])
    row = _time(impl)
    assert row["status"]["fwd"] == "n/a: head dim 8 is too small; no fp32"


def test_quadratic_scratch_beyond_free_memory_is_skipped(monkeypatch):
    monkeypatch.setattr(timing, "free_memory", lambda device: 1024)
    row = _time(protocol.implementations()["reference"])
    assert row["status"]["fwd"].startswith("OOM: needs ~")


def test_sdpa_kernel_that_cannot_run_is_na_with_torch_reasons():
    row = _time(protocol.implementations()["sdpa-cudnn"])  # cuDNN attention does not exist on the CPU
    assert row["status"]["fwd"].startswith("n/a: ")


def test_describe_error_entries():
    from mhattn.errors import BackendUnavailableError

    assert timing.describe_error(BackendUnavailableError("backend 'x' cannot: head dim")) == \
        "n/a: backend 'x' cannot: head dim"
    assert timing.describe_error(RuntimeError("CUDA out of memory.\nTried")) == "OOM"

    class Warn:
        message = "Flash attention requires q,k,v to have the same last dimension"

    entry = timing.describe_error(RuntimeError("No available kernel. Aborting execution."), [Warn()])
    assert entry == "n/a: Flash attention requires q,k,v to have the same last dimension"
    assert timing.describe_error(KeyError("x")) == "error: KeyError: 'x'"


def test_suspect_outputs_are_flagged():
    shape = protocol.Shape("fp32", 1, 2, 16, 8, False)
    wrong = torch.zeros(1, 2, 16, 8) + 3.0
    row = _time(protocol.implementations()["reference"], shape=shape, modes=("fwd",), check=wrong)
    assert row["max_abs_diff"] > timing.SUSPECT_DIFF
    assert report.suspect(row) and report.format_cell(row, "fwd").endswith("!")


def test_timing_settings_are_checked():
    with pytest.raises(ValueError, match="bwd_method"):
        timing.TimingSettings(bwd_method="guess")
    with pytest.raises(ValueError, match="positive"):
        timing.TimingSettings(warmup_ms=0)


# ---- memory and module (CPU: the memory table needs a GPU) -----------------------------------------------------------


def test_memory_on_cpu_says_it_needs_a_gpu():
    row = memory.measure_peak_memory(protocol.implementations()["reference"], memory.memory_shape(64), "cpu")
    assert row["status"].startswith("n/a") and row["peak_extra_bytes"] is None
    assert (row["b"], row["h"], row["d"], row["causal"]) == (1, 16, 128, True)


def test_module_training_step_on_cpu():
    config = module_bench.ModuleConfig(layers=1, d_model=32, heads=2, tokens=64, steps=1, warmup_steps=1)
    row = module_bench.measure_training_step("torch", 16, config, "cpu")
    assert row["status"] == "ok", row["status"]
    assert row["batch"] == 4 and row["tokens_per_s"] > 0 and row["step_ms"] > 0
    mh = module_bench.measure_training_step("mhattn:reference", 16, config, "cpu")
    assert mh["status"] == "ok" or mh["status"].startswith("n/a"), mh["status"]


def test_module_swap_leaves_no_torch_attention():
    import mhattn

    if not hasattr(mhattn, "MultiheadAttention"):
        pytest.skip("mhattn.MultiheadAttention is not in this build")
    config = module_bench.ModuleConfig(layers=2, d_model=32, heads=2)
    model = module_bench.build_model(config, "mhattn", "cpu")
    assert not any(type(m) is torch.nn.MultiheadAttention for m in model.modules())
    assert sum(isinstance(m, mhattn.MultiheadAttention) for m in model.modules()) == 2


# ---- plan --------------------------------------------------------------------------------------------------------


def test_plan_order_and_counts():
    table = protocol.implementations()
    selection = plan.Selection(impls=["sdpa-flash", "reference"], dtypes=["bf16", "fp16"], head_dims=[64],
                               seqlens=[512, 8192], causal=[False], memory=True, memory_seqlens=[1024],
                               module=True, module_seqlens=[1024], reference_max_n=4096)
    tasks = plan.plan_tasks(selection, table)
    kinds = [t["kind"] for t in tasks]
    assert kinds == ["memory"] * 2 + ["module"] * 2 + ["attn"] * 8
    assert [t["shape"]["dtype"] for t in tasks if t["kind"] == "attn"] == ["bf16"] * 4 + ["fp16"] * 4
    skipped = [t for t in tasks if t.get("skip")]
    assert [(t["impl"], t["shape"]["seqlen"]) for t in skipped] == [("reference", 8192)] * 2
    assert [t["variant"] for t in tasks if t["kind"] == "module"] == ["torch", "mhattn"]
    # fwd and fwd+bwd are timed, the backward is their difference: 2 calls per cell
    assert plan.timed_calls(tasks) == 16
    json.dumps(tasks)  # a worker process reads them from a file


# ---- report ---------------------------------------------------------------------------------------------------------


def _row(impl, family, d, n, causal, fwd, fwd_bwd, status="ok", reference=False):
    shape = protocol.Shape("bf16", protocol.TOKENS // n, protocol.HIDDEN // d, n, d, causal)
    row = {"kind": "attn", "impl": impl, "family": family, "is_reference": reference, "dtype": "bfloat16",
           "d": d, "h": shape.heads, "b": shape.batch, "n": n, "causal": causal, "max_abs_diff": 0.003,
           "status": {m: status for m in protocol.MODES}}
    if status != "ok":
        for m in protocol.MODES:
            row[f"{m}_ms"] = row[f"{m}_tflops"] = None
        return row
    fwd_ms = protocol.flops(shape, "fwd") / (fwd * 1e12) * 1e3
    fwd_bwd_ms = protocol.flops(shape, "fwd_bwd") / (fwd_bwd * 1e12) * 1e3
    for mode, ms in (("fwd", fwd_ms), ("fwd_bwd", fwd_bwd_ms), ("bwd", fwd_bwd_ms - fwd_ms)):
        row[f"{mode}_ms"] = ms
        row[f"{mode}_tflops"] = protocol.tflops(protocol.flops(shape, mode), ms)
    return row


def synthetic_document():
    rows = []
    for d in (64, 128):
        for n in (512, 1024, 4096):
            for causal in (False, True):
                rows.append(_row("triton", "mhattn", d, n, causal, 330.0, 280.0))
                rows.append(_row("cupy", "mhattn", d, n, causal, 0, 0, status="n/a: kernels not built"))
                rows.append(_row("sdpa-flash", "sdpa", d, n, causal, 300.0, 260.0))
                rows.append(_row("sdpa-cudnn", "sdpa", d, n, causal, 440.0, 400.0))
                if n <= 1024:
                    rows.append(_row("reference", "mhattn", d, n, causal, 10.0, 8.0, reference=True))
                else:
                    rows.append(_row("reference", "mhattn", d, n, causal, 0, 0, status="OOM: needs ~99 GiB",
                                     reference=True))
    mem = []
    for impl, family, per_n in (("triton", "mhattn", 100), ("sdpa-flash", "sdpa", 110)):
        for n in (8192, 32768):
            mem.append({"kind": "memory", "impl": impl, "family": family, "is_reference": False, "dtype": "bfloat16",
                        "d": 128, "h": 16, "b": 1, "n": n, "causal": True, "peak_extra_bytes": per_n * n * 1024,
                        "beyond_outputs_bytes": 0, "status": "ok"})
    mem.append({"kind": "memory", "impl": "reference", "family": "mhattn", "is_reference": True, "dtype": "bfloat16",
                "d": 128, "h": 16, "b": 1, "n": 32768, "causal": True, "peak_extra_bytes": None,
                "beyond_outputs_bytes": None, "status": "OOM"})
    config = module_bench.ModuleConfig()
    mod = []
    for variant, tps in (("torch", 100000.0), ("mhattn:triton", 120000.0)):
        row = module_bench.module_row(variant, 1024, config)
        row.update(step_ms=16384 / tps * 1e3, tokens_per_s=tps, peak_bytes=10 * 2**30, loss=1.0, status="ok")
        mod.append(row)
    meta = {"date": "2026-11-22 10:00 UTC", "command": "mhattn bench --memory --module", "device": "H100 test",
            "versions": {"torch": "2.11"}, "protocol": "the protocol", "tokens": protocol.TOKENS,
            "timing": {"warmup_ms": 25, "rep_ms": 100, "bwd_method": "subtract"},
            "timer": "triton.testing.do_bench median", "bwd_method_text": timing.BWD_METHODS["subtract"]}
    return report.make_document(meta, rows + mem + mod)


def test_sweep_table_has_every_implementation_and_ratio_columns():
    text = report.sweep_tables(synthetic_document())
    lines = text.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("d"))
    for column in ("triton", "cupy", "sdpa-flash", "sdpa-cudnn", "reference", "triton/flash", "triton/cudnn",
                   "cupy/flash"):
        assert column in header.split()
    row = next(line for line in lines if line.split()[:3] == ["64", "no", "1k"])
    assert "330.0" in row and "n/a" in row and "1.10x" in row and "0.75x" in row
    assert "OOM" in text and "kernels not built" in text
    assert "bf16 forward" in text and "bf16 backward" in text and "bf16 forward+backward" in text


def test_target_verdicts():
    lines = report.target_lines(synthetic_document())
    text = "\n".join(lines)
    triton_fwd = next(line for line in lines if line.split()[:2] == ["triton", "fwd"])
    # targets are ratios to sdpa-cudnn: 0.75x of it misses, whatever the ratio to sdpa-flash (1.10x)
    assert "8/8" in triton_fwd and "0.75x" in triton_fwd and "1.10x" in triton_fwd and triton_fwd.endswith("misses")
    cupy_fwd = next(line for line in lines if line.split()[:2] == ["cupy", "fwd"])
    assert cupy_fwd.endswith("no data")
    assert "memory vs PERFORMANCE.md" in text and "0.91x" in text
    # the reference ran out of memory at N=4k here: no speed-up to give
    reference = next(line for line in lines if line.split()[:1] == ["triton"] and "non-causal" in line)
    assert "- no data" in reference


def test_target_misses_when_one_cell_is_slow():
    document = synthetic_document()
    for row in document["rows"]:
        if row["impl"] == "triton" and row["d"] == 128 and row["n"] == 4096 and row["causal"]:
            row["fwd_tflops"] = 150.0
        if row["impl"] == "triton":  # every other cell above the 1.0x-cuDNN target
            row["fwd_tflops"] = row["fwd_tflops"] if row["fwd_tflops"] == 150.0 else 500.0
    triton_fwd = next(line for line in report.target_lines(document) if line.split()[:2] == ["triton", "fwd"])
    assert "0.34x" in triton_fwd and "d=128 N=4k causal" in triton_fwd and triton_fwd.endswith("misses")


def test_memory_and_module_tables():
    document = synthetic_document()
    mem = report.memory_table(document)
    assert "32k" in mem and "OOM" in mem and "0.91x" in mem
    mod = report.module_table(document)
    assert "torch.nn.MultiheadAttention" in mod and "mhattn.MultiheadAttention[triton]" in mod
    assert "1.20x" in mod and "100,000" in mod


def test_full_and_summary_reports_and_markdown():
    document = synthetic_document()
    full = report.full_report(document)
    assert "mhattn bench  2026-11-22" in full and "command: mhattn bench --memory --module" in full
    summary = report.summary_report(document)
    assert "forward / backward" in summary and "330.0 / " in summary
    markdown = report.markdown_report(document, ["attention_bf16.png"])
    assert "2026-11-22 10:00 UTC" in markdown and "mhattn bench --memory --module" in markdown
    assert "![attention_bf16.png](attention_bf16.png)" in markdown
    assert "| d | N | causal | triton |" in markdown


def test_json_round_trip_is_strict(tmp_path):
    document = synthetic_document()
    document["rows"][0]["fwd_ms"] = float("nan")
    path = tmp_path / "bench.json"
    report.write_json(path, document)
    text = path.read_text()
    assert "NaN" not in text
    loaded = report.read_json(path)
    assert loaded["rows"][0]["fwd_ms"] is None and len(loaded["rows"]) == len(document["rows"])
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="mhattn-bench"):
        report.read_json(tmp_path / "other.json")


def test_plots_written_or_skipped_with_a_message(tmp_path):
    from mhattn.benchmark import plots

    document = synthetic_document()
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(plots.PlotUnavailable, match="matplotlib"):
            plots.plot_sweep(document, str(tmp_path / "a.png"))
        return
    for path in (plots.plot_sweep(document, str(tmp_path / "a.png"), dtype="bf16"),
                 plots.plot_memory_module(document, str(tmp_path / "m.png"))):
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ---- progress ------------------------------------------------------------------------------------------------------


def test_progress_in_a_log_prints_lines():
    stream = io.StringIO()
    progress = Progress(3, stream=stream, log_every=0.0, title="bench")
    progress.start("first")
    progress.advance()
    progress.write("a log line")
    progress.advance(2)
    progress.close()
    text = stream.getvalue()
    assert "a log line\n" in text and "3/3" in text and "\r" not in text


def test_progress_on_a_terminal_redraws_one_line():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    progress = Progress(2, stream=stream)
    progress.start("task")
    progress.advance(2)
    progress.close()
    assert "\r" in stream.getvalue() and "[" + "#" * 28 + "] 2/2" in stream.getvalue()


# ---- CLI --------------------------------------------------------------------------------------------------------------


def _parse(argv):
    import argparse

    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_argument_lists():
    args = _parse(["--seqlen", "512,1k,16k", "--dtype", "bfloat16,fp16", "--mode", "fwd,bwd",
                   "--impl", "triton,sdpa-flash", "--impl", "reference", "--head-dim", "64"])
    assert args.seqlen == [512, 1024, 16384]
    assert args.dtype == ["bf16", "fp16"] and args.mode == ["fwd", "bwd"] and args.head_dim == [64]
    selection = bench_cli.build_selection(args, protocol.implementations())
    assert selection.impls == ["triton", "sdpa-flash", "reference"]  # the table's display order
    for bad in (["--seqlen", "x"], ["--dtype", "int8"], ["--mode", "sideways"], ["--dtype", "both,fp16"]):
        with pytest.raises(SystemExit):
            _parse(bad)
    for both in ("both", "all", "bf16,fp16", "fp16,bf16"):  # (what --help offers for both 16-bit dtypes)
        assert sorted(_parse(["--dtype", both]).dtype) == ["bf16", "fp16"]


def test_quick_selection_and_short_timing():
    args = _parse(["--quick"])
    table = protocol.implementations()
    selection = bench_cli.build_selection(args, table)
    assert selection.dtypes == ["bf16"] and selection.head_dims == [64, 128] and selection.seqlens == [1024, 4096]
    settings, note = bench_cli.choose_timing(args, selection, plan.plan_tasks(selection, table))
    assert (settings.warmup_ms, settings.rep_ms) == bench_cli.SHORT_TIMING and "--quick" in note


def test_long_sweeps_get_short_timing_unless_asked(monkeypatch):
    monkeypatch.setattr(bench_cli, "LONG_SWEEP_SECONDS", 60.0)
    table = protocol.implementations()
    args = _parse(["--dtype", "all"])
    selection = bench_cli.build_selection(args, table)
    tasks = plan.plan_tasks(selection, table)
    settings, note = bench_cli.choose_timing(args, selection, tasks)
    assert (settings.warmup_ms, settings.rep_ms) == bench_cli.SHORT_TIMING and "shortened" in note
    args = _parse(["--dtype", "all", "--warmup", "25", "--rep", "100"])
    settings, note = bench_cli.choose_timing(args, selection, tasks)
    assert (settings.warmup_ms, settings.rep_ms) == (25, 100)
    settings, _ = bench_cli.choose_timing(_parse(["--head-dim", "64"]), selection, tasks[:10])
    assert (settings.warmup_ms, settings.rep_ms) == bench_cli.PAPER_TIMING


def test_command_shown_with_results_leaves_out_where_they_go():
    class Args:
        argv = ["bench", "--quick", "--json", "/x/b.json", "--plot-dir=/x", "--memory", "--time-limit", "300"]

    assert bench_cli._command_line(Args, measured_only=True) == "mhattn bench --quick --memory"
    assert bench_cli._command_line(Args).endswith("--time-limit 300")


def test_bench_without_a_gpu_exits_2_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mhattn_cli.main(["bench", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_help_works_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as stop:
        mhattn_cli.main(["bench", "--help"])
    assert stop.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_unknown_implementation_is_an_error(monkeypatch, capsys):
    assert mhattn_cli.main(["bench", "--device", "cpu", "--impl", "nope"]) == 2
    assert "unknown implementation(s) nope" in capsys.readouterr().err


def test_list_and_from_json(tmp_path, capsys):
    assert mhattn_cli.main(["bench", "--list"]) == 0
    assert "sdpa-flash" in capsys.readouterr().out
    path = tmp_path / "bench.json"
    report.write_json(path, synthetic_document())
    markdown = tmp_path / "bench.md"
    assert mhattn_cli.main(["bench", "--from-json", str(path), "--summary", "--markdown", str(markdown)]) == 0
    out = capsys.readouterr().out
    assert "forward / backward" in out and "training step" in out
    assert "mhattn bench --memory --module" in markdown.read_text()


def test_end_to_end_on_cpu_in_process(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = mhattn_cli.main(["bench", "--device", "cpu", "--no-isolate", "--no-progress", "--tokens", "32",
                            "--seqlen", "16", "--head-dim", "512", "--causal", "yes", "--warmup", "0.2", "--rep",
                            "0.5", "--impl", "sdpa-flash,reference", "--json", str(path)])
    assert code == 0
    document = report.read_json(path)
    assert [r["impl"] for r in document["rows"]] == ["sdpa-flash", "reference"]
    assert all(r["status"]["fwd"] == "ok" for r in document["rows"])
    assert document["meta"]["command"].startswith("mhattn bench")
    out = capsys.readouterr().out
    assert "bf16 forward, TFLOP/s" in out


# ---- worker and supervisor -----------------------------------------------------------------------------------------


def _tiny_tasks(count=3):
    table = protocol.implementations()
    selection = plan.Selection(impls=["reference"], dtypes=["bf16"], head_dims=[512], seqlens=[16] * count,
                               causal=[True], modes=["fwd"], tokens=16,
                               timing=timing.TimingSettings(0.2, 0.5))
    return plan.plan_tasks(selection, table)


def test_in_process_runner_and_context_flag():
    outcome = supervisor.run_tasks(_tiny_tasks(2), device="cpu", isolate=False)
    assert [r["status"]["fwd"] for r in outcome.results] == ["ok", "ok"]
    assert not outcome.interrupted and outcome.restarts == 0


def test_deadline_marks_the_rest_not_run():
    outcome = supervisor.run_tasks(_tiny_tasks(2), device="cpu", isolate=False, deadline=1.0)
    assert outcome.deadline_reached
    assert all(r["status"]["fwd"].startswith("not run: the time limit") for r in outcome.results)


class FakeRunner:
    """Stands in for the benchmark Runner in a worker process (it starts without timing anything): the
    second task a process runs crashes it or hangs, as $FAKE_MODE says."""

    calls = 0

    def __init__(self, device):
        pass

    def run(self, task):
        FakeRunner.calls += 1
        mode = os.environ.get("FAKE_MODE")
        if FakeRunner.calls == 2 and mode == "crash":
            print("about to crash", flush=True)
            os._exit(9)
        if FakeRunner.calls == 2 and mode == "hang":
            time.sleep(60)
        return {"kind": "attn", "impl": task["impl"], "status": {"fwd": "ok"}}


FAKE_RUNNER = f"{__name__}:FakeRunner"


def test_a_crashing_task_costs_one_cell_and_a_fresh_worker_goes_on(monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "crash")
    seen = []
    outcome = supervisor.run_tasks(_tiny_tasks(3), device="cpu", runner=FAKE_RUNNER,
                                   progress=Progress(3, stream=io.StringIO()),
                                   on_result=lambda i, row: seen.append(i))
    statuses = [r["status"]["fwd"] for r in outcome.results]
    assert statuses[0] == "ok" and statuses[2] == "ok"
    assert statuses[1].startswith("error: the worker process died (exit code 9)")
    assert "about to crash" in statuses[1]
    assert outcome.restarts == 1 and sorted(seen) == [0, 1, 2]


def test_a_hanging_task_is_killed_after_the_timeout(monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "hang")
    outcome = supervisor.run_tasks(_tiny_tasks(3), device="cpu", runner=FAKE_RUNNER, task_timeout=1.5,
                                   progress=Progress(3, stream=io.StringIO()))
    statuses = [r["status"]["fwd"] for r in outcome.results]
    assert statuses[1].startswith("error: timed out after 2 s") or statuses[1].startswith("error: timed out after 1 s")
    assert statuses[0] == statuses[2] == "ok"


def test_real_worker_process_on_cpu():
    stream = io.StringIO()
    outcome = supervisor.run_tasks(_tiny_tasks(2), device="cpu", progress=Progress(2, stream=stream))
    assert [r["status"]["fwd"] for r in outcome.results] == ["ok", "ok"], outcome.results
    assert outcome.results[0]["fwd_tflops"] > 0 and outcome.restarts == 0


def test_placeholder_rows_keep_the_identity():
    task = _tiny_tasks(1)[0]
    row = worker.placeholder_row(task, "not run: x")
    assert (row["impl"], row["n"], row["d"], row["status"]) == ("reference", 16, 512, {"fwd": "not run: x"})
    assert row["fwd_tflops"] is None
    assert worker.clean_for_json({"a": [float("inf"), 1.0]}) == {"a": [None, 1.0]}
    assert os.environ.get("FAKE_MODE") is None


# ---- on a GPU: the harness end to end, small ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
def test_harness_on_the_gpu_in_a_worker_process():
    table = protocol.implementations()
    selection = plan.Selection(impls=[n for n in table if n != "sdpa-math"], dtypes=["bf16"], head_dims=[64],
                               seqlens=[512], causal=[True], tokens=2048, memory=True, memory_seqlens=[1024],
                               module=True, module_seqlens=[256], module_variants=["torch", "mhattn"],
                               module_config=module_bench.ModuleConfig(layers=2, d_model=128, heads=2, tokens=1024,
                                                                       steps=2, warmup_steps=1),
                               timing=timing.TimingSettings(5.0, 10.0))
    tasks = plan.plan_tasks(selection, table)
    outcome = supervisor.run_tasks(tasks, device="cuda", progress=Progress(len(tasks), stream=io.StringIO()))
    rows = {(r["kind"], r.get("impl", r.get("variant"))): r for r in outcome.results}
    for name in ("sdpa-flash", "reference"):
        row = rows[("attn", name)]
        assert row["status"] == {"fwd": "ok", "bwd": "ok", "fwd_bwd": "ok"}, row["status"]
        assert row["fwd_tflops"] > 0 and row["bwd_tflops"] > 0 and row["max_abs_diff"] < timing.SUSPECT_DIFF
        assert rows[("memory", name)]["status"] == "ok" and rows[("memory", name)]["peak_extra_bytes"] > 0
    for row in outcome.results:  # every other cell says what happened; nothing is left unexplained
        statuses = row["status"].values() if isinstance(row["status"], dict) else [row["status"]]
        assert all(s == "ok" or s.split(":")[0] in ("n/a", "OOM", "error", "skipped") for s in statuses), row
    assert rows[("module", "torch")]["status"] == "ok" and rows[("module", "torch")]["tokens_per_s"] > 0
    assert outcome.restarts == 0


def test_flex_peer_keeps_compiling_past_torch_compiles_recompile_limit():
    """A sweep compiles flex_attention for more shapes than torch.compile's default recompile limit (8); past it
    the function would run uncompiled (flex's unfused reference). The flex peer raises the limit first."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    def compiled_shapes():
        counter = CompileCounter()
        fn = torch.compile(lambda x: x * 2 + 1, backend=counter, dynamic=False)
        for n in range(1, 13):
            fn(torch.ones(n))
        torch._dynamo.reset()
        return counter.frame_count

    before = torch._dynamo.config.recompile_limit
    # config.patch restores every setting on exit, the peer's raised limits included.
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        torch._dynamo.reset()
        assert compiled_shapes() == 8  # torch's default: the last four shapes ran uncompiled
        protocol.allow_flex_recompiles()
        assert torch._dynamo.config.recompile_limit >= protocol.FLEX_RECOMPILE_LIMIT
        assert compiled_shapes() == 12
    assert torch._dynamo.config.recompile_limit == before
