"""The dispatcher: precedence, MHATTN_BACKEND, use_backend, forced backends, explain, caching, registry."""

import threading
import warnings

import pytest
import torch

import mhattn
from mhattn import dispatch
from mhattn.backends.base import Backend, Capabilities
from mhattn.problem import Problem
from mhattn.reference import ReferenceBackend


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("MHATTN_BACKEND", raising=False)
    yield
    dispatch.clear_cache()


def qkv(requires_grad=False):
    return [torch.randn(1, 2, 5, 8, requires_grad=requires_grad) for _ in range(3)]


def test_unknown_env_value_lists_valid_names(monkeypatch):
    monkeypatch.setenv("MHATTN_BACKEND", "bogus")
    with pytest.raises(mhattn.UnknownBackendError) as info:
        mhattn.attention(*qkv())
    message = str(info.value)
    assert "bogus" in message
    for name in ("auto", "reference", "triton", "cupy"):
        assert name in message


def test_env_is_case_insensitive(monkeypatch, recorders):
    monkeypatch.setenv("MHATTN_BACKEND", "REC_A")
    mhattn.attention(*qkv())
    assert recorders[0].calls == ["forward"]


def test_precedence_argument_over_context_over_env(monkeypatch, recorders):
    a, b = recorders
    monkeypatch.setenv("MHATTN_BACKEND", "reference")
    with mhattn.use_backend("rec_a"):
        mhattn.attention(*qkv())
        mhattn.attention(*qkv(), backend="rec_b")
    assert a.calls == ["forward"] and b.calls == ["forward"]
    mhattn.attention(*qkv())  # env again: neither recorder
    assert a.calls == ["forward"] and b.calls == ["forward"]


