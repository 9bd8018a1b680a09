"""Dispatch by measured speed, without a GPU: the grids, timing tables (save, load, which one applies), the
nearest-shape lookup, the dispatcher's hook and its fallback, and `mhattn tune` end to end on the CPU."""

import argparse
import contextlib
import dataclasses
import io
import json

import pytest
import torch

import mhattn
from mhattn import dispatch
from mhattn.problem import Problem
from mhattn.tuning import cli as tune_cli
from mhattn.tuning import grid, table

H100 = {"device": "NVIDIA H100 80GB HBM3", "compute_capability": [9, 0]}


# Every test reads and writes tables in its own cache directory, and starts with no cached decision.
pytestmark = pytest.mark.usefixtures("private_tables")


def cell(times_fwd, times_both=None, **fields):
    c = grid.Cell(**{**dict(dtype="bf16", batch=8, heads_q=16, heads_kv=16, seqlen_q=2048, seqlen_k=2048,
                            head_dim=128), **fields})
    return dict(c.as_dict(), fwd_ms=times_fwd, fwd_bwd_ms=times_both or {}, skipped={})


def gpu_problem(**overrides):
    fields = dict(device_type="cuda", device_index=0, compute_capability=(9, 0), dtype=torch.bfloat16, batch=8,
                  heads_q=16, heads_kv=16, seqlen_q=2048, seqlen_k=2048, head_dim=128, head_dim_v=128,
                  features=frozenset())
    fields.update(overrides)
    return Problem(**fields)


def make_table(cells, key=H100, **made):
    return table.TimingTable(dict(key, torch=torch.__version__), cells, dict({"unix_time": 1.0}, **made))


# ---- grids ----------------------------------------------------------------------------------------------------


def test_grids_cover_what_users_run():
    quick = grid.quick_grid()
    assert len(quick) == 67 and len(set(quick)) == len(quick)
    assert {c.dtype for c in quick} == {"bf16", "fp16", "fp32"}
    full = grid.full_grid()
    assert len(set(full)) == len(full) > len(quick)
    for cells in (quick, full):
        assert {c.head_dim for c in cells} >= {64, 128, 256}
        assert any(c.seqlen_q == 1 and not c.grad for c in cells)                    # decoding
        assert any(c.seqlen_q == 4 and not c.grad for c in cells)                    # speculative decoding
        assert any(c.heads_q != c.heads_kv for c in cells)                           # GQA
        assert {c.mask for c in cells} == set(grid.MASK_KINDS)
        assert {c.causal for c in cells} == set(grid.CAUSAL_KINDS)
        assert set(grid.latency_cells()) <= set(cells)                              # bench --latency's shapes
    assert max(c.seqlen_k for c in full) == 32768 and min(c.seqlen_q for c in full if c.grad) == 128
    assert all(c.dtype == "fp32" for c in grid.cpu_grid(quick=False))
    assert grid.limit(quick, 1024) and all(max(c.seqlen_q, c.seqlen_k) <= 1024 for c in grid.limit(quick, 1024))
    with pytest.raises(ValueError, match="causal"):
        grid.Cell("bf16", 1, 2, 2, 4, 4, 8, causal="diagonal")


# ---- tables ---------------------------------------------------------------------------------------------------


def test_table_round_trips_and_rejects_other_formats(tmp_path):
    t = make_table([cell({"triton": 1.0})])
    path = t.save(tmp_path / "t.json")
    loaded = table.TimingTable.load(path)
    assert loaded.key == t.key and loaded.cells == t.cells and loaded.path == str(path)
    data = json.loads(path.read_text())
    data["format"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="format"):
        table.TimingTable.load(path)


def test_the_table_of_this_device_applies(monkeypatch, tmp_path):
    monkeypatch.setattr(table, "device_identity", lambda *_: dict(H100))
    assert table.active_table("cuda", 0) is None
    other = make_table([cell({"cupy": 1.0})], key={"device": "NVIDIA A100", "compute_capability": [8, 0]})
    other.save(table.cache_tables_dir() / "a100.json")
    shipped = make_table([cell({"triton": 1.0})])
    shipped.save(table.SHIPPED_DIR / "h100.json")
    table.clear_cache()
    assert table.active_table("cuda", 0).path.endswith("h100.json")          # shipped, when nothing else
    old_torch = table.TimingTable(dict(H100, torch="1.0"), [cell({"sdpa": 1.0})], {"unix_time": 9.0})
    old_torch.save(table.cache_tables_dir() / "old.json")
    mine = make_table([cell({"cupy": 1.0})], unix_time=2.0)
    mine.save(table.cache_tables_dir() / "mine.json")
    table.clear_cache()
    assert table.active_table("cuda", 0).path.endswith("mine.json")          # the cache, this torch first
    (table.cache_tables_dir() / "broken.json").write_text("{")
    table.clear_cache()
    with pytest.warns(UserWarning, match="broken.json"):
        assert table.active_table("cuda", 0).path.endswith("mine.json")      # a broken file is skipped
    monkeypatch.setenv(table.TABLE_ENV, "off")
    table.clear_cache()
    assert table.active_table("cuda", 0) is None
    monkeypatch.setenv(table.TABLE_ENV, str(table.cache_tables_dir() / "a100.json"))
    table.clear_cache()
    assert table.active_table("cuda", 0).key["device"] == "NVIDIA A100"      # a named file is used as it is


def test_the_shipped_tables_load_and_each_covers_the_quick_grid_of_its_own_gpu():
    """Every table in the package (mhattn/tables/, read when the cache holds none for the device) loads, keys one CUDA
    GPU by name and compute capability (no two tables the same GPU), was complete, holds every cell of the grid
    ``mhattn tune --quick`` times and otherwise only the training shapes ``mhattn tune --quick --head-dim`` adds, and
    names only mhattn's backends (their variants, or pairs of them): a table that fails to load is skipped with a
    warning, and the priority list would decide on that GPU instead."""
    from pathlib import Path

    folder = Path(table.__file__).resolve().parent.parent / "tables"
    tables = [table.TimingTable.load(path) for path in sorted(folder.glob("*.json"))]
    assert {Path(t.path).name for t in tables} >= {"h100.json", "h200.json"}
    identities = [(t.key["device"], tuple(t.key["compute_capability"])) for t in tables]
    assert len(set(identities)) == len(identities), identities
    fields = tuple(grid.Cell.__dataclass_fields__)
    quick = {tuple(getattr(c, f) for f in fields) for c in grid.quick_grid()}
    for t in tables:
        assert t.key["device"].startswith("NVIDIA ") and len(t.key["compute_capability"]) == 2, t.path
        assert t.made.get("complete") and t.made.get("base", {}).get("complete", True), t.path
        cells = {tuple(c[f] for f in fields) for c in t.cells}
        added = {c["head_dim"] for c in t.cells if tuple(c[f] for f in fields) not in quick}
        by_head_dim = {tuple(getattr(c, f) for f in fields) for c in grid.head_dim_cells("cuda", True, added)}
        assert cells == quick | by_head_dim and len(cells) == len(t.cells), t.path
        for c in t.cells:
            for mode in ("fwd_ms", "fwd_bwd_ms"):
                for name in c.get(mode) or {}:
                    assert set(name.split("+")) <= {"triton", "cupy", "sdpa", "sdpa.flash", "sdpa.efficient",
                                                    "sdpa.cudnn"}, (t.path, name)


