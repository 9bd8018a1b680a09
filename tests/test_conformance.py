"""The conformance suite (mhattn.conformance) and ``mhattn conformance``.

CPU: the reference passes every quick case; deliberately broken backends (wrong scale, an unwritten
output, a wrong dk sign, dropout that ignores its own mask, lse not -inf on empty rows, a wrong mask
gradient, a non-deterministic backward) are each caught by the check meant for them; the table, the
reports, the reproduce command and the isolated workers work, one at a time and several at once (--jobs).
GPU: every backend that declares CUDA passes the quick cases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import time

import pytest
import torch

import mhattn
from mhattn.cli import main as mhattn_main
from mhattn.conformance import cases as cases_module
from mhattn import isolation
from mhattn.conformance.cases import COLUMNS, Case, full_cases, parse_spec, quick_cases
from mhattn.conformance.poison import poisoned_allocations
from mhattn.conformance.pool import auto_jobs, case_cost, run_isolated, run_parallel
from mhattn.conformance.report import Report, merge_reports, read_json_report, render_markdown, render_text, to_json
from mhattn.conformance.runner import FAIL, NOT_RUN, PASS, UNSUPPORTED, CaseResult, run_case
from mhattn.conformance.suite import make_plan, run_in_process
from mhattn.reference.backend import ReferenceBackend

REFERENCE = mhattn.get_backend("reference")


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """The cases are small: one thread avoids the threads' spinning on a loaded 2-core machine (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- deliberately broken backends -----------------------------------------------------------------


class WrongScale(ReferenceBackend):
    """Forward with the score scale off by 2 %."""

    name = "test-wrong-scale"

    def forward(self, q, k, v, params):
        return super().forward(q, k, v, params.replace(scale=params.scale * 1.02))


class UnwrittenRow(ReferenceBackend):
    """Allocates its output with torch.empty and never writes the last query row."""

    name = "test-unwritten-row"

    def forward(self, q, k, v, params):
        out, lse = super().forward(q, k, v, params)
        result = torch.empty_like(out)
        result[:, :, :-1] = out[:, :, :-1]
        return result, lse


class WrongDkSign(ReferenceBackend):
    name = "test-wrong-dk-sign"

    def backward(self, *args, **kwargs):
        dq, dk, dv, dmask = super().backward(*args, **kwargs)
        return dq, -dk, dv, dmask


class DropoutIgnoresMask(ReferenceBackend):
    """Says it drops with the shared counter RNG, but drops with another seed."""

    name = "test-dropout-other-seed"

    def forward(self, q, k, v, params):
        return super().forward(q, k, v, params.replace(seed=(params.seed[0] ^ 1, params.seed[1])))


class FiniteLseOnEmptyRows(ReferenceBackend):
    """Writes lse 0 instead of -inf for rows that see no key."""

    name = "test-finite-empty-lse"

    def forward(self, q, k, v, params):
        out, lse = super().forward(q, k, v, params)
        return out, torch.nan_to_num(lse, neginf=0.0)


class WrongMaskGrad(ReferenceBackend):
    name = "test-wrong-mask-grad"

    def backward(self, *args, **kwargs):
        dq, dk, dv, dmask = super().backward(*args, **kwargs)
        return dq, dk, dv, None if dmask is None else dmask * 1.5


class NoisyBackward(ReferenceBackend):
    """A backward whose last bit of one dq element changes from run to run (as unordered atomics would):
    within the tolerance, caught only by the bitwise comparison."""

    name = "test-noisy-backward"
    calls = 0

    def backward(self, *args, **kwargs):
        dq, dk, dv, dmask = super().backward(*args, **kwargs)
        NoisyBackward.calls += 1
        bits = dq.contiguous().view(torch.int16 if dq.element_size() == 2 else torch.int32).view(-1)
        bits[NoisyBackward.calls % bits.numel()] ^= 1
        return dq, dk, dv, dmask


class AppendOneRowLate(ReferenceBackend):
    """An append of its own (append_kvcache) that writes each new token one position past where it belongs."""

    name = "test-append-one-row-late"

    def append_kvcache(self, k_cache, v_cache, k, v, cache_seqlens, block_table):
        from mhattn.decode import _append_by_indexing

        late = torch.clamp(cache_seqlens + 1, max=k_cache.shape[2] - k.shape[2]) if block_table is None else \
            cache_seqlens + 1
        _append_by_indexing(k_cache, v_cache, k, v, late.to(torch.int32), block_table)
        return cache_seqlens + k.shape[2]


