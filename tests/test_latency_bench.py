"""``mhattn bench --latency``: planning, measuring on the CPU with tiny shapes, the table and the CLI."""

import json

import pytest
import torch

from mhattn import cli as mhattn_cli
from mhattn.benchmark import latency, protocol

TINY = (latency.LatencyShape("tiny", 1, 2, 16, 8, "fp32"), latency.LatencyShape("tiny half", 2, 2, 8, 8, "fp16"))


@pytest.fixture
def tiny_shapes(monkeypatch):
    monkeypatch.setattr(latency, "SHAPES", TINY)
    monkeypatch.setattr(latency, "HOST_LOOP_CALLS", 5)


def test_shapes_are_the_issues_and_the_baseline_is_sdpas_default():
    sizes = {(s.batch, s.heads, s.seqlen, s.head_dim, s.dtype) for s in latency.SHAPES}
    assert sizes == {(1, 16, 128, 64, "bf16"), (32, 12, 197, 64, "bf16"), (8, 16, 512, 64, "bf16"),
                     (8, 16, 512, 64, "fp32")}
    table = protocol.implementations()
    assert table["sdpa-default"].family == "sdpa" and table["sdpa-default"].unsupported(None, None, None, False) == []
    assert "sdpa-default" not in protocol.default_implementation_names(table)  # the sweep's peers are unchanged
    defaults = latency.default_impls(table)
    assert defaults[-1] == "sdpa-default" and "reference" not in defaults and "triton" in defaults


def test_plan_puts_the_baseline_first_in_every_group(tiny_shapes):
    cells = latency.plan_cells(["reference", "sdpa-default"])
    assert len(cells) == len(TINY) * len(latency.MODES) * 2
    for i in range(0, len(cells), 2):
        assert cells[i]["impl"] == "sdpa-default" and cells[i + 1]["impl"] == "reference"
        assert cells[i]["shape"] == cells[i + 1]["shape"] and cells[i]["mode"] == cells[i + 1]["mode"]


def test_measure_and_report_on_the_cpu(tiny_shapes):
    table = protocol.implementations()
    rows = latency.run(["reference", "sdpa-default"], table, "cpu", warmup_ms=1.0, rep_ms=2.0)
    assert all(r["status"] == "ok" and r["gpu_us"] > 0 and r["host_us"] > 0 for r in rows), rows
    text = latency.format_table(rows, "wall clock")
    assert "x sdpa-default" in text and "tiny: B=1 H=2 N=16 d=8 fp32" in text
    baseline_line = next(line for line in text.splitlines() if "sdpa-default" in line and "fwd+bwd" in line)
    assert baseline_line.count("1.00x") == 2  # the baseline against itself


def test_unsupported_and_failing_cells_are_table_entries(tiny_shapes):
    class Broken(protocol.Implementation):
        name, family = "broken", "mhattn"

        def __call__(self, q, k, v, causal):
            raise RuntimeError("kernel exploded")

    class Unsupported(protocol.Implementation):
        name, family = "nope", "mhattn"

        def unsupported(self, q, k, v, causal):
            return ["no fp32 here"]

    table = {"broken": Broken(), "nope": Unsupported(), "sdpa-default": protocol.implementations()["sdpa-default"]}
    rows = latency.run(["broken", "nope", "sdpa-default"], table, "cpu", modes=("fwd",), warmup_ms=1.0, rep_ms=1.0)
    status = {(r["impl"], r["shape"]["label"]): r["status"] for r in rows}
    assert status[("broken", "tiny")] == "error" and status[("nope", "tiny")] == "unsupported"
    text = latency.format_table(rows)
    assert "kernel exploded" in text and "no fp32 here" in text


def test_cli_latency_on_the_cpu(tiny_shapes, tmp_path, capsys):
    path = tmp_path / "latency.json"
    code = mhattn_cli.main(["bench", "--latency", "--device", "cpu", "--impl", "reference,sdpa-default",
                            "--warmup", "1", "--rep", "2", "--json", str(path), "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("latency:") and "reference" in out
    document = json.loads(path.read_text())
    assert len(document["latency"]) == len(TINY) * 2 * 2 and "bench --latency" in document["meta"]["command"]
    assert mhattn_cli.main(["bench", "--latency", "--device", "cpu", "--impl", "nonesuch"]) == 2


def test_host_loops_of_one_group_take_turns(tiny_shapes, monkeypatch):
    """Within a (shape, mode) group every implementation is timed first, then their host loops alternate, one loop
    each per round (a drifting host reaches both alike); each row keeps its best loop."""
    order = []

    class Recording(protocol.Implementation):
        family = "mhattn"

        def __init__(self, name):
            self.name = name

        def __call__(self, q, k, v, causal):
            order.append(self.name)
            return q

    monkeypatch.setattr(latency, "HOST_LOOP_ROUNDS", 3)
    monkeypatch.setattr(latency.timing, "bench_ms", lambda fn, *args: (order.append("timed"), 0.001)[1])
    table = {"a": Recording("a"), "b": Recording("b")}
    rows = latency.run(["a", "b"], table, "cpu", shapes=TINY[:1], modes=("fwd",))
    loops = order[order.index("timed", order.index("timed") + 1) + 1:]  # after both GPU timings
    runs = [name for i, name in enumerate(loops) if i == 0 or loops[i - 1] != name]
    assert runs == ["a", "b"] * 3  # each loop: a warm-up call, then HOST_LOOP_CALLS calls of one implementation
    assert all(r["status"] == "ok" and r["host_us"] > 0 and r["gpu_us"] == 1.0 for r in rows)