# ---- the nearest tuned shape ----------------------------------------------------------------------------------


def test_nearest_shape_takes_the_fastest_that_can_run_the_problem():
    t = make_table([
        cell({"triton": 1.0, "sdpa": 0.5}, {"triton": 3.0, "sdpa": 4.0}, seqlen_q=2048, seqlen_k=2048),
        cell({"triton": 4.0, "sdpa": 9.0}, {"triton": 12.0, "sdpa": 9.0}, seqlen_q=8192, seqlen_k=8192, batch=2),
    ])
    near_2k = gpu_problem(seqlen_q=2500, seqlen_k=2500, batch=6)
    evidence = table.nearest(t, near_2k, ["triton", "sdpa", "cupy"])
    assert evidence.chosen == "sdpa" and evidence.mode == "fwd" and evidence.cell["seqlen_q"] == 2048
    assert evidence.times == {"triton": 1.0, "sdpa": 0.5}
    # with grad: forward+backward times decide
    assert table.nearest(t, gpu_problem(needs_grad=True), ["triton", "sdpa"]).chosen == "triton"
    # a backend with a reason against the problem is never chosen, however fast
    assert table.nearest(t, near_2k, ["triton", "cupy"]).chosen == "triton"
    # nearer to 8k
    assert table.nearest(t, gpu_problem(seqlen_q=7000, seqlen_k=7000, batch=2), ["triton", "sdpa"]).chosen == "triton"
    # the distance: 2|dlog2 d| + |dlog2 Nq| + |dlog2 Nk| + 0.5|dlog2 B*Hq| + |dlog2 group|
    assert table.distance(gpu_problem(seqlen_q=4096, seqlen_k=4096, batch=4), t.cells[0]) == pytest.approx(2.5)


def test_forward_backward_times_within_the_tie_go_to_the_faster_forward():
    fwd = {"triton": 1.5, "cupy": 1.7, "sdpa": 1.6}
    # cupy fastest by forward+backward, triton+cupy within TIE of it with triton's faster forward
    t = make_table([cell(fwd, {"triton": 7.0, "cupy": 6.6, "triton+cupy": 6.6 * (1 + table.TIE / 2), "sdpa": 7.0})])
    candidates = ["triton", "cupy", "sdpa", "triton+cupy"]
    evidence = table.nearest(t, gpu_problem(needs_grad=True), candidates)
    assert evidence.chosen == "triton+cupy"
    assert "triton+cupy" in str(evidence) and "within 3% of the fastest, with the faster forward" in str(evidence)
    # without the pair, nothing else is within the tie: the fastest forward+backward
    assert table.nearest(t, gpu_problem(needs_grad=True), ["triton", "cupy", "sdpa"]).chosen == "cupy"
    # past the tie the forward does not matter
    far = make_table([cell(fwd, {"triton": 7.0, "cupy": 6.6, "triton+cupy": 6.6 * (1 + 2 * table.TIE)})])
    assert table.nearest(far, gpu_problem(needs_grad=True), candidates).chosen == "cupy"
    # a tied backend whose forward the cell did not time leaves the fastest forward+backward
    untimed = make_table([cell({"triton": 1.5}, {"triton": 6.7, "cupy": 6.6})])
    assert table.nearest(untimed, gpu_problem(needs_grad=True), ["triton", "cupy"]).chosen == "cupy"
    # without grad the forward times alone decide
    assert table.nearest(t, gpu_problem(), candidates).chosen == "triton"


def test_nearest_shape_needs_the_same_dtype_causal_and_mask_kind_and_a_close_cell():
    t = make_table([cell({"triton": 1.0, "sdpa": 0.5})])
    candidates = ["triton", "sdpa"]
    assert table.nearest(t, gpu_problem(dtype=torch.float16), candidates) is None
    assert table.nearest(t, gpu_problem(features=frozenset({"causal"})), candidates) is None
    assert table.nearest(t, gpu_problem(features=frozenset({"bool_mask"})), candidates) is None
    assert table.nearest(t, gpu_problem(seqlen_q=1, seqlen_k=2048), candidates) is None          # decode is far
    assert table.nearest(t, gpu_problem(head_dim=16, head_dim_v=16), candidates) is None         # 2 * 3 > 4
    # a causal problem whose diagonal hides no key (decoding at the end) is not causal for the lookup
    decode = make_table([cell({"triton": 2.0, "sdpa": 1.0}, seqlen_q=1, seqlen_k=8192, causal="bottom_right",
                              grad=False)])
    problem = gpu_problem(seqlen_q=1, seqlen_k=8192, diag_offset=8191, features=frozenset({"causal"}))
    assert table.nearest(decode, problem, candidates).chosen == "sdpa"
    assert table.nearest(decode, gpu_problem(seqlen_q=1, seqlen_k=8192, needs_grad=True), candidates) is None


# ---- the dispatcher's hook ------------------------------------------------------------------------------------


@contextlib.contextmanager
def bf16_gpu_backends(monkeypatch, names):
    """Backends ``names`` that can run any bf16 problem on a GPU (no kernels), first in the sm_90 priority list in
    this order, on a device that matches the H100 tables; removed afterwards."""
    from mhattn.backends.base import Backend, Capabilities

    class Runs(Backend):
        capabilities = Capabilities(device_types=frozenset({"cuda"}), dtypes=frozenset({torch.bfloat16}))

        def __init__(self, name):
            self.name = name

    monkeypatch.setattr(table, "device_identity", lambda *_: dict(H100))
    saved = list(dispatch.PRIORITY)
    for name in names:
        mhattn.register_backend(Runs(name))
    try:
        mhattn.set_priority("cuda", list(names), (9, 0))
        yield
    finally:
        dispatch.PRIORITY[:] = saved
        for name in names:
            mhattn.unregister_backend(name)
        dispatch.clear_cache()