class AppendingStepAdvancesLengths(ReferenceBackend):
    """A step that appends as it attends (forward_kvcache_appending) and gives the right output, but advances
    cache_seqlens in place, which the caller owns."""

    name = "test-appending-step-advances-lengths"

    def forward_kvcache_appending(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, params):
        from mhattn.backends.base import KVCache
        from mhattn.decode import _append_by_indexing

        seqlens = _append_by_indexing(k_cache, v_cache, k, v, cache_seqlens, block_table)
        cache_seqlens.copy_(seqlens)
        return self.forward_kvcache(q, KVCache(k_cache, v_cache, seqlens, block_table), params)


class PreparedStepLeavesTheCache(ReferenceBackend):
    """A step prepared per signature (kvcache_call) with the right output, which appends into a copy of the cache and
    leaves the caller's cache without the new tokens."""

    name = "test-prepared-step-leaves-the-cache"

    def kvcache_call(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, params, return_lse):
        from mhattn.backends.base import KVCache
        from mhattn.decode import _append_by_indexing

        def step(q, k_cache, v_cache, k, v, cache_seqlens, block_table):
            k_copy, v_copy = k_cache.clone(), v_cache.clone()
            seqlens = _append_by_indexing(k_copy, v_copy, k, v, cache_seqlens, block_table)
            return self.forward_kvcache(q, KVCache(k_copy, v_copy, seqlens, block_table), params)

        return step


class PreparedStepKeepsItsFirstCache(ReferenceBackend):
    """A step prepared per signature (kvcache_call) that keeps the cache of its first call and appends into that one
    at every later call: right at the first call only."""

    name = "test-prepared-step-keeps-its-first-cache"

    def kvcache_call(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, params, return_lse):
        from mhattn.backends.base import KVCache
        from mhattn.decode import _append_by_indexing

        first = []

        def step(q, k_cache, v_cache, k, v, cache_seqlens, block_table):
            if not first:
                first.extend((k_cache, v_cache))
            seqlens = _append_by_indexing(first[0], first[1], k, v, cache_seqlens, block_table)
            return self.forward_kvcache(q, KVCache(first[0], first[1], seqlens, block_table), params)

        return step


class NoDropout(ReferenceBackend):
    """A correct backend that declares no dropout and no sliding window."""

    name = "test-no-dropout"
    capabilities = dataclasses.replace(
        ReferenceBackend.capabilities, features=ReferenceBackend.capabilities.features - {"dropout", "window"}
    )


class MisbehavesInWorker(ReferenceBackend):
    """Inside a worker process (never the test process): kills its process on head dim 59 and hangs on
    head dim 64; correct otherwise."""

    name = "test-misbehaves-in-worker"

    def forward(self, q, k, v, params):
        if str(os.getpid()) != os.environ.get("MHATTN_TEST_PARENT_PID"):
            if q.shape[-1] == 59:
                os._exit(7)
            if q.shape[-1] == 64:
                time.sleep(120)
        return super().forward(q, k, v, params)


class MeetsAnotherWorker(ReferenceBackend):
    """Correct, and leaves a file named after its process id in $MHATTN_TEST_PID_DIR. Inside a worker
    process it goes on only once another process has left one too (it gives up with an error after
    30 s): it passes in workers only when two of them run at once."""

    name = "test-meets-another-worker"

    def forward(self, q, k, v, params):
        folder = os.environ["MHATTN_TEST_PID_DIR"]
        open(os.path.join(folder, str(os.getpid())), "w").close()
        if str(os.getpid()) != os.environ.get("MHATTN_TEST_PARENT_PID"):
            give_up = time.monotonic() + 30
            while len(os.listdir(folder)) < 2:
                if time.monotonic() > give_up:
                    raise RuntimeError("no other worker ran a case at the same time")
                time.sleep(0.05)
        return super().forward(q, k, v, params)


class CountingProgress:
    """Stands in for the progress bar: counts the results it is given."""

    def __init__(self):
        self.done = 0

    def start(self, label):
        pass

    def advance(self, count=1, failure=""):
        self.done += count


@contextlib.contextmanager
def registered(*backends):
    for backend in backends:
        mhattn.register_backend(backend)
    try:
        yield
    finally:
        for backend in backends:
            mhattn.unregister_backend(backend.name)


def cpu_quick(backend, dtypes=("fp16",), features=None):
    found = quick_cases(backend, "cpu", list(dtypes))
    return [c for c in found if features is None or c.feature in features]


