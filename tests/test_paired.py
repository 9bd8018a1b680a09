"""A forward on one backend and its backward on another (``backend="<forward>+<backward>"``), on the CPU: the names,
the gradients against the reference, the reasons, automatic selection from a table that timed a pair, and
``mhattn tune`` timing a pair only once its gradients match."""

import pytest
import torch

import mhattn
from mhattn import dispatch, registry
from mhattn.backends.base import AttentionParams
from mhattn.backends.paired import PairedBackend
from mhattn.errors import BackendUnavailableError, UnknownBackendError
from mhattn.problem import Problem
from mhattn.reference.backend import ReferenceBackend
from mhattn.tuning import grid, measure, table


pytestmark = pytest.mark.usefixtures("private_tables")  # no timing table but the one a test makes


def leaves(batch=2, heads_q=4, heads_kv=4, seqlen_q=70, seqlen_k=90, head_dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads_q, seqlen_q, head_dim), (batch, heads_kv, seqlen_k, head_dim),
              (batch, heads_kv, seqlen_k, head_dim))
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in shapes]


def out_and_grads(backend, q, k, v, **kwargs):
    out = mhattn.attention(q, k, v, backend=backend, **kwargs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


@pytest.mark.parametrize("pair", ["reference+sdpa", "sdpa+reference"])
@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"enable_gqa": True}, {"scale": 0.3}],
                         ids=["plain", "causal", "gqa", "scale"])
def test_a_pairs_output_and_gradients_are_the_references(pair, kwargs):
    q, k, v = leaves(heads_q=4, heads_kv=2 if kwargs.get("enable_gqa") else 4,
                     seqlen_k=70 if kwargs.get("is_causal") else 90)
    got, want = out_and_grads(pair, q, k, v, **kwargs), out_and_grads("reference", q, k, v, **kwargs)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), f"{pair} {name}: {float((a - b).abs().max())}"


def test_the_pairs_halves_run_the_forward_and_the_backward(monkeypatch):
    ran = []
    reference, sdpa = registry.get_backend("reference"), registry.get_backend("sdpa")
    real_forward, real_backward = reference.forward, sdpa.backward
    monkeypatch.setattr(reference, "forward", lambda *a, **kw: ran.append("reference.forward") or real_forward(*a, **kw))
    monkeypatch.setattr(sdpa, "backward", lambda *a, **kw: ran.append("sdpa.backward") or real_backward(*a, **kw))
    q, k, v = leaves()
    out_and_grads("reference+sdpa", q, k, v)
    assert ran == ["reference.forward", "sdpa.backward"]


def test_pair_names_are_checked_and_spelled_one_way():
    assert dispatch.requested(" Reference + SDPA ") == ("reference+sdpa", "the backend= argument")
    assert registry.get_backend("reference+sdpa") is registry.get_backend("reference + sdpa")
    assert isinstance(registry.get_backend("sdpa+reference"), PairedBackend)
    for bad in ("sdpa+sdpa", "sdpa+", "+sdpa", "nothing+sdpa", "sdpa+reference+sdpa"):
        with pytest.raises(UnknownBackendError, match=r"joined by '\+'"):
            mhattn.attention(*leaves(), backend=bad)
    with pytest.raises(ValueError, match="without '\\+'"):
        mhattn.register_backend(type("Joined", (ReferenceBackend,), {"name": "a+b"})())


def test_a_pair_states_both_halves_reasons_and_explain_shows_both_paths():
    q, k, v = leaves()
    decision = mhattn.explain(q, k, v, backend="sdpa+reference")
    text = str(decision)
    assert decision.chosen == "sdpa+reference" and "forward: sdpa" in text and "backward: reference" in text
    with pytest.raises(BackendUnavailableError, match="backward on cupy: .*runs on"):
        mhattn.attention(q, k, v, backend="sdpa+cupy")
    # The backward's half is asked whether or not the call needs gradients.
    pair = registry.get_backend("reference+cupy")
    problem = Problem.from_tensors(q.detach(), k.detach(), v.detach(), AttentionParams(scale=0.2), causal=False,
                                   window=False)
    assert any(reason.startswith("backward on cupy") for reason in pair.unsupported(problem))
    with pytest.raises(BackendUnavailableError, match="backward on sdpa: .*softcap"):
        mhattn.attention(q.detach(), k.detach(), v.detach(), softcap=20.0, backend="reference+sdpa")