def test_automatic_selection_uses_the_table_and_falls_back_to_the_priority_list(monkeypatch):
    with bf16_gpu_backends(monkeypatch, ("slow_one", "fast_one")):
        problem = gpu_problem()
        assert dispatch.decide(problem, "auto", "test").chosen == "slow_one"          # no table: priority
        t = make_table([cell({"slow_one": 2.0, "fast_one": 1.0})])
        monkeypatch.setattr(table, "active_table", lambda *_: t)
        dispatch.clear_cache()
        decision = dispatch.decide(problem, "auto", "test")
        assert decision.chosen == "fast_one" and decision.measured.chosen == "fast_one"
        text = str(decision)
        assert "measured (forward) at the nearest tuned shape" in text and "fast_one 1 ms (fastest)" in text
        # a backend asked for by name is never overridden by the table
        assert dispatch.decide(problem, "slow_one", "test").chosen == "slow_one"
        # far from every tuned shape: the priority list again
        assert dispatch.decide(gpu_problem(seqlen_q=64, seqlen_k=64), "auto", "test").chosen == "slow_one"


def test_a_differentiated_call_is_chosen_by_forward_backward_time_in_eager_and_compiled_code(monkeypatch):
    """Automatic selection weighs forward+backward time only where autograd will differentiate the call: the same
    inputs with requires_grad get the backend fastest forward+backward, under no_grad (or detached) the one fastest
    forward, in eager code, in code compiled with torch.compile (whose custom op never sees requires_grad itself),
    and in explain()."""
    from mhattn.reference import ReferenceBackend

    ran = []

    class Counted(ReferenceBackend):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def forward(self, q, k, v, params):
            ran.append(self.name)
            return super().forward(q, k, v, params)

        def backward(self, *args, **kwargs):
            ran.append(self.name + " backward")
            return super().backward(*args, **kwargs)

    cpu = {"device": "test cpu", "compute_capability": None}
    monkeypatch.setattr(table, "device_identity", lambda *_: dict(cpu))
    saved = list(dispatch.PRIORITY)
    for name in ("fast_forward", "fast_training"):
        mhattn.register_backend(Counted(name))
    try:
        mhattn.set_priority("cpu", ["fast_forward", "fast_training"])
        times = ({"fast_forward": 1.0, "fast_training": 2.0}, {"fast_forward": 9.0, "fast_training": 3.0})
        tuned = make_table([cell(*times, dtype="fp32", batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_k=64,
                                 head_dim=16)], key=cpu)
        monkeypatch.setattr(table, "active_table", lambda *_: tuned)
        dispatch.clear_cache()
        q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))

        def backend_of(fn, *tensors):
            ran.clear()
            fn(*tensors)
            return ran[-1]

        eager = lambda q, k, v: mhattn.attention(q, k, v)  # noqa: E731
        compiled = torch.compile(eager, backend="aot_eager", fullgraph=True)
        for fn in (eager, compiled):
            assert backend_of(fn, q, k, v) == "fast_training"
            assert backend_of(fn, q.detach(), k.detach(), v.detach()) == "fast_forward"
            with torch.no_grad():
                assert backend_of(fn, q, k, v) == "fast_forward"
        assert mhattn.explain(q, k, v).chosen == "fast_training"
        with torch.no_grad():
            assert mhattn.explain(q, k, v).chosen == "fast_forward"
        ran.clear()
        compiled(q, k, v).sum().backward()  # the compiled backward runs where its forward ran
        assert ran == ["fast_training", "fast_training backward"] and q.grad is not None
    finally:
        dispatch.PRIORITY[:] = saved
        for name in ("fast_forward", "fast_training"):
            mhattn.unregister_backend(name)
        dispatch.clear_cache()


def test_tune_compiles_the_cupy_variants_of_its_cells_ahead(monkeypatch):
    """Before timing, `mhattn tune` compiles the CuPy variants of its cells' head dims (and those without one) in
    parallel, the Hopper family too on sm_90, and none of the head dims it does not time."""
    from mhattn.backends.cupy import build

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    monkeypatch.setattr(build, "run_cupy", lambda args, archs, head_dims=None, leave_out=(): asked.append(
        (archs, head_dims, leave_out)))
    tune_cli._compile_cupy_kernels(io.StringIO(), {128, 64}, (("SOFTCAP", 1),))
    assert asked == [(["sm_90", "sm_90a"], [64, 128], (("SOFTCAP", 1),))]
    tasks = build.tasks_for(["sm_90", "sm_90a"], head_dims=[64, 128])
    head_dims = {dict(variant.defines).get("HEAD_DIM") for variant, _, _ in tasks}
    assert head_dims == {None, 64, 128} and any(variant.arch_features == "a" for variant, _, _ in tasks)
    assert len(tasks) < len(build.tasks_for(["sm_90", "sm_90a"]))
    # A head dim between buckets takes the variants of its bucket (80 runs the d = 96 kernels).
    assert {dict(variant.defines).get("HEAD_DIM") for variant, _, _ in build.tasks_for(["sm_90"], head_dims=[80])} == {
        None, 96}


def test_tune_leaves_out_of_its_ahead_compile_only_variants_no_quick_grid_cell_launches(monkeypatch):
    """The variants `mhattn tune --quick` compiles ahead on an H100 leave out those with features no cell uses
    (cupy_defines_left_out): every quick-grid cell, forward and (where it times one) backward, run through
    mhattn.attention on the CuPy backend's sm_90 host code with a launcher that records what it prepares (tensor maps
    stood in for: no driver here), launches only variants in the compiled set, and the set is well under the
    head dims' full one."""
    from mhattn.backends.cupy import CupyBackend, build, ops
    from mhattn.tuning import measure

    cells = grid.quick_grid()
    left_out = tune_cli.cupy_defines_left_out(cells)
    head_dims = sorted({c.head_dim for c in cells})
    compiled = {variant for variant, _, _ in build.tasks_for(["sm_90", "sm_90a"], head_dims=head_dims,
                                                              leave_out=left_out)}
    assert len(compiled) * 3 < len(build.tasks_for(["sm_90", "sm_90a"], head_dims=head_dims))

    class Maps:  # tensor_maps.RowMaps without the driver: an encoding stands in as an int
        def __init__(self, t, box_rows, wrap=None):
            pass

        def __call__(self, address):
            return address

    class Recording:
        tensor_maps = True

        def __init__(self):
            self.variants = set()

        def prepare(self, variant, grid_, template, device, cc):
            self.variants.add(variant)
            return lambda pointers: None

    class RecordedCupy(CupyBackend):
        name = "cupy-recorded"
        capabilities = dataclasses.replace(CupyBackend.capabilities, device_types=frozenset({"cpu"}))

        def unavailable(self):
            return []

    monkeypatch.setattr(ops, "sm_count", lambda device: 132)
    monkeypatch.setattr(ops.tensor_maps, "RowMaps", Maps)
    launcher = Recording()
    mhattn.register_backend(RecordedCupy(launcher=launcher, compute_capability=(9, 0)))
    try:
        for c in cells:
            if c.dtype not in ("bf16", "fp16"):
                continue
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[c.dtype]
            # Uninitialised inputs of the cell's shapes (nothing reads them: the launches record and return).
            q = torch.empty(c.batch, c.heads_q, c.seqlen_q, c.head_dim, dtype=dtype, requires_grad=c.grad)
            k, v = (torch.empty(c.batch, c.heads_kv, c.seqlen_k, c.head_dim, dtype=dtype, requires_grad=c.grad)
                    for _ in range(2))
            kwargs = measure.call_kwargs(c, "cpu", lambda *shape: torch.zeros(shape, dtype=dtype))
            out = mhattn.attention(q, k, v, backend="cupy-recorded", **kwargs)
            if c.grad:
                out.backward(torch.empty_like(out))
    finally:
        mhattn.unregister_backend("cupy-recorded")
    launched = launcher.variants
    assert any(v.arch_features == "a" for v in launched) and any(v.kernel == "fwd" for v in launched)
    assert launched <= compiled, sorted(v.label for v in launched - compiled)


