"""``mhattn bench --decode``: planning, bytes, the table, and a run of the harness on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from mhattn.benchmark import decode_bench
from mhattn.cli import main


def test_cells_cover_the_issue_grid_smallest_first():
    cells = decode_bench.decode_cells(dtypes=("bf16", "fp16"))
    assert len(cells) == 2 * 3 * 4 * 2
    assert {(c.batch, c.seqlen_k, c.seqlen_q) for c in cells if c.dtype == "fp16"} == {
        (b, n, q) for b in (1, 8, 64) for n in (1024, 8192, 32768, 131072) for q in (1, 4)}
    bf16 = [c for c in cells if c.dtype == "bf16"]
    assert cells[:len(bf16)] == bf16  # dtype by dtype
    one_row = [c.kv_bytes for c in bf16 if c.seqlen_q == 1]
    assert one_row == sorted(one_row)
    cell = decode_bench.DecodeCell("bf16", 1, 131072)
    # K and V of 8 heads, 128k keys, d = 128, 2 bytes: 512 MiB; 179 us at 3.0 TB/s as PERFORMANCE.md says
    assert cell.kv_bytes == 2 * 8 * 131072 * 128 * 2
    assert abs(cell.kv_bytes / 3.0e12 * 1e6 - 179) < 1


def test_table_ratios_bandwidth_and_failures():
    row = {"dtype": "bf16", "batch": 1, "seqlen_k": 131072, "seqlen_q": 1, "kv_bytes": 536870912,
           "us": {"sdpa": 194.0, "sdpa-cudnn": None, "triton": 200.0, "cupy": 400.0, "auto": 203.7, "kvcache": 190.0,
                  "paged": 199.5},
           "status": {"sdpa": "ok", "sdpa-cudnn": "n/a: no kernel", "triton": "ok", "cupy": "ok", "auto": "ok",
                      "kvcache": "ok", "paged": "ok"}}
    text = decode_bench.decode_table([row])
    line = text.splitlines()[2]
    assert line.split()[:4] == ["bf16", "1", "128k", "1"]
    assert "0.97" in line.split()  # sdpa / triton
    assert "2826" in line.split()  # 536870912 B / 190 us (the faster of triton and kvcache) in GB/s
    assert "1.05" in line.split()  # paged / contiguous
    assert line.split()[-2] == "1.05"  # auto / the fastest of sdpa, triton, cupy (203.7 / 194)
    assert line.split()[-1] == "1.05"  # in a loop: no call here was looped
    assert "not measured:" in text and "sdpa-cudnn: n/a: no kernel" in text


def test_table_holds_auto_against_the_fastest_in_a_loop_too():
    """A looped call costs the larger of its GPU time and its host loop's: auto/best loop compares those."""
    row = {"dtype": "bf16", "batch": 1, "seqlen_k": 1024, "seqlen_q": 4, "kv_bytes": 4194304,
           "us": {"sdpa": 37.0, "triton": 16.0, "cupy": 22.0, "auto": 42.0},
           "status": dict.fromkeys(("sdpa", "triton", "cupy", "auto"), "ok"),
           "loop_us": {"sdpa": 40.0, "triton": 80.0, "cupy": 60.0, "auto": 41.0}}
    line = decode_bench.decode_table([row]).splitlines()[2].split()
    assert line[-2] == "2.62"  # GPU timer: auto 42 against triton's 16
    assert line[-1] == "1.05"  # in a loop: auto max(42, 41) against sdpa's max(37, 40)


def test_graph_table_lists_the_replayed_cells_with_their_ratios():
    """Cells timed from a CUDA graph get a second table: triton's speed-up over cuDNN, paged over contiguous, auto
    over the fastest of sdpa, triton and cupy, all on the replayed times; a capture that failed says why."""
    replayed = {"dtype": "bf16", "batch": 1, "seqlen_k": 1024, "seqlen_q": 1, "kv_bytes": 4194304,
                "us": {"sdpa": 13.0, "sdpa-cudnn": 13.0, "triton": 15.0, "auto": 13.0, "kvcache": 14.0, "paged": 17.0},
                "status": {"sdpa": "ok", "sdpa-cudnn": "ok", "triton": "ok", "auto": "ok", "kvcache": "ok",
                           "paged": "CUDA graph: RuntimeError: operation not permitted when stream is capturing"},
                "loop_us": {}, "graph_us": {"sdpa": 9.0, "sdpa-cudnn": 8.0, "triton": 6.4, "auto": 9.2,
                                            "kvcache": 6.5}}
    long = {"dtype": "bf16", "batch": 8, "seqlen_k": 131072, "seqlen_q": 1, "kv_bytes": 1,
            "us": {"triton": 1400.0}, "status": {"triton": "ok"}, "loop_us": {}, "graph_us": {}}
    text = decode_bench.decode_table([replayed, long])
    lines = text.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("host-bound cells replayed")))
    header, row = lines[start + 1].split(), lines[start + 3].split()
    assert len(lines[start + 1:start + 4]) == 3 and lines[start + 4] == ""  # one replayed row: the long cell has none
    assert row[:4] == ["bf16", "1", "1k", "1"]
    assert row[4:11] == ["9.0", "8.0", "6.4", "-", "9.2", "6.5", "-"]
    assert row[-3] == "1.25"  # cuDNN 8.0 over triton 6.4
    assert row[-2] == "-"  # no replayed paged time
    assert row[-1] == f"{9.2 / 6.4:.2f}"  # auto against the fastest of sdpa, triton, cupy
    assert "paged: CUDA graph: RuntimeError" in text
    assert not any("the L2 flushed" in line for line in lines)  # no flushed replays in these rows