def test_a_pair_of_backends_that_may_draw_different_dropout_masks_refuses_dropout():
    class OwnDropout(ReferenceBackend):
        name = "own_dropout"

        def dropout_keep_mask(self, batch, heads, seqlen_q, seqlen_k, params, device):
            return ~super().dropout_keep_mask(batch, heads, seqlen_q, seqlen_k, params, device)

    mhattn.register_backend(OwnDropout())
    try:
        q, k, v = leaves()
        with pytest.raises(BackendUnavailableError, match="may draw different masks"):
            mhattn.attention(q, k, v, dropout_p=0.2, backend="own_dropout+reference")
        got = out_and_grads("own_dropout+reference", q, k, v)  # without dropout the pair runs
        want = out_and_grads("reference", q, k, v)
        assert all(torch.allclose(a, b, atol=2e-5) for a, b in zip(got, want))
    finally:
        mhattn.unregister_backend("own_dropout")


def test_automatic_selection_takes_a_pair_a_table_measured_fastest(monkeypatch):
    cpu = table.device_identity("cpu")
    cell = grid.Cell(dtype="fp32", batch=2, heads_q=4, heads_kv=4, seqlen_q=64, seqlen_k=64, head_dim=32)
    row = dict(cell.as_dict(), fwd_ms={"sdpa": 1.0, "reference": 2.0},
               fwd_bwd_ms={"sdpa": 5.0, "reference": 4.0, "sdpa+reference": 3.5}, skipped={})
    t = table.TimingTable(dict(cpu, torch=torch.__version__), [row], {"unix_time": 1.0})
    monkeypatch.setattr(table, "active_table", lambda *_: t)
    dispatch.clear_cache()
    q, k, v = leaves(seqlen_q=64, seqlen_k=64)
    decision = mhattn.explain(q, k, v)
    assert decision.chosen == "sdpa+reference" and "sdpa+reference 3.5 ms (fastest)" in str(decision)
    assert mhattn.explain(q.detach(), k.detach(), v.detach()).chosen == "sdpa"  # no gradient: the forward alone
    got, want = out_and_grads(None, q, k, v), out_and_grads("reference", q, k, v)
    assert all(torch.allclose(a, b, atol=2e-5, rtol=1e-4) for a, b in zip(got, want))


def test_tune_times_the_pair_of_the_fastest_forward_and_the_fastest_backward():
    row = {"fwd_ms": {"a": 1.0, "b": 2.0, "c": 3.0}, "fwd_bwd_ms": {"a": 6.0, "b": 5.0, "c": 5.5}}
    assert measure.fastest_apart(row) == ("a", "c")  # backward times: a 5.0, b 3.0, c 2.5
    row["fwd_bwd_ms"]["c"] = 6.0                     # a 5.0, b 3.0, c 3.0: the first of a tie
    assert measure.fastest_apart(row) == ("a", "b")
    assert measure.fastest_apart({"fwd_ms": {"a": 1.0, "b": 2.0}, "fwd_bwd_ms": {"a": 3.0, "b": 5.0}}) is None
    cell = grid.Cell("fp32", 1, 2, 2, 64, 64, 16)
    q, k, v, dout, kwargs = measure.make_inputs(cell, "cpu")
    row, calls = {"fwd_bwd_ms": {}, "skipped": {}}, {}
    measure.time_pair(("reference", "sdpa"), q, k, v, dout, kwargs, 0.5, 1.0, "cpu", row, calls)
    assert row["fwd_bwd_ms"]["reference+sdpa"] > 0 and "reference+sdpa" in calls and not row["skipped"]


def test_tune_does_not_time_a_pair_whose_gradients_differ():
    """The pair's gradients are compared with its backward backend's own. A backend consistent with itself but not
    with the contract (its lse shifted, and its backward shifting it back) matches itself alone, and not when it
    follows another backend's forward: what a pair adds, a backward misreading the other forward's output or lse."""

    class ShiftedLse(ReferenceBackend):
        name = "shifted_lse"

        def forward(self, q, k, v, params):
            out, lse = super().forward(q, k, v, params)
            return out, lse - 1.0

        def backward(self, grad_out, q, k, v, out, lse, params, grad_lse=None):
            return super().backward(grad_out, q, k, v, out, lse + 1.0, params, grad_lse)

    mhattn.register_backend(ShiftedLse())
    try:
        q, k, v, dout, kwargs = measure.make_inputs(grid.Cell("fp32", 1, 2, 2, 64, 64, 16), "cpu")
        row, calls = {"fwd_bwd_ms": {}, "skipped": {}}, {}
        measure.time_pair(("reference", "shifted_lse"), q, k, v, dout, kwargs, 0.5, 1.0, "cpu", row, calls)
    finally:
        mhattn.unregister_backend("shifted_lse")
    assert "differ from shifted_lse's own" in row["skipped"]["reference+shifted_lse"]
    assert not row["fwd_bwd_ms"] and not calls