# ---- `mhattn tune` on the CPU -----------------------------------------------------------------------------------


@pytest.mark.parametrize("isolate", [False, True])
def test_tune_writes_a_table_that_automatic_selection_reads(isolate, capsys):
    status = tune_cli.tune(quick=True, device="cpu", max_n=128, warmup_ms=0.5, rep_ms=1.0, isolate=isolate,
                           progress=False)
    out = capsys.readouterr().out
    assert status == 0, out
    written = list(table.cache_tables_dir().glob("*.json"))
    assert len(written) == 1 and f"wrote {written[0]}" in out
    t = table.TimingTable.load(written[0])
    assert t.key["device"] == table.device_identity("cpu")["device"] and t.key["torch"] == torch.__version__
    assert [c["seqlen_q"] for c in t.cells] == [128, 128]
    for c in t.cells:  # forward+backward: the two backends, and their pair where each was faster at one half
        assert set(c["fwd_ms"]) == {"sdpa", "reference"}
        assert set(c["fwd_bwd_ms"]) - {"sdpa+reference", "reference+sdpa"} == {"sdpa", "reference"}
    q = torch.randn(1, 8, 128, 64, requires_grad=True)
    decision = mhattn.explain(q, q, q)
    assert decision.measured is not None and decision.measured.table.path == str(written[0])
    # The cell's forward+backward times, with times within table.TIE of the fastest broken by the forward (the CPU's
    # two backends can land that close).
    assert decision.measured.times == t.cells[0]["fwd_bwd_ms"]
    assert decision.chosen == table._fastest(t.cells[0]["fwd_bwd_ms"], t.cells[0]["fwd_ms"])
    assert "measured (forward+backward)" in str(decision)


def test_tune_in_two_passes_keeps_each_host_loop_s_smallest_time(monkeypatch, capsys):
    """--passes 2: the grid timed twice, one pass after the other; a time that may be a host loop's (under
    measure.HOST_BOUND_MS) the smaller of the two, a GPU time the first pass's (table.merged)."""
    from mhattn.benchmark import supervisor

    times = iter([0.3, 0.1])  # the first pass's, then the second's

    def run_tasks(tasks, **kwargs):
        ms = next(times)
        rows = [dict(t["cell"], kind="tune", status="ok", fwd_ms={"sdpa": ms, "reference": 2.0}, fwd_bwd_ms={},
                     skipped={}) for t in tasks]
        return supervisor.Outcome(rows, notes=[f"pass at {ms}"])

    monkeypatch.setattr(supervisor, "run_tasks", run_tasks)
    status = tune_cli.tune(quick=True, device="cpu", max_n=128, progress=False, passes=2)
    out = capsys.readouterr().out
    assert status == 0, out
    t = table.TimingTable.load(next(table.cache_tables_dir().glob("*.json")))
    assert t.made["passes"] == 2 and t.made["complete"]
    assert all(c["fwd_ms"] == {"sdpa": 0.1, "reference": 2.0} for c in t.cells) and len(t.cells) == 2
    assert "note: pass at 0.3" in out and "note: pass at 0.1" in out


def test_tune_and_conformance_tune_on_the_command_line(monkeypatch):
    calls = []
    monkeypatch.setattr(tune_cli, "tune", lambda **kwargs: calls.append(kwargs) or 0)
    from mhattn.cli import main

    assert main(["tune", "--quick", "--device", "cpu", "--max-n", "128", "--backend", "sdpa,reference"]) == 0
    assert calls[-1]["quick"] and calls[-1]["backends"] == ["sdpa", "reference"] and calls[-1]["max_n"] == 128
    assert main(["conformance", "--quick", "--backend", "sdpa", "--feature", "basic", "--dtype", "fp32",
                 "--no-progress", "--tune"]) == 0
    assert calls[-1]["quick"] and calls[-1]["device"] == "cpu" and "sdpa" in calls[-1]["backends"]


def test_a_backend_with_a_wrong_output_is_not_timed():
    from mhattn.reference.backend import ReferenceBackend
    from mhattn.tuning.measure import time_cell

    class Wrong(ReferenceBackend):
        name = "wrong"

        def forward(self, q, k, v, params):
            out, lse = super().forward(q, k, v, params)
            return out * 2, lse

    mhattn.register_backend(Wrong())
    try:
        row = time_cell(grid.Cell("fp32", 1, 2, 2, 64, 64, 16), "cpu", 0.5, 1.0, backends=["wrong", "sdpa"])
    finally:
        mhattn.unregister_backend("wrong")
    assert "differs from torch SDPA" in row["skipped"]["wrong"] and "wrong" not in row["fwd_ms"]
    assert set(row["fwd_ms"]) == set(row["fwd_bwd_ms"]) == {"sdpa"}


def test_bench_has_an_auto_column_and_reports_it_against_the_fastest():
    from mhattn.benchmark import protocol, report

    table_ = protocol.implementations()
    assert "auto" in table_ and table_["auto"].unsupported(*[torch.randn(1, 2, 8, 16)] * 3, causal=True) == []

    def row(impl, fwd, both, n=1024):
        return {"kind": "attn", "impl": impl, "family": "mhattn", "dtype": "bfloat16", "d": 64, "causal": False,
                "n": n, "b": 16, "h": 32, "status": {"fwd": "ok", "fwd_bwd": "ok"}, "fwd_tflops": fwd,
                "fwd_bwd_tflops": both}

    rows = [row("auto", 300, 200), row("triton", 300, 150), row("sdpa-cudnn", 400, 200),
            row("auto", 100, 100, n=2048), row("triton", 100, 100, n=2048)]
    text = "\n".join(report.target_lines({"rows": rows}))
    assert "forward          1/2 cells meet; worst 0.75x at bf16 d=64 N=1k (fastest sdpa-cudnn)" in text
    assert "forward+backward 2/2 cells meet" in text