def test_requested_reads_os_environ_at_each_call(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert dispatch.requested() == ("reference", f"{dispatch.ENV_VAR}=reference")
    monkeypatch.setenv(dispatch.ENV_VAR, "")  # set but empty: automatic selection
    assert dispatch.requested()[0] == "auto"
    monkeypatch.delenv(dispatch.ENV_VAR)
    assert dispatch.requested() == ("auto", "automatic selection")
    with mhattn.use_backend("reference"):
        assert dispatch.requested() == ("reference", "use_backend()")
        assert dispatch.requested("sdpa") == ("sdpa", "the backend= argument")
    with pytest.raises(TypeError, match="backend must be"):
        dispatch.requested(3)


def test_an_environment_request_follows_the_registry(monkeypatch):
    class Named(ReferenceBackend):
        name = "named"

    mhattn.register_backend(Named())
    monkeypatch.setenv(dispatch.ENV_VAR, "named")
    try:
        assert dispatch.requested()[0] == "named"
    finally:
        mhattn.unregister_backend("named")
    with pytest.raises(mhattn.UnknownBackendError, match="named"):  # not answered from before the change
        dispatch.requested()


def test_use_backend_restores_on_exit_and_on_error(recorders):
    a, _ = recorders
    with pytest.raises(RuntimeError):
        with mhattn.use_backend("rec_a"):
            raise RuntimeError("boom")
    mhattn.attention(*qkv())
    assert a.calls == []
    assert dispatch.requested()[0] == "auto"


def test_use_backend_is_per_thread(recorders):
    a, b = recorders
    barrier = threading.Barrier(2)
    errors = []

    def worker(name):
        try:
            with mhattn.use_backend(name):
                barrier.wait()
                for _ in range(3):
                    mhattn.attention(*qkv())
        except Exception as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("rec_a", "rec_b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert a.calls == ["forward"] * 3 and b.calls == ["forward"] * 3


def test_backward_runs_on_the_forward_backend_after_the_context_exits(recorders):
    a, _ = recorders
    q, k, v = qkv(requires_grad=True)
    with mhattn.use_backend("rec_a"):
        out = mhattn.attention(q, k, v)
    out.sum().backward()
    assert a.calls == ["forward", "backward"]


def test_forced_backend_that_cannot_run_raises_with_reasons():
    with pytest.raises(mhattn.BackendUnavailableError) as info:
        mhattn.attention(*qkv(), backend="triton")
    message = str(info.value)
    assert "triton" in message and "cpu" in message and "backend= argument" in message
    with mhattn.use_backend("triton"):
        with pytest.raises(mhattn.BackendUnavailableError, match=r"use_backend\(\)"):
            mhattn.attention(*qkv())


def test_explain_shows_choice_and_every_backends_reasons():
    q = torch.randn(1, 2, 5, 8)
    decision = mhattn.explain(q, q, q, is_causal=True)
    text = str(decision)
    assert decision.chosen == "sdpa"  # torch's fused CPU kernel comes before the reference on the CPU
    assert "chosen: sdpa" in text and "causal" in text
    for name in mhattn.backend_names():
        assert name in text
    assert decision.reasons["reference"] == [] and decision.reasons["sdpa"] == []
    assert decision.reasons["triton"]  # no GPU here, or the kernels are absent: there are reasons


class GpuOnly(Backend):
    name = "gpu_only"
    capabilities = Capabilities(device_types=frozenset({"cuda"}), features=frozenset({"causal"}))


def fake_gpu_problem(**overrides):
    fields = dict(device_type="cuda", device_index=0, compute_capability=(9, 0), dtype=torch.bfloat16, batch=1,
                  heads_q=2, heads_kv=2, seqlen_q=128, seqlen_k=128, head_dim=64, head_dim_v=64,
                  features=frozenset({"causal"}))
    fields.update(overrides)
    return Problem(**fields)


def test_capabilities_give_one_sentence_per_reason():
    reasons = GpuOnly().unsupported(fake_gpu_problem(dtype=torch.float64, head_dim=300, head_dim_v=300,
                                                     features=frozenset({"dropout", "causal"}),
                                                     compute_capability=(7, 5)))
    text = " | ".join(reasons)
    assert "float64" in text and "300" in text and "dropout" in text and "sm_75" in text
    assert len(reasons) == 4


def test_priority_is_data_and_auto_warns_once_when_the_gpu_falls_back_to_reference(monkeypatch):
    problem = fake_gpu_problem(dtype=torch.float64)  # no fused kernel takes float64
    assert dispatch.priority_for(problem)[-1] == "reference"
    dispatch._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = dispatch.select(problem, "auto")
        dispatch.select(problem, "auto")
    assert chosen.name == "reference"
    messages = [str(w.message) for w in caught if "mhattn" in str(w.message)]
    assert len(messages) == 1
    assert "triton" in messages[0]


def test_set_priority_enters_a_registered_backend_into_auto(recorders):
    a, _ = recorders
    saved = list(dispatch.PRIORITY)
    try:
        mhattn.set_priority("cpu", ["rec_a", "reference"])
        mhattn.attention(*qkv())
        assert a.calls == ["forward"]
    finally:
        dispatch.PRIORITY[:] = saved
        dispatch.clear_cache()


def test_registering_does_not_activate(recorders):
    mhattn.attention(*qkv())
    assert all(r.calls == [] for r in recorders)


def test_register_rejects_bad_backends():
    with pytest.raises(TypeError):
        mhattn.register_backend(object())
    with pytest.raises(ValueError, match="already registered"):
        mhattn.register_backend(ReferenceBackend())
    bad = ReferenceBackend()
    bad.name = "Auto"
    with pytest.raises(ValueError, match="lowercase"):
        mhattn.register_backend(bad)


def test_decisions_are_cached_per_problem():
    calls = []

    class Counting(ReferenceBackend):
        name = "counting"

        def unsupported(self, problem):
            calls.append(problem)
            return super().unsupported(problem)

    mhattn.register_backend(Counting())
    try:
        q = torch.randn(1, 2, 8, 8)
        mhattn.attention(q, q, q)
        first = len(calls)
        assert first >= 1
        for n in (5, 6, 7, 8, 8):  # one size bucket (5..8): the decision is reused, dynamic shapes included
            t = torch.randn(1, 2, n, 8)
            mhattn.attention(t, t, t)
        assert len(calls) == first
        t = torch.randn(1, 2, 9, 8)
        mhattn.attention(t, t, t)
        assert len(calls) > first
    finally:
        mhattn.unregister_backend("counting")


def test_select_decides_once_per_problem_and_request_until_the_registry_changes(monkeypatch):
    """The entry points that build their own Problem (KV cache, packed sequences, ring) call select per step:
    the decision is made once per (problem, request), and made again after a backend is (re)registered."""
    from mhattn.backends.sdpa import SdpaBackend
    from mhattn.problem import Problem

    calls = []
    real_decide = dispatch.decide
    monkeypatch.setattr(dispatch, "decide", lambda *a, **kw: calls.append(a) or real_decide(*a, **kw))
    problem = Problem.from_shapes(torch.device("cpu"), torch.float32, (1, 4, 16, 32), 4, 16, 32, 0)
    first = dispatch.select(problem, "auto")
    assert dispatch.select(problem, "auto") is first and len(calls) == 1
    dispatch.select(problem, "reference")
    assert len(calls) == 2
    mhattn.register_backend(SdpaBackend(), replace=True)
    dispatch.select(problem, "auto")
    assert len(calls) == 3


def test_a_repeated_call_is_answered_by_the_call_memo_until_the_registry_changes(monkeypatch, recorders):
    """backend_for_call memoises backend_for by the call's exact sizes and flags; what it answers is what
    backend_for answers, a changed request or flag is another entry, and a registry change clears it."""
    calls = []
    real_backend_for = dispatch.backend_for
    monkeypatch.setattr(dispatch, "backend_for", lambda *a, **kw: calls.append(a) or real_backend_for(*a, **kw))
    q = torch.randn(1, 2, 8, 8)
    mhattn.attention(q, q, q, backend="rec_a")
    mhattn.attention(q, q, q, backend="rec_a")
    assert len(calls) == 1 and recorders[0].calls == ["forward", "forward"]
    mhattn.attention(q, q, q, backend="rec_b")
    mhattn.attention(q, q, q, is_causal=True, backend="rec_b")
    mhattn.attention(q.requires_grad_(True), q, q, backend="rec_b")
    assert len(calls) == 4
    mhattn.register_backend(ReferenceBackend(), replace=True)
    mhattn.attention(q.detach(), q.detach(), q.detach(), backend="rec_a")
    assert len(calls) == 5 and recorders[0].calls == ["forward"] * 3


def test_environment_variables_read_at_every_call_follow_os_environ(monkeypatch):
    """mhattn.environment.raw_store sees every change made through os.environ, as MHATTN_TRITON_HOPPER's switch
    reads it at each call (set, changed, with spaces and capitals, unset)."""
    from mhattn import environment
    from mhattn.backends.triton import hopper_launch

    store, key = environment.raw_store("MHATTN_TEST_VARIABLE")
    monkeypatch.delenv("MHATTN_TEST_VARIABLE", raising=False)
    assert store.get(key) is None
    monkeypatch.setenv("MHATTN_TEST_VARIABLE", "x y")
    assert environment.decoded(store.get(key)) == "x y"
    for value, switch in ((" Always ", "always"), ("0", "0"), ("OFF", "off")):
        monkeypatch.setenv(hopper_launch.ENV_SWITCH, value)
        assert hopper_launch._switch() == switch
    monkeypatch.delenv(hopper_launch.ENV_SWITCH)
    assert hopper_launch._switch() == "1"