def run_cli(*argv):
    out = io.StringIO()
    err = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = mhattn_main(["conformance", *argv])
    return status, out.getvalue(), err.getvalue()


# ---- the reference passes ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", "fp64"])
def test_reference_passes_every_quick_case_on_the_cpu(dtype):
    cases = cpu_quick(REFERENCE, [dtype])
    assert {c.feature for c in cases} == set(COLUMNS)
    results = [run_case(REFERENCE, c) for c in cases]
    failed = [f"{r.case.command()}: {r.summary()}" for r in results if r.status != PASS]
    assert not failed, "\n".join(failed)
    for r in results:
        assert r.checks and all(c.ratio <= 1.0 for c in r.checks)


def test_reference_passes_the_full_cpu_cases():
    cases = full_cases(REFERENCE, "cpu", ["fp16", "fp32"])
    assert {c.feature for c in cases} == set(COLUMNS)
    # every head dim and (Nq, Nk) pair of the CPU lists appears
    assert {c.head_dim for c in cases} >= set(cases_module.CPU_HEAD_DIMS)
    assert {(c.seqlen_q, c.seqlen_k) for c in cases} >= set(cases_module.CPU_SEQLENS)
    results = [run_case(REFERENCE, c) for c in cases]
    failed = [f"{r.case.command()}: {r.summary()}" for r in results if r.status != PASS]
    assert not failed, "\n".join(failed)


def test_full_gpu_cases_cover_conformance_lists():
    cases = full_cases(REFERENCE, "cuda", ["fp16", "bf16"])
    assert {c.head_dim for c in cases} >= set(cases_module.HEAD_DIMS)
    assert {(c.seqlen_q, c.seqlen_k) for c in cases} >= set(cases_module.SEQLENS)
    assert {c.causal for c in cases} >= {None, "top_left", "bottom_right"}
    assert {(c.heads_q, c.heads_kv) for c in cases} >= set(cases_module.HEADS.values())
    assert {c.mask_dims for c in cases if c.mask in ("bool", "float")} == set(cases_module.MASK_DIMS_CHOICES)
    assert any(c.dropout_p == cases_module.DROPOUT_P for c in cases)
    assert max(c.det_runs for c in cases) == 50
    # sequences of 1024 and more keys run with batch 1
    # (the inference columns' golds are cheap: few query rows, or one sequence at a time)
    assert all(c.batch == 1 for c in cases if max(c.seqlen_q, c.seqlen_k) >= 1024
               and c.feature not in ("decode", "kvcache", "varlen"))


def test_head_dims_follow_declared_capabilities():
    class Narrow(ReferenceBackend):
        name = "test-narrow"
        capabilities = dataclasses.replace(ReferenceBackend.capabilities, min_head_dim=32, max_head_dim=128)

    cases = full_cases(Narrow(), "cuda", ["fp16"])
    assert {c.head_dim for c in cases} <= {32, 40, 59, 64, 80, 96, 111, 128}
    assert all(c.value_dim <= 128 for c in cases)


# ---- specs and reproduce commands ------------------------------------------------------------------


def test_case_spec_round_trips_for_every_generated_case():
    for device in ("cpu", "cuda"):
        for case in quick_cases(REFERENCE, device, ["fp16", "fp32"]) + full_cases(REFERENCE, device, ["bf16"]):
            assert parse_spec(case.spec(), case.backend) == case
            assert case.command().startswith(f"mhattn conformance --backend {case.backend} --case ")


def test_spec_parsing_errors_name_the_key():
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        parse_spec("bogus=1", "reference")
    with pytest.raises(ValueError, match="window"):
        parse_spec("window=3", "reference")
    with pytest.raises(ValueError, match="heads_q"):
        Case(backend="reference", feature="gqa", heads_q=6, heads_kv=4)
    # a spec without a seed gets a stable one
    assert parse_spec("d=40,nq=3,nk=5", "reference").seed == parse_spec("nk=5,nq=3,d=40", "reference").seed


def test_inputs_are_fresh_and_reproducible():
    from mhattn.conformance.inputs import make_inputs

    case = parse_spec("feature=strided,device=cpu,b=2,hq=4,hkv=2,nq=9,nk=13,d=16,strided=1,seed=5", "reference")
    a, b = make_inputs(case, "cpu"), make_inputs(case, "cpu")
    assert torch.equal(a.q, b.q) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    # strided: views of packed projections, last dim contiguous, no other dim contiguous
    assert a.q.stride(-1) == 1 and not a.q.is_contiguous() and a.k.data_ptr() != a.v.data_ptr()
    other = make_inputs(dataclasses.replace(case, seed=6), "cpu")
    assert not torch.equal(a.q, other.q)