def test_one_progress_display_serves_conformance_bench_and_tune():
    import io

    from mhattn.conformance.cases import Case
    from mhattn.conformance.suite import finish_case
    from mhattn.progress import Progress

    class Result:
        status = "fail"
        case = Case(backend="reference", feature="basic")

        def summary(self):
            return "out: FAIL"

    stream = io.StringIO()
    progress = Progress(2, stream=stream, title="conformance")
    progress.start("a case")
    finish_case(progress, Result())
    progress.close()
    text = stream.getvalue()
    assert "FAIL reference basic" in text and "reproduce: mhattn conformance --backend reference" in text
    assert "1/2 1 failed" in text


def test_short_calls_count_their_host_loop_taking_turns(monkeypatch):
    """A call shorter than HOST_BOUND_MS on the GPU timer counts the slower of that and its best host loop, the
    backends' loops taking turns (HOST_LOOP_ROUNDS rounds); a longer call is never looped, nor any on the CPU; a
    backend whose loop fails is left out, with why."""
    from mhattn.benchmark import latency
    from mhattn.tuning import measure

    loops = []
    speeds = {"a": iter([90.0, 30.0, 60.0, 70.0, 80.0]), "b": iter([20.0, 95.0, 40.0, 45.0, 50.0])}

    def host_loop_us(fn, calls, device, rounds=3):
        loops.append((fn, calls, rounds))
        if fn == "broken":
            raise RuntimeError("no memory")
        return next(speeds[fn])

    monkeypatch.setattr(latency, "host_loop_us", host_loop_us)
    times = {"a": 0.01, "b": 0.05, "c": 2 * measure.HOST_BOUND_MS, "d": 0.01}
    calls = {"a": "a", "b": "b", "c": "c", "d": "broken"}
    skipped = {}
    got = measure.with_host_loops(times, calls, torch.device("cuda"), skipped)
    assert got == {"a": 0.03, "b": 0.05, "c": 2 * measure.HOST_BOUND_MS}  # b's GPU time is the longer
    assert skipped == {"d": "error: RuntimeError: no memory"}
    assert [fn for fn, _, _ in loops] == ["a", "b", "broken"] + ["a", "b"] * (measure.HOST_LOOP_ROUNDS - 1)
    assert all(calls == measure.HOST_LOOP_CALLS and rounds == 1 for _, calls, rounds in loops)
    assert measure.with_host_loops(times, calls, torch.device("cpu"), {}) == times

# ---- CUDA graph capture: graph-replay times decide ------------------------------------------------------------


def decode_cell(**fields):
    """A short decoding cell as the H100 measured it: sdpa the cheapest call in a host loop, triton the fastest
    kernel replayed from a graph, cupy timed too long to replay."""
    row = cell({"triton": 0.09, "sdpa": 0.075, "cupy": 0.6}, **{**dict(batch=1, heads_q=32, heads_kv=8, seqlen_q=4,
                                                                        seqlen_k=1024, grad=False), **fields})
    row["fwd_graph_ms"] = {"triton": 0.015, "sdpa": 0.042}
    return row


def test_during_capture_graph_replay_times_decide_a_forward():
    t = make_table([decode_cell(grad=True)])
    t.cells[0]["fwd_bwd_ms"] = {"triton": 0.5, "sdpa": 0.3}
    problem = gpu_problem(batch=1, heads_q=32, heads_kv=8, seqlen_q=4, seqlen_k=1024)
    candidates = ["triton", "sdpa", "cupy"]
    eager = table.nearest(t, problem, candidates)
    assert eager.chosen == "sdpa" and not eager.replayed and "replayed" not in str(eager)
    captured = table.nearest(t, problem, candidates, replayed=True)
    assert captured.chosen == "triton" and captured.replayed
    # a backend the cell did not replay keeps its forward time
    assert captured.times == {"triton": 0.015, "sdpa": 0.042, "cupy": 0.6}
    assert "measured (forward, replayed from a CUDA graph)" in str(captured)
    # without triton, the replayed sdpa beats cupy's (unreplayed) forward
    assert table.nearest(t, problem, ["sdpa", "cupy"], replayed=True).chosen == "sdpa"
    # a differentiated call is chosen by forward+backward time, captured or not
    trained = table.nearest(t, gpu_problem(batch=1, heads_q=32, heads_kv=8, seqlen_q=4, seqlen_k=1024,
                                           needs_grad=True), candidates, replayed=True)
    assert trained.chosen == "sdpa" and trained.mode == "fwd_bwd" and not trained.replayed
    # a table made before graph replays were timed: the forward times, as outside capture
    old = make_table([{k: val for k, val in decode_cell().items() if k != "fwd_graph_ms"}])
    assert table.nearest(old, problem, candidates, replayed=True).chosen == "sdpa"
    # calls that are not host-bound (forward time within REPLAY_MARGIN of the replay) keep their forward times
    gpu_bound = cell({"triton": 0.40, "sdpa": 0.42}, grad=False)
    gpu_bound["fwd_graph_ms"] = {"triton": 0.41, "sdpa": 0.36}
    evidence = table.nearest(make_table([gpu_bound]), gpu_problem(), ["triton", "sdpa"], replayed=True)
    assert evidence.chosen == "triton" and not evidence.replayed and evidence.times == {"triton": 0.40, "sdpa": 0.42}
    # one host-bound backend among GPU-bound ones: its replay alone counts
    gpu_bound["fwd_ms"]["sdpa"] = 0.5
    evidence = table.nearest(make_table([gpu_bound]), gpu_problem(), ["triton", "sdpa"], replayed=True)
    assert evidence.chosen == "sdpa" and evidence.times == {"triton": 0.40, "sdpa": 0.36}


def test_an_automatic_request_on_a_gpu_is_marked_during_capture(monkeypatch):
    capturing = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing.append(1) or True)
    assert dispatch.requested_on(None, "cuda") == ("auto", "automatic selection" + dispatch.CAPTURE_NOTE)
    with dispatch.use_backend("auto"):
        assert dispatch.requested_on(None, "cuda") == ("auto", "use_backend()" + dispatch.CAPTURE_NOTE)
    assert len(capturing) == 2
    # a backend asked for by name, or a call on the CPU: as requested, and the capture state is not queried
    assert dispatch.requested_on("reference", "cuda") == ("reference", "the backend= argument")
    assert dispatch.requested_on(None, "cpu") == ("auto", "automatic selection")
    assert len(capturing) == 2
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert dispatch.requested_on(None, "cuda") == ("auto", "automatic selection")