def test_flushed_graph_table_follows_the_warm_one():
    """Replays with the L2 flushed before each call get their own table after the back-to-back one, with the same
    ratios on their times."""
    row = {"dtype": "fp16", "batch": 8, "seqlen_k": 1024, "seqlen_q": 1, "kv_bytes": 33554432,
           "us": {"sdpa-cudnn": 30.0, "triton": 31.0}, "status": {"sdpa-cudnn": "ok", "triton": "ok"}, "loop_us": {},
           "graph_us": {"sdpa-cudnn": 11.6, "triton": 13.2}, "graph_flushed_us": {"sdpa-cudnn": 21.5, "triton": 21.4}}
    lines = decode_bench.decode_table([row]).splitlines()
    warm = lines.index(next(line for line in lines if "no L2 flush between them" in line))
    flushed = lines.index(next(line for line in lines if "the L2 flushed before each" in line))
    assert warm < flushed
    assert lines[warm + 3].split()[4:7] == ["-", "12", "13"] and lines[warm + 3].split()[-3] == f"{11.6 / 13.2:.2f}"
    assert lines[flushed + 3].split()[4:7] == ["-", "22", "21"]
    assert lines[flushed + 3].split()[-3] == f"{21.5 / 21.4:.2f}"


@pytest.mark.gpu
def test_gpu_graph_replay_times_a_captured_call():
    """The replay timer: a captured call's time per call, and a call that reads a value back to the host refused by
    the capture."""
    from mhattn.benchmark import timing

    x = torch.randn(1 << 20, device="cuda")
    ms = timing.graph_replay_ms(lambda: x.mul_(1.0), "cuda", calls=5, rounds=3)
    assert 0 < ms < 10
    with pytest.raises(Exception):
        timing.graph_replay_ms(lambda: x.sum().item(), "cuda", calls=2, rounds=1)


@pytest.mark.gpu
def test_gpu_graph_replay_with_the_l2_flushed_reads_inputs_from_memory():
    """flush_l2: a call reading 16 MB (in the H100's L2 when replayed back to back) takes longer when the L2 is
    flushed before each call, and the flushes' own time is taken off (a positive time of the call's order)."""
    from mhattn.benchmark import timing

    x = torch.ones(4 << 20, device="cuda")  # (not randn: a refused capture before may have left torch's CUDA RNG mid-capture)
    total = torch.empty((), device="cuda")
    read = lambda: torch.sum(x, dim=0, out=total)  # noqa: E731
    warm = timing.graph_replay_ms(read, "cuda", calls=10, rounds=5)
    cold = timing.graph_replay_ms(read, "cuda", calls=10, rounds=5, flush_l2=True)
    assert 0 < warm < cold < 20 * warm


def test_host_loops_take_turns_and_report_errors(monkeypatch):
    from mhattn.benchmark import latency

    order = []

    def host_loop_us(fn, calls, device, rounds=3):
        order.append(fn)
        if fn == "bad":
            raise RuntimeError("boom")
        return {"a": 5.0, "b": 7.0}[fn] + len(order)

    monkeypatch.setattr(latency, "host_loop_us", host_loop_us)
    loops, errors = latency.host_loops_in_turn({"a": "a", "bad": "bad", "b": "b"}, 10, "cpu", rounds=2)
    assert order == ["a", "bad", "b", "a", "b"]
    assert loops == {"a": 6.0, "b": 10.0} and list(errors) == ["bad"] and str(errors["bad"]) == "boom"


def test_decode_bench_runs_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "decode.json"
    code = main(["bench", "--decode", "--device", "cpu", "--impl", "sdpa", "--batch", "1,2", "--seqlen", "64",
                 "--nq", "1,3", "--head-dim", "16", "--dtype", "fp16", "--warmup", "1", "--rep", "2",
                 "--no-progress", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert text.count("fp16") == 4
    rows = json.loads(out.read_text())["decode"]
    assert [(r["batch"], r["seqlen_q"]) for r in rows] == [(1, 1), (2, 1), (1, 3), (2, 3)]
    assert all(r["us"]["sdpa"] > 0 and r["status"]["sdpa"] == "ok" for r in rows)


def test_causal_mask_is_bottom_right():
    cell = decode_bench.DecodeCell("fp32", 1, 6, seqlen_q=3)
    mask = decode_bench._causal_mask(cell, "cpu")[0, 0]
    assert torch.equal(mask.sum(-1), torch.tensor([4, 5, 6]))
    assert decode_bench._causal_mask(decode_bench.DecodeCell("fp32", 1, 6), "cpu") is None