def test_poisoned_allocations_fill_floats_with_nan_and_restore():
    with poisoned_allocations():
        assert torch.empty(5).isnan().all()
        assert torch.empty_like(torch.zeros(3, dtype=torch.float16)).isnan().all()
        assert torch.zeros(2).new_empty(4).isnan().all()
        assert torch.empty(3, dtype=torch.int32).dtype == torch.int32  # integers untouched
    assert not hasattr(torch.empty, "__wrapped__")


# ---- broken backends are caught -------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend, features, failing_check",
    [
        (WrongScale(), ["basic", "causal"], "out"),
        (UnwrittenRow(), ["basic"], "out"),
        (WrongDkSign(), ["basic", "gqa"], "dk"),
        (DropoutIgnoresMask(), ["dropout"], "out"),
        (FiniteLseOnEmptyRows(), ["fully_masked"], "lse"),
        (WrongMaskGrad(), ["mask_grad"], "dmask"),
        (NoisyBackward(), ["deterministic"], "backward run 2 == run 1"),
        (AppendOneRowLate(), ["kvcache"], "append_kvcache writes what torch's indexing writes"),
        (AppendingStepAdvancesLengths(), ["kvcache"], "forward_kvcache_appending writes what torch's indexing writes"),
        (PreparedStepLeavesTheCache(), ["kvcache"], "kvcache_call writes what torch's indexing writes"),
        (PreparedStepKeepsItsFirstCache(), ["kvcache"], "kvcache_call again writes what torch's indexing writes"),
    ],
    ids=lambda x: getattr(x, "name", None) if isinstance(x, ReferenceBackend) else None,
)
def test_a_broken_backend_is_caught(backend, features, failing_check):
    results = [run_case(backend, c) for c in cpu_quick(backend, ["fp16"], features)]
    assert results and all(r.status == FAIL for r in results), [r.summary() for r in results]
    for r in results:
        assert failing_check in {c.name for c in r.failed_checks}, r.summary()


def test_unwritten_output_shows_as_nan():
    case = cpu_quick(UnwrittenRow(), ["fp32"], ["basic"])[0]
    result = run_case(UnwrittenRow(), case)
    out = next(c for c in result.checks if c.name == "out")
    assert not out.ok and "NaN" in out.note and math.isinf(result.worst_ratio)


def test_an_exception_is_a_failure_with_its_message():
    class Raises(ReferenceBackend):
        name = "test-raises"

        def backward(self, *args, **kwargs):
            raise RuntimeError("kernel launch failed: too many resources requested")

    result = run_case(Raises(), cpu_quick(Raises(), ["fp16"], ["basic"])[0])
    assert result.status == FAIL and "too many resources" in result.error


def test_undeclared_features_are_unsupported_with_the_backend_reason():
    backend = NoDropout()
    results = [run_case(backend, c) for c in cpu_quick(backend, ["fp16"])]
    by_feature = {}
    for r in results:
        by_feature.setdefault(r.case.feature, set()).add(r.status)
    assert by_feature["dropout"] == {UNSUPPORTED} and by_feature["window"] == {UNSUPPORTED}
    assert by_feature["basic"] == {PASS}
    dropout = next(r for r in results if r.case.feature == "dropout")
    assert dropout.reasons == ["does not support dropout"]

    report = Report("quick", "cpu", {"device": "test"}, results=results)
    text = render_text(report)
    assert "unsupported [1]" in text and "test-no-dropout: does not support dropout" in text
    assert report.ok  # unsupported is not a failure
    md = render_markdown(report)
    assert "| dropout |" in md and "does not support dropout" in md
    data = to_json(report)
    json.dumps(data, allow_nan=False)
    assert data["ok"] and len(data["results"]) == len(results)