def test_automatic_selection_during_capture_takes_the_fastest_replayed(monkeypatch):
    with bf16_gpu_backends(monkeypatch, ("cheap_call", "fast_kernel")):
        row = cell({"cheap_call": 0.07, "fast_kernel": 0.09}, batch=1, heads_q=32, heads_kv=8, seqlen_q=1,
                   seqlen_k=8192)
        row["fwd_graph_ms"] = {"cheap_call": 0.03, "fast_kernel": 0.012}
        monkeypatch.setattr(table, "active_table", lambda *_: make_table([row]))
        dispatch.clear_cache()
        problem = gpu_problem(batch=1, heads_q=32, heads_kv=8, seqlen_q=1, seqlen_k=8192)
        eager = dispatch.decide(problem, "auto", "automatic selection")
        assert eager.chosen == "cheap_call"
        captured = dispatch.decide(problem, "auto", "automatic selection" + dispatch.CAPTURE_NOTE)
        assert captured.chosen == "fast_kernel" and captured.measured.replayed
        assert "during CUDA graph capture" in str(captured) and "replayed from a CUDA graph" in str(captured)
        # the cached decisions keep the two apart (the request is part of every key)
        assert dispatch.select(problem, "auto", "automatic selection").name == "cheap_call"
        assert dispatch.select(problem, "auto", "automatic selection" + dispatch.CAPTURE_NOTE).name == "fast_kernel"
        assert dispatch.select(problem, "auto", "automatic selection").name == "cheap_call"


def test_tune_replays_short_forwards_from_a_cuda_graph_where_it_can(monkeypatch):
    from mhattn.benchmark import timing
    from mhattn.tuning import measure

    replays = []

    def graph_replay_ms(fn, device, flush_l2):
        assert flush_l2  # the inputs come from memory, as the GPU timer's
        replays.append(fn)
        if fn == "uncapturable":
            raise RuntimeError("operation not permitted when stream is capturing")
        return {"a": 0.01, "b": 0.02}[fn]

    monkeypatch.setattr(timing, "graph_replay_ms", graph_replay_ms)
    monkeypatch.setattr(timing, "release_memory", lambda device: None)
    calls = {"a": "a", "b": "b", "c": "uncapturable"}
    assert measure.graph_replays(calls, torch.device("cuda")) == {"a": 0.01, "b": 0.02}
    # the table keeps them (a worker's row becomes a table cell)
    row = dict(decode_cell(), status="ok", kind="tune", wall_s=1.0)
    assert tune_cli._table_row(row)["fwd_graph_ms"] == {"triton": 0.015, "sdpa": 0.042}
    assert "kind" not in tune_cli._table_row(row)
    assert replays == ["a", "b", "uncapturable"]
    assert measure.graph_replays(calls, torch.device("cpu")) == {}   # nothing to replay on the CPU
    assert replays == ["a", "b", "uncapturable"]