@pytest.mark.parametrize("pair", ["reference+sdpa", "sdpa+reference"])
def test_pairs_pass_the_cpu_conformance_cases_they_declare(pair):
    """The conformance suite on a pair, as `mhattn conformance --full --backend reference+sdpa` runs it: every case
    either passes or is unsupported with a reason (what either half cannot do, KV caches and packed sequences)."""
    from mhattn.conformance.cases import full_cases
    from mhattn.conformance.runner import PASS, UNSUPPORTED, run_case

    backend = registry.get_backend(pair)
    results = [run_case(backend, case) for case in full_cases(backend, "cpu", ["fp32"])]
    failed = [f"{r.case.command()}: {r.summary()}" for r in results if r.status not in (PASS, UNSUPPORTED)]
    assert not failed, "\n".join(failed)
    passed = {r.case.feature for r in results if r.status == PASS}
    assert {"basic", "causal", "gqa", "bool_mask", "float_mask"} <= passed
    assert {"kvcache", "varlen"}.isdisjoint(passed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pair", ["triton+sdpa", "sdpa+triton", "cupy+sdpa", "triton+cupy"])
def test_gpu_pairs_pass_the_conformance_cases_and_a_long_sequence(pair):
    """On a GPU: each half's kernels read the other's output and lse as their own (layouts, strides, the lse's
    rows), over the quick conformance cases in fp16 and bf16, and at 2k keys at d = 128, causal and not, where the
    Hopper kernels run on an H100 (against the float64 reference, outputs and gradients)."""
    from mhattn.conformance.cases import quick_cases
    from mhattn.conformance.runner import PASS, UNSUPPORTED, run_case

    backend = registry.get_backend(pair)
    if backend.unavailable():
        pytest.skip("; ".join(backend.unavailable()))
    results = [run_case(backend, case) for case in quick_cases(backend, "cuda", ["fp16", "bf16"])]
    failed = [f"{r.case.command()}: {r.summary()}" for r in results if r.status not in (PASS, UNSUPPORTED)]
    assert not failed, "\n".join(failed)
    for causal in (False, True):
        gen = torch.Generator(device="cuda").manual_seed(3)
        q, k, v = (torch.randn(2, 4, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        out = mhattn.attention(q, k, v, is_causal=causal, backend=pair)
        grad_out = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref_out = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=causal)
        ref_grads = torch.autograd.grad(ref_out, ref, grad_out.double())
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
            err = float((got.double() - want).abs().max())
            assert err < 0.02 * max(1.0, float(want.abs().max())), f"{pair} causal={causal} {name}: {err}"


def test_bench_takes_a_pair_by_name():
    """`mhattn bench --impl sdpa+reference` (and --latency) measure a pair like a backend; other names stay unknown."""
    from mhattn.benchmark import protocol

    table = protocol.implementations()
    extended = protocol.with_pairs(table, ["sdpa+reference", "sdpa", "nothing+sdpa"])
    assert "sdpa+reference" in extended and "nothing+sdpa" not in extended and "sdpa+reference" not in table
    impl = extended["sdpa+reference"]
    assert impl.family == "mhattn" and not impl.is_reference
    q, k, v = (t.detach() for t in leaves(seqlen_k=70))
    assert impl.unsupported(q, k, v, True) == []
    assert torch.allclose(impl(q, k, v, True), mhattn.attention(q, k, v, is_causal=True, backend="reference"),
                          atol=2e-5)


def test_a_pair_under_torch_compile_gives_the_references_gradients():
    """The compiled path (mhattn's custom ops) runs the pair's forward and, from the op's record of it, its
    backward."""
    q, k, v = leaves(seqlen_k=70)
    compiled = torch.compile(lambda q, k, v: mhattn.attention(q, k, v, is_causal=True, backend="sdpa+reference"),
                             backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    want = out_and_grads("reference", q, k, v, is_causal=True)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), f"{name}: {float((a - b).abs().max())}"