def test_the_report_says_which_kernel_family_ran_each_case():
    """A backend with two kernel families (Backend.forward_path / backward_path): each case records the families
    its problem goes to, the report counts them per backend, and the JSON round trip keeps them."""

    class TwoFamilies(ReferenceBackend):
        name = "test-two-families"

        def forward_path(self, problem):
            if problem.seqlen_k >= 64:
                return "the long forward (long.py), because the keys are many"
            return "the short forward (short.py): not the long one because few keys"

        def backward_path(self, problem):
            return "the one backward (bwd.py)"

    backend = TwoFamilies()
    results = [run_case(backend, c) for c in cpu_quick(backend, ["fp16"], ["basic", "causal"])]
    assert all(r.kernels and r.kernels[-1] == "backward: the one backward (bwd.py)" for r in results)
    assert {r.kernels[0] for r in results} <= {"forward: the long forward (long.py)",
                                              "forward: the short forward (short.py)"}
    report = Report("quick", "cpu", {"device": "test"}, results=results)
    md, text = render_markdown(report), render_text(report)
    assert "### Kernel families" in md and "kernel families that ran the cases:" in text
    assert f"test-two-families: backward: the one backward (bwd.py): {len(results)} cases" in md
    again = CaseResult.from_dict(json.loads(json.dumps(to_json(report)))["results"][0])
    assert again.kernels == results[0].kernels
    assert run_case(REFERENCE, cpu_quick(REFERENCE, ["fp16"], ["basic"])[0]).kernels == []  # one family: none named


# ---- plans, workers ---------------------------------------------------------------------------------


def test_plan_lists_unavailable_backends_with_reasons():
    class Missing(ReferenceBackend):
        name = "test-missing"

        def unavailable(self):
            return ["the test package is not installed"]

    class GpuOnly(ReferenceBackend):
        name = "test-gpu-only"
        capabilities = dataclasses.replace(ReferenceBackend.capabilities, device_types=frozenset({"cuda"}))

    plan = make_plan([REFERENCE, Missing(), GpuOnly()], "quick", "cpu")
    assert plan.unavailable["test-missing"] == ["the test package is not installed"]
    assert "this run is on cpu" in plan.unavailable["test-gpu-only"][0]
    assert {c.backend for c in plan.cases} == {"reference"}
    assert {c.dtype for c in plan.cases} == {"fp16", "fp32"}


def test_isolated_workers_survive_a_crash_and_a_hang(monkeypatch):
    monkeypatch.setenv("MHATTN_TEST_PARENT_PID", str(os.getpid()))
    backend = MisbehavesInWorker()
    with registered(backend):
        cases = cpu_quick(backend, ["fp32"], ["basic", "causal"])
        assert [c.head_dim for c in cases] == [59, 64, 32, 32]  # crash, hang, pass, pass
        results = run_isolated(cases, case_timeout=5.0)
    assert [r.case for r in results] == cases
    assert [r.status for r in results] == [FAIL, FAIL, PASS, PASS], [r.summary() for r in results]
    assert "died while running this case (exit status 7)" in results[0].error
    assert "timed out" in results[1].error


def test_isolated_run_of_a_backend_the_worker_cannot_import_falls_back_to_this_process():
    class Local(ReferenceBackend):  # defined in a function: a fresh process cannot import it
        name = "test-local"

    local = Local()
    with registered(local):
        cases = cpu_quick(local, ["fp32"], ["basic"])
        results = run_isolated(cases)
    assert [r.status for r in results] == [PASS] * len(cases)


def test_time_limit_leaves_the_remaining_cases_not_run():
    cases = cpu_quick(REFERENCE, ["fp32"], ["basic", "causal"])
    assert [r.status for r in run_in_process(cases, deadline=time.time() - 1)] == [NOT_RUN] * len(cases)
    # a worker that reaches its first case after the deadline (it takes seconds to import) stops there
    results = run_isolated(cases, deadline=time.time() + 0.5)
    assert [r.status for r in results] == [NOT_RUN] * len(cases)
    assert "time limit" in results[0].summary()
    report = Report("quick", "cpu", {}, results=[run_case(REFERENCE, cases[0])] + results[1:])
    text = render_text(report)
    assert "INCOMPLETE" in text and "+1 not run" in text and "3 not run (time limit)" in text


def test_parallel_workers_survive_a_crash_and_a_hang(monkeypatch):
    monkeypatch.setenv("MHATTN_TEST_PARENT_PID", str(os.getpid()))
    backend = MisbehavesInWorker()
    with registered(backend):
        cases = cpu_quick(backend, ["fp32"], ["basic", "causal", "gqa"])
        assert [c.head_dim for c in cases] == [59, 64, 32, 32, 32, 59]  # crash, hang, pass x3, crash
        results = run_parallel(cases, jobs=2, case_timeout=3.0)
    assert [r.case for r in results] == cases
    assert [r.status for r in results] == [FAIL, FAIL, PASS, PASS, PASS, FAIL], [r.summary() for r in results]
    for r in (results[0], results[5]):
        assert "died while running this case (exit status 7)" in r.error
    assert "timed out" in results[1].error and results[1].seconds >= 3.0