@pytest.mark.gpu
def test_gpu_a_captured_automatic_call_runs_the_fastest_replayed_backend(monkeypatch):
    """With a table whose host-loop times favour sdpa and whose graph replays favour triton at a decoding shape,
    auto runs sdpa eagerly and triton inside a CUDA graph capture (after the usual warm-up on a side stream, which
    ran sdpa), and the replayed graph gives SDPA's output (outputs poisoned before the replays)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    name = torch.cuda.get_device_name()
    capability = list(torch.cuda.get_device_capability())
    monkeypatch.setattr(table, "device_identity", lambda *_: {"device": name, "compute_capability": capability})
    row = decode_cell()
    monkeypatch.setattr(table, "active_table", lambda *_: make_table([row], key={"device": name,
                                                                                "compute_capability": capability}))
    dispatch.clear_cache()
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(1, 32, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    assert mhattn.explain(q, k, v, enable_gqa=True).chosen == "sdpa"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            mhattn.attention(q, k, v, enable_gqa=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decision = mhattn.explain(q, k, v, enable_gqa=True)
        out = mhattn.attention(q, k, v, enable_gqa=True)
    assert decision.chosen == "triton" and decision.source.endswith(dispatch.CAPTURE_NOTE)
    for seed in (1, 2):
        out.fill_(float("nan"))
        q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen.manual_seed(seed)))
        graph.replay()
        with sdpa_kernel(SDPBackend.MATH):
            want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        assert (out.float() - want).abs().max().item() < 2e-2
    assert mhattn.explain(q, k, v, enable_gqa=True).chosen == "sdpa"   # outside capture again


def test_merged_tables_keep_the_smallest_host_loop_time_and_the_first_table_s_gpu_times_and_replays(tmp_path, capsys):
    """Times under the tuner's HOST_BOUND_MS (perhaps host loops, which a busy host only lengthens) take the smallest of the tables';
    longer ones (GPU timings) the first table's where it has one; replays the first table's alone."""
    a = make_table([decode_cell(), cell({"triton": 1.0, "sdpa": 2.0}, {"triton": 4.0})], date="a")
    b_decode = decode_cell()
    b_decode["fwd_ms"] = {"triton": 0.05, "sdpa": 0.08, "cupy": 0.7}
    b_decode["fwd_graph_ms"] = {"triton": 0.001}
    b = make_table([b_decode, cell({"triton": 1.5, "sdpa": 1.0}, {"triton": 3.0, "sdpa": 5.0}),
                    cell({"triton": 9.0}, seqlen_q=8192, seqlen_k=8192)], date="b")
    m = table.merged([a, b])
    assert m.made["merged"] == ["b"] and len(m.cells) == 3
    assert m.cells[0]["fwd_ms"] == {"triton": 0.05, "sdpa": 0.075, "cupy": 0.6}  # a's cupy 0.6 (GPU-bound, first)
    assert m.cells[0]["fwd_graph_ms"] == {"triton": 0.015, "sdpa": 0.042}   # the first table's replays
    assert m.cells[1]["fwd_ms"] == {"triton": 1.0, "sdpa": 2.0}             # GPU times: the first table's
    assert m.cells[1]["fwd_bwd_ms"] == {"triton": 4.0}                      # (b's GPU time of sdpa is not taken)
    # a GPU time of the first table under a later table's host loop: the smaller (the later one's) is kept; a backend
    # only a later table timed in the cell comes with its host-loop time, never with a GPU time
    assert table.merged([make_table([cell({"triton": 0.6})]), make_table([cell({"triton": 0.4, "cupy": 0.3,
                                                                                "sdpa+triton": 0.55})])]).cells[0][
        "fwd_ms"] == {"triton": 0.4, "cupy": 0.3}
    assert m.cells[2]["seqlen_q"] == 8192 and "fwd_graph_ms" not in m.cells[2]
    assert a.cells[0]["fwd_ms"]["triton"] == 0.09                           # the inputs are not changed
    # a cell only a later table has comes without its replays (they are the first table's alone)
    later_only = table.merged([make_table([cell({"triton": 1.0})]), a]).cells
    assert later_only[1]["seqlen_q"] == 4 and "fwd_graph_ms" not in later_only[1]
    other = make_table([decode_cell()], key={"device": "NVIDIA A100", "compute_capability": [8, 0]})
    with pytest.raises(ValueError, match="cannot merge"):
        table.merged([a, other])
    # on the command line
    paths = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    a.save(paths[0])
    b.save(paths[1])
    out = tmp_path / "m.json"
    assert tune_cli.run(argparse.Namespace(merge=paths, output=str(out))) == 0
    assert table.TimingTable.load(out).cells[1]["fwd_ms"] == {"triton": 1.0, "sdpa": 2.0}
    assert "3 cells from 2 tables" in capsys.readouterr().out


# ---- variants: a backend with one choice pinned (sdpa.cudnn, ...) ------------------------------------------------


def test_automatic_selection_weighs_a_variant_only_where_its_base_is_a_candidate_and_the_table_timed_it(monkeypatch):
    """A registered variant (Backend.variant_of) is never in the priority list: automatic selection takes it where the
    nearest tuned shape measured it fastest and its base backend could run the problem, never on the fallback."""
    from mhattn.backends.base import Backend, Capabilities

    class Pinned(Backend):
        capabilities = Capabilities(device_types=frozenset({"cuda"}), dtypes=frozenset({torch.bfloat16}))
        name, variant_of = "base_one.pinned", "base_one"

    with bf16_gpu_backends(monkeypatch, ("base_one", "other_one")):
        mhattn.register_backend(Pinned())
        try:
            problem = gpu_problem()
            assert dispatch.decide(problem, "auto", "test").chosen == "base_one"  # no table: the priority list
            t = make_table([cell({"base_one": 2.0, "other_one": 1.5, "base_one.pinned": 1.0})])
            monkeypatch.setattr(table, "active_table", lambda *_: t)
            dispatch.clear_cache()
            decision = dispatch.decide(problem, "auto", "test")
            assert decision.chosen == "base_one.pinned" and "base_one.pinned 1 ms (fastest)" in str(decision)
            # within TIE of its base, a variant gives way to it (most often one kernel; the base follows torch's
            # own choice); beyond TIE it keeps its lead
            for base_ms, expected in ((1.02, "base_one"), (1.04, "base_one.pinned")):
                t.cells[0]["fwd_ms"] = {"base_one": base_ms, "other_one": 1.5, "base_one.pinned": 1.0}
                dispatch.clear_cache()
                decision = dispatch.decide(problem, "auto", "test")
                assert decision.chosen == expected, str(decision)
                assert ("within 3% of its variant base_one.pinned" in str(decision)) == (expected == "base_one")
            # its base cannot run the problem: neither can the variant be chosen, however fast it was measured
            dispatch.PRIORITY.insert(0, ("cuda", (9, 0), ("other_one",)))
            dispatch.clear_cache()
            assert dispatch.decide(problem, "auto", "test").chosen == "other_one"
        finally:
            mhattn.unregister_backend("base_one.pinned")


def test_tune_times_the_sdpa_kernels_pinned_only_where_sdpa_s_forward_is_short():
    from mhattn.tuning import measure

    names = measure.backends_to_time("cuda")
    at = names.index("sdpa")
    assert names[at:at + 4] == ["sdpa", "sdpa.flash", "sdpa.efficient", "sdpa.cudnn"]
    assert not [n for n in measure.backends_to_time("cpu") if "." in n]  # on the CPU torch has one kernel
    short = {"fwd_ms": {"sdpa": measure.HOST_BOUND_MS / 2}}
    long = {"fwd_ms": {"sdpa": measure.HOST_BOUND_MS * 2}}
    assert measure.variant_skipped("sdpa.efficient", short) is None
    assert "only where sdpa's forward takes under" in measure.variant_skipped("sdpa.efficient", long)
    assert "sdpa, which was not timed here" in measure.variant_skipped("sdpa.cudnn", {"fwd_ms": {}})
    assert measure.variant_skipped("triton", long) is None
    # a pair never takes a variant's half (its calls go through mhattn's autograd Function)
    row = {"fwd_ms": {"sdpa.efficient": 0.01, "sdpa": 0.02, "triton": 0.03},
           "fwd_bwd_ms": {"sdpa.efficient": 0.2, "sdpa": 0.3, "triton": 0.25}}
    assert measure.fastest_apart(row) == ("sdpa", "triton")


def test_tune_times_a_one_row_decoding_step_without_a_mask_and_longer_steps_with_the_bottom_right_one():
    """One query row on the bottom-right diagonal sees every key: timed as users call it, with no mask (the call the
    front end's memo serves); a four-row step keeps its causal_lower_right mask."""
    from torch.nn.attention.bias import CausalBias

    from mhattn.tuning import measure

    one = grid.Cell("fp32", 1, 4, 2, 1, 64, 16, causal="bottom_right")
    four = grid.Cell("fp32", 1, 4, 2, 4, 64, 16, causal="bottom_right")
    assert "attn_mask" not in measure.make_inputs(one, "cpu")[4]
    assert isinstance(measure.make_inputs(four, "cpu")[4]["attn_mask"], CausalBias)
    assert table._bucket_of_cell(dict(one.as_dict(), mask="none"))[1] is False  # the bucket of a maskless call


def test_tune_times_the_forward_untracked_and_the_forward_backward_tracked(monkeypatch):
    """fwd_ms decides calls that autograd does not track: the forward is timed on inputs that need no gradient (no
    autograd node, no lse kept), forward+backward on inputs that do."""
    from mhattn.benchmark import timing
    from mhattn.tuning import measure

    timed = []

    def bench_ms(fn, warmup_ms, rep_ms, device, settle_ms=0.0):
        result = fn()
        timed.append("fwd_bwd" if isinstance(result, tuple) else ("tracked" if result.requires_grad else "fwd"))
        settles.add(settle_ms)
        return 1.0

    settles = set()
    monkeypatch.setattr(timing, "bench_ms", bench_ms)
    row = measure.time_cell(grid.Cell("fp32", 1, 2, 2, 32, 32, 16), "cpu", 0.1, 0.1, backends=["sdpa", "reference"])
    assert set(row["fwd_ms"]) == set(row["fwd_bwd_ms"]) == {"sdpa", "reference"}
    assert timed.count("fwd") == 2 and timed.count("tracked") == 0 and timed.count("fwd_bwd") >= 2
    # Every timing first puts the GPU under load for measure.SETTLE_MS (timing.settle: an idle GPU starts at boost
    # clocks that training does not keep).
    assert settles == {measure.SETTLE_MS} and measure.SETTLE_MS >= 50


@pytest.mark.gpu
def test_gpu_settle_keeps_the_gpu_busy_for_about_the_time_asked():
    """On a GPU: a call of a few milliseconds (torch.cuda._sleep) is run back to back for about settle_ms of GPU time,
    not queued without bound; a call of microseconds runs twice (a first call and the one timed alone)."""
    import time

    from mhattn.benchmark import timing

    calls = []
    cycles = [0]

    def fn():
        calls.append(1)
        torch.cuda._sleep(cycles[0])

    timing.settle(fn, 1.0)  # warms CUDA up
    cycles[0] = 1000
    calls.clear()
    timing.settle(fn, 30.0)
    assert len(calls) == 2
    # about 3 ms a call at 1-2 GHz
    cycles[0] = 5_000_000
    calls.clear()
    start = time.perf_counter()
    timing.settle(fn, 30.0)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    assert 4 <= len(calls) <= 40 and 30.0 <= elapsed_ms <= 150.0, (len(calls), elapsed_ms)


@pytest.mark.parametrize("call_ms, calls", [(2.0, 2 + 10), (0.05, 2)])
def test_settle_loads_the_gpu_for_the_time_asked_by_calls_it_counts(monkeypatch, call_ms, calls):
    """timing.settle runs a call that keeps the GPU busy (SETTLE_MIN_MS or more, timed alone after a first call) back to
    back for about the time asked, as a number of calls (a loop bounded by wall time would queue far more GPU work
    than the host waits for); a shorter call is not settled."""
    import time

    from mhattn.benchmark import timing

    clock = [0.0]
    made = []

    def fn():  # a call whose time the clock sees when the "GPU" is synchronized
        made.append(1)

    def synchronize():
        clock[0] += len(made) * call_ms / 1e3
        made.clear()

    counted = []
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    timing.settle(lambda: (fn(), counted.append(1)), 20.0)
    assert len(counted) == calls


def test_tune_head_dims_adds_the_training_shapes_at_those_head_dims_to_this_device_s_table(monkeypatch, capsys):
    """mhattn tune --head-dim: the grid's training shapes at the head dims given (on a GPU bf16 at every quick
    sequence length, causal and not; on the CPU the CPU grid's shapes), timed and added to the table the device uses,
    so that a problem at such a head dim is decided by its own cells and the others keep theirs."""
    from mhattn.benchmark import supervisor

    cells = grid.head_dim_cells("cuda", True, (96, 192))
    assert len(cells) == 24 and {c.head_dim for c in cells} == {96, 192} and {c.dtype for c in cells} == {"bf16"}
    assert {c.seqlen_q for c in cells} == set(grid.QUICK_SEQLENS) and {c.causal for c in cells} == {"none", "top_left"}
    assert all(c.batch * c.seqlen_q == grid.TOKENS and c.heads_q == grid.HIDDEN // c.head_dim for c in cells)
    assert {c.head_dim for c in grid.head_dim_cells("cpu", True, (32, ))} == {32}
    assert len(grid.head_dim_cells("cuda", False, (96, ))) == 2 * 2 * len(grid.FULL_SEQLENS)  # bf16 and fp16

    fast = {64: "sdpa", 32: "reference"}  # the backend each run's cells time fastest

    def run_tasks(tasks, **kwargs):
        rows = []
        for task in tasks:
            winner = fast[task["cell"]["head_dim"]]
            times = {"sdpa": 2.0, "reference": 2.0, winner: 1.0}
            rows.append(dict(task["cell"], kind="tune", status="ok", fwd_ms=times, fwd_bwd_ms={}, skipped={}))
        return supervisor.Outcome(rows, notes=[])

    monkeypatch.setattr(supervisor, "run_tasks", run_tasks)
    assert tune_cli.tune(quick=True, device="cpu", max_n=128, progress=False) == 0
    assert tune_cli.tune(quick=True, device="cpu", max_n=128, progress=False, head_dims=(32, )) == 0
    out = capsys.readouterr().out
    written = list(table.cache_tables_dir().glob("*.json"))
    assert len(written) == 1 and "added 2 shapes to the table" in out
    t = table.TimingTable.load(written[0])
    assert sorted(c["head_dim"] for c in t.cells) == [32, 32, 64, 64]
    assert t.made["command"] == "mhattn tune --quick --head-dim 32" and t.made["added_to"] == str(written[0])
    assert t.made["base"]["command"] == "mhattn tune --quick"
    # The base table's cells are kept as they were (graph replays included); a cell timed again takes the new times.
    base = make_table([dict(cell({"sdpa": 1.0}, seqlen_q=128, seqlen_k=128), fwd_graph_ms={"sdpa": 0.5}),
                       cell({"sdpa": 3.0}, seqlen_q=512, seqlen_k=512)])
    added = make_table([cell({"triton": 2.0}, seqlen_q=512, seqlen_k=512), cell({"triton": 4.0}, head_dim=192)],
                       command="mhattn tune --quick --head-dim 192")
    both = table.with_cells(base, added)
    assert both.cells == [base.cells[0], added.cells[0], added.cells[1]] and both.made["base"] == base.made
    with pytest.raises(ValueError, match="cannot add cells"):
        table.with_cells(base, make_table([], key={"device": "NVIDIA H200", "compute_capability": [9, 0]}))
    for head_dim, winner in fast.items():
        q = torch.randn(1, 8, 128, head_dim)
        decision = mhattn.explain(q, q, q)
        assert decision.measured.cell["head_dim"] == head_dim and decision.chosen == winner


def test_tune_head_dim_option_on_the_command_line(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(tune_cli, "tune", lambda **kwargs: calls.append(kwargs) or 0)
    from mhattn.cli import main

    assert main(["tune", "--quick", "--head-dim", "96,192"]) == 0 and calls[-1]["head_dims"] == (96, 192)
    assert main(["tune", "--quick"]) == 0 and calls[-1]["head_dims"] is None
    for bad in ("96,x", "0", ","):
        with pytest.raises(SystemExit):
            main(["tune", "--head-dim", bad])
        assert "--head-dim" in capsys.readouterr().err