def test_parallel_workers_that_cannot_start_fail_every_case_once(monkeypatch):
    # every worker exits at once, before its first message (as a broken install would)
    monkeypatch.setattr(isolation, "_BOOT", "import sys; print('no module named mhattn'); sys.exit(5)")
    cases = cpu_quick(REFERENCE, ["fp32"], ["basic", "causal", "gqa"])
    progress = CountingProgress()
    results = run_parallel(cases, jobs=2, progress=progress)
    assert [r.case for r in results] == cases and [r.status for r in results] == [FAIL] * len(cases)
    assert progress.done == len(cases)  # each case settled once
    for r in results:
        assert "stopped before running any case (exit status 5)" in r.error and "no module named mhattn" in r.error


# A stand-in worker (no torch: it starts at once) that runs one case, then, like a real worker whose CUDA
# context broke, ends with EXIT_BROKEN a moment later; the parent has handed it the next case by then.
_WORKER_THAT_LOSES_ITS_CONTEXT = """
import json, os, sys, time
entry = json.loads(sys.stdin.readline())
with os.fdopen(int(sys.argv[4]), "w") as events:
    events.write(json.dumps({"start": entry["index"]}) + "\\n")
    result = {"backend": entry["task"]["backend"], "case": entry["task"]["case"], "status": "pass"}
    events.write(json.dumps({"result": entry["index"], "value": result}) + "\\n")
time.sleep(0.5)
sys.exit(3)
"""


def test_parallel_case_handed_to_a_worker_that_lost_its_context_runs_elsewhere(monkeypatch):
    assert isolation.EXIT_BROKEN == 3
    monkeypatch.setattr(isolation, "_BOOT", _WORKER_THAT_LOSES_ITS_CONTEXT)
    cases = cpu_quick(REFERENCE, ["fp32"], ["basic", "causal", "gqa"])
    progress = CountingProgress()
    results = run_parallel(cases, jobs=2, progress=progress)
    assert [r.status for r in results] == [PASS] * len(cases), [r.summary() for r in results]
    assert [r.case for r in results] == cases and progress.done == len(cases)


def test_parallel_time_limit_stops_handing_out_cases(monkeypatch):
    cases = cpu_quick(REFERENCE, ["fp32"], ["basic", "causal", "gqa"])
    counter = CountingProgress()
    # The parent's clock says the limit is reached once two cases are done (the workers' own check reads
    # the real clock, with the limit an hour away): the cases already handed out finish, no other starts.
    monkeypatch.setattr(isolation, "past", lambda deadline: counter.done >= 2)
    results = run_parallel(cases, jobs=2, progress=counter, deadline=time.time() + 3600)
    statuses = [r.status for r in results]
    assert [r.case for r in results] == cases and counter.done == len(cases)
    assert set(statuses) == {PASS, NOT_RUN}, statuses
    assert 2 <= statuses.count(PASS) <= 4  # the two done, and at most one more handed to each worker
    assert all("time limit" in r.summary() for r in results if r.status == NOT_RUN)
    # the costliest cases were handed out first
    passed = sorted(case_cost(r.case) for r in results if r.status == PASS)
    assert min(passed) >= max(case_cost(r.case) for r in results if r.status == NOT_RUN)
    # past the limit before the start: no worker starts, nothing runs
    assert [r.status for r in run_parallel(cases, jobs=2, deadline=time.time() - 1)] == [NOT_RUN] * len(cases)


def test_auto_jobs_follow_the_cores(monkeypatch):
    expected = {  # cores: (on a GPU, on the CPU)
        None: (1, 1), 1: (1, 1), 2: (1, 1), 3: (1, 1), 4: (2, 2), 6: (3, 3), 10: (5, 4), 16: (8, 4), 64: (8, 4),
    }
    for cores, (cuda, cpu) in expected.items():
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        assert (auto_jobs("cuda"), auto_jobs("cpu")) == (cuda, cpu), cores


def test_in_process_run_matches_cases():
    cases = cpu_quick(REFERENCE, ["fp32"], ["causal", "gqa"])
    results = run_in_process(cases)
    assert [r.case for r in results] == cases and all(r.status == PASS for r in results)


# ---- the command ------------------------------------------------------------------------------------


def test_cli_quick_reference_passes_and_writes_reports(tmp_path):
    md, js = tmp_path / "report.md", tmp_path / "report.json"
    status, out, _ = run_cli("--quick", "--backend", "reference", "--no-progress", "--report", str(md))
    assert status == 0, out
    for feature in COLUMNS:
        assert feature in out
    assert "reference fp16" in out and "PASSED" in out and "device:" in out and "torch:" in out
    assert "# mhattn conformance" in md.read_text()
    status, _, _ = run_cli("--backend", "reference", "--no-progress", "--feature", "causal,dropout", "--dtype",
                           "bf16", "--report", str(js))
    assert status == 0
    data = json.loads(js.read_text())
    assert data["ok"] and {r["feature"] for r in data["results"]} == {"causal", "dropout"}
    assert {r["dtype"] for r in data["results"]} == {"bf16"}


def test_cli_fails_on_a_broken_backend_and_prints_reproduce_commands():
    broken = WrongScale()
    with registered(broken):
        status, out, err = run_cli("--backend", broken.name, "--feature", "basic", "--dtype", "fp16")
        assert status == 1
        assert "FAIL" in out and "FAILED" in out
        line = next(l for l in out.splitlines() if "reproduce: mhattn conformance" in l)
        assert f"--backend {broken.name} --case " in line
        assert "reproduce:" in err  # printed as it happened, above the progress bar
        # the reproduce command runs the same case again, and fails again
        spec = line.split("--case ", 1)[1].strip().strip("'")
        status, out, _ = run_cli("--backend", broken.name, "--case", spec)
        assert status == 1 and "out: FAIL" in out
        status, out, _ = run_cli("--backend", "reference", "--case", spec)
        assert status == 0 and "PASS" in out


def test_cli_time_limit_and_merge(tmp_path):
    status, out, _ = run_cli("--backend", "reference", "--no-progress", "--time-limit", "0")
    assert status == 3 and "INCOMPLETE" in out
    parts = []
    for dtype in ("fp16", "fp32"):
        parts.append(str(tmp_path / f"{dtype}.json"))
        status, _, _ = run_cli("--backend", "reference", "--no-progress", "--dtype", dtype, "--feature", "basic",
                               "--report", parts[-1])
        assert status == 0
    merged = tmp_path / "merged.json"
    status, out, _ = run_cli("--merge", *parts, "--report", str(merged))
    assert status == 0 and "reference fp16" in out and "reference fp32" in out
    assert len(json.loads(merged.read_text())["results"]) == 4


def test_cli_jobs_give_the_same_statuses_as_one_at_a_time(tmp_path, monkeypatch):
    class Local(ReferenceBackend):  # defined in a function: workers cannot make it, the parent runs it
        name = "test-local-jobs"

    monkeypatch.setenv("MHATTN_TEST_PARENT_PID", str(os.getpid()))
    backends = [NoDropout(), WrongScale(), MeetsAnotherWorker(), Local()]
    statuses = {}
    with registered(*backends):
        for jobs in ("1", "2"):
            (tmp_path / jobs).mkdir()
            monkeypatch.setenv("MHATTN_TEST_PID_DIR", str(tmp_path / jobs))
            path = tmp_path / f"jobs{jobs}.json"
            status, out, _ = run_cli("--backend", ",".join(b.name for b in backends), "--dtype", "fp32",
                                     "--feature", "basic,causal,dropout", "--no-progress", "--jobs", jobs,
                                     "--report", str(path))
            assert status == 1, out  # WrongScale fails
            assert f", {jobs} job" in next(line for line in out.splitlines() if line.startswith("FAILED: "))
            data = json.loads(path.read_text())
            assert data["jobs"] == int(jobs)
            statuses[jobs] = [(r["backend"], r["case"], r["status"]) for r in data["results"]]
    one, two = statuses["1"], statuses["2"]
    assert len(one) == 4 * 5 and one == two
    assert {s for _, _, s in one} == {PASS, FAIL, UNSUPPORTED}
    # --jobs 1 ran every case in this process; --jobs 2 in workers, two at once (else MeetsAnotherWorker fails)
    assert os.listdir(tmp_path / "1") == [str(os.getpid())]
    assert len(os.listdir(tmp_path / "2")) >= 2 and str(os.getpid()) not in os.listdir(tmp_path / "2")


def test_cli_time_limit_with_jobs():
    status, out, _ = run_cli("--backend", "reference", "--no-progress", "--jobs", "2", "--time-limit", "0")
    assert status == 3 and "INCOMPLETE" in out and "0 passed" in out and "2 jobs" in out


def test_cli_jobs_errors_name_the_argument():
    for bad in ("x", "0", "-3", "1.5"):
        status, _, err = run_cli("--backend", "reference", "--jobs", bad)
        assert status == 2 and f"--jobs: expected a positive integer or 'auto', got '{bad}'" in err


def test_report_shows_wall_time_jobs_and_the_slowest_cases(tmp_path):
    cases = cpu_quick(REFERENCE, ["fp16"], ["basic", "causal", "gqa", "window"])
    seconds = [0.5, 3.0, 0.25, 7.0, 1.5, 0.75, 2.0]
    results = [CaseResult(c, PASS, seconds=t) for c, t in zip(cases, seconds)]
    report = Report("quick", "cpu", {"device": "test"}, results=results, seconds=42.0, jobs=3)
    slowest = sorted(results, key=lambda r: -r.seconds)[:5]
    text = render_text(report)
    assert "(quick, cpu, 42 s wall time, 3 jobs)" in text.splitlines()[-1]
    block = text.split("slowest cases", 1)[1].split("\n\n", 1)[0]
    assert "3 jobs" in block.splitlines()[0] and "15.0 s in all" in block.splitlines()[0]
    listed = [line.split()[0] for line in block.splitlines()[1:] if not line.strip().startswith("reproduce:")]
    assert listed == [f"{r.seconds:.2f}" for r in slowest]
    assert [line.split("reproduce: ")[1] for line in block.splitlines() if "reproduce:" in line] == \
        [r.case.command() for r in slowest]
    md = render_markdown(report)
    assert "42 s wall time, 3 jobs" in md.split("## Time", 1)[1]
    rows = [line for line in md.split("## Time", 1)[1].splitlines() if line.startswith("| ") and "`" in line]
    assert [row.split(" | ")[0] for row in rows] == [f"| {r.seconds:.2f}" for r in slowest]

    # JSON keeps the jobs; a report written before --jobs (no "jobs", no case seconds) still merges
    path = tmp_path / "new.json"
    path.write_text(json.dumps(to_json(report)))
    assert read_json_report(str(path)).jobs == 3
    old = to_json(Report("quick", "cpu", {"device": "test"}, results=results[:2], seconds=5.0))
    del old["jobs"]
    for r in old["results"]:
        del r["seconds"]
    old_path = tmp_path / "old.json"
    old_path.write_text(json.dumps(old))
    older = read_json_report(str(old_path))
    assert older.jobs is None and [r.seconds for r in older.results] == [0.0, 0.0]
    merged = merge_reports([older, read_json_report(str(path))])
    assert merged.jobs is None and merged.seconds == 47.0 and len(merged.results) == len(results)
    assert "47 s wall time)" in render_text(merged).splitlines()[-1]
    assert merge_reports([report, report]).jobs == 3


def test_cli_usage_errors():
    assert run_cli("--backend", "no-such-backend")[0] == 2
    assert run_cli("--backend", "reference", "--dtype", "int8")[0] == 2
    assert run_cli("--backend", "reference", "--feature", "teleport")[0] == 2
    assert run_cli("--case", "d=16")[0] == 2  # --case needs one --backend
    status, out, _ = run_cli("--backend", "reference", "--list", "--feature", "window")
    assert status == 0 and out.count("mhattn conformance --backend reference --case") == 2


def test_cli_quick_triton_interpreter_smoke(tmp_path):
    """The CPU path of the Triton backend through the command (restarts itself with TRITON_INTERPRET=1)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter path is taken only without a GPU")
    report = tmp_path / "triton.json"
    status, out, _ = run_cli("--backend", "triton", "--feature", "basic", "--dtype", "fp16", "--no-progress",
                             "--report", str(report))
    data = json.loads(report.read_text())
    if data["unavailable"].get("triton"):
        pytest.skip(f"triton backend unavailable: {data['unavailable']['triton']}")
    assert status == 0, out
    assert data["environment"].get("TRITON_INTERPRET") == "1"
    assert [r["status"] for r in data["results"]] == ["pass", "pass"]


# ---- GPU --------------------------------------------------------------------------------------------


def _cuda_backends():
    return [b.name for b in mhattn.registry.all_backends() if "cuda" in b.capabilities.device_types]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", _cuda_backends())
def test_quick_cases_pass_on_the_gpu(name):
    backend = mhattn.get_backend(name)
    if backend.unavailable():
        pytest.skip(f"{name}: {'; '.join(backend.unavailable())}")
    plan = make_plan([backend], "quick", "cuda")
    results = run_in_process(plan.cases)
    failed = [f"{r.case.command()}: {r.summary()}" for r in results if r.status == FAIL]
    assert not failed, "\n".join(failed)
    assert any(r.status == PASS for r in results)
