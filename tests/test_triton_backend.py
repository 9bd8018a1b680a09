"""The Triton backend against the float64 reference, with CONFORMANCE.md's tolerance rule.

Three groups:

- plain CPU tests (capabilities, reasons, configuration parsing): no kernel runs;
- interpreter tests (marker ``interpret``): the kernels run on CPU tensors under Triton's interpreter.
  Triton decides whether to interpret when a kernel is *defined*, from ``TRITON_INTERPRET``, so
  setting the variable inside this pytest process would depend on import order and would change
  what other test modules see. Instead these checks run in one worker subprocess started with
  ``TRITON_INTERPRET=1`` that loads this file and runs the ``check_*`` functions it is asked for
  (one request per test, so failures stay per test). A process already started with
  ``TRITON_INTERPRET=1`` runs them in-process;
- GPU tests (marker ``gpu``): the same checks on CUDA in fp16 and bf16, determinism over 50 backward
  passes, and a tensor over 2**31 elements. They skip without a GPU.

Every backend output is allocated NaN-poisoned (torch's empty family is swapped during backend calls)
so an element the kernels never write fails the comparison.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading

import pytest
import torch

from mhattn.backends.base import AttentionParams
from mhattn.conformance.tolerance import compare
from mhattn.reference.naive import naive_attention

INTERPRETING = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SEED_WORDS = (0x9E3779B9, 0x7F4A7C15)  # both above 2**31 on purpose: the int32 bit-pattern path


# ---- helpers shared by the interpreter and GPU checks ---------------------------------------------------


@contextlib.contextmanager
def poisoned_allocations():
    """torch.empty & co. return NaN-filled floating tensors inside the block (unwritten output = NaN)."""
    saved = {
        (torch, "empty"): torch.empty,
        (torch, "empty_like"): torch.empty_like,
        (torch, "empty_strided"): torch.empty_strided,
        (torch.Tensor, "new_empty"): torch.Tensor.new_empty,
    }

    def wrap(fn):
        def poisoned(*args, **kwargs):
            t = fn(*args, **kwargs)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                t.fill_(float("nan"))
            return t

        return poisoned

    try:
        for (owner, name), fn in saved.items():
            setattr(owner, name, wrap(fn))
        yield
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)


def _backend():
    from mhattn.backends.triton import TritonBackend

    return TritonBackend()


def _pinned_config(device, config=None):
    """``config`` (a configs string) when given; else the interpreter's small tiles on the CPU (many blocks on
    small shapes) and the table on a GPU."""
    from mhattn.backends.triton import configs

    if config is not None:
        return configs.pin(config)
    if device == "cpu":
        return configs.pin(configs.INTERPRETER)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _deterministic_algorithms(on: bool):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


@contextlib.contextmanager
def _launched_backward_kernels():
    """{kernel name: launches} of the backward kernels inside the block, filled as it exits: the launches made
    through Triton (the interpreter's, a specialisation's first) and those through a kept handle (a GPU's repeats)."""
    from mhattn.backends.triton import backend as triton_backend

    kernels = triton_backend.launchers()
    launchers = [getattr(kernels, name) for name in ("preprocess", "dkdv", "dq", "short_backward")]
    launched = {}
    before = {launcher.name: launcher.handle_launches for launcher in launchers}
    for launcher in launchers:
        original = launcher._launch_through_triton

        def recorded(*args, _original=original, _name=launcher.name, **kwargs):
            launched[_name] = launched.get(_name, 0) + 1
            return _original(*args, **kwargs)

        launcher._launch_through_triton = recorded
    try:
        yield launched
    finally:
        for launcher in launchers:
            del launcher._launch_through_triton
            handled = launcher.handle_launches - before[launcher.name]
            if handled:
                launched[launcher.name] = launched.get(launcher.name, 0) + handled


def make_inputs(dtype, device, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v, layout,
                overflow, generator):
    """q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv): contiguous, or strided views of one packed
    (B, N, 3, H, D) projection (layout "packed", needs Nq = Nk, Hq = Hkv and D = Dv)."""

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)

    if layout == "packed":
        qkv = randn(batch, seqlen_q, 3, heads_q, head_dim)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        assert q.stride(2) == 3 * heads_q * head_dim and not q.is_contiguous()
    else:
        q = randn(batch, heads_q, seqlen_q, head_dim)
        k = randn(batch, heads_kv, seqlen_k, head_dim)
        v = randn(batch, heads_kv, seqlen_k, head_dim_v)
    if overflow:  # large scores: the softmax's max shift must hold
        q, k = (q.float() * 5).to(dtype), (k.float() * 3).to(dtype)
    return q, k, v


def make_mask(kind, batch, heads_q, seqlen_q, seqlen_k, device, generator, requires_grad):
    """A (B, Hq, Nq, Nk) broadcast view (stride 0 along B or H) of the kind asked for."""
    if kind is None:
        return None
    if kind.startswith("key_padding"):
        # (B, 1, 1, Nk) expanded: the kernels bound each batch entry's keys by it (key_padding.py). Right
        # padding, batch entry 0 with every key padded; "key_padding_holes": scattered keys padded too.
        lengths = torch.randint(seqlen_k // 3, seqlen_k + 1, (batch,), generator=generator)
        lengths[0] = 0
        keys = torch.arange(seqlen_k)[None, :] < lengths[:, None]
        if kind == "key_padding_left":  # the padding first, as a batch of prompts padded on the left has it
            keys = keys.flip(1)
        if kind == "key_padding_span":  # padding on both sides: each entry's keys one run that starts anywhere
            starts = (torch.rand(batch, generator=generator) * (seqlen_k - lengths + 1)).long()
            positions = torch.arange(seqlen_k)[None, :]
            keys = (positions >= starts[:, None]) & (positions < (starts + lengths)[:, None])
        if kind == "key_padding_holes":
            keys &= torch.rand(batch, seqlen_k, generator=generator) > 0.3
        return keys.view(batch, 1, 1, seqlen_k).to(device).expand(batch, heads_q, seqlen_q, seqlen_k)
    if kind == "key_bias":
        # (B, 1, 1, Nk) expanded: an additive key-padding bias (a small random bias on each sequence's kept prefix,
        # -inf past it), which the kernels read one row of keys a block (scores.MASK_KEYS_FLOAT)
        lengths = torch.randint(max(1, seqlen_k // 3), seqlen_k + 1, (batch, 1, 1, 1), generator=generator)
        base = torch.randn(batch, 1, 1, seqlen_k, generator=generator)
        base = base.masked_fill(torch.arange(seqlen_k) >= lengths, float("-inf")).to(device)
        if requires_grad:
            base.requires_grad_(True)
        return base.expand(batch, heads_q, seqlen_q, seqlen_k)
    if kind == "bool_per_head":  # each head its own keys hidden
        return (torch.rand(batch, heads_q, seqlen_q, seqlen_k, generator=generator) > 0.3).to(device)
    if kind.startswith("bool"):
        base = torch.rand(batch, 1, seqlen_q, seqlen_k, generator=generator) > 0.3  # broadcast over heads
        if kind == "bool_empty_rows":
            base[:, :, ::5] = False  # every fifth query row sees no key at all
        return base.to(device).expand(batch, heads_q, seqlen_q, seqlen_k)
    base = torch.randn(1, heads_q, seqlen_q, seqlen_k, generator=generator)  # broadcast over batch
    if kind == "float_neginf":
        base = base.masked_fill(torch.rand(base.shape, generator=generator) < 0.3, float("-inf"))
    base = base.to(device)
    if requires_grad:
        base.requires_grad_(True)
    return base.expand(batch, heads_q, seqlen_q, seqlen_k)


def _window_params(causal, window, seqlen_q, seqlen_k):
    diag_offset = seqlen_k - seqlen_q if causal == "bottom_right" else 0
    left, right = window if window is not None else (None, None)
    if causal is not None:
        right = 0 if right is None else min(right, 0)
    return diag_offset, left, right


def _reference(q, k, v, params, mask, keep_grad_mask, grad_out, grad_lse, dtype):
    """(out, lse, dq, dk, dv, dmask) of naive_attention in ``dtype`` with torch autograd."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    mask_leaf = None
    if mask is not None and mask.dtype != torch.bool:
        mask_leaf = mask.detach().to(dtype).contiguous().requires_grad_(keep_grad_mask)
        mask_arg = mask_leaf
    else:
        mask_arg = mask
    out, lse = naive_attention(*leaves, params, mask=mask_arg)
    loss = (out * grad_out.to(dtype)).sum()
    if grad_lse is not None:
        loss = loss + (lse * grad_lse.to(dtype)).sum()
    inputs = leaves + ([mask_leaf] if keep_grad_mask else [])
    grads = torch.autograd.grad(loss, inputs)
    dmask = grads[3] if keep_grad_mask else None
    return out.detach(), lse.detach(), grads[0], grads[1], grads[2], dmask


def failures_against_reference(q, k, v, params, grad_out, results) -> list:
    """CONFORMANCE.md's rule for a call without a mask: each of ``results`` (out, lse, dq, dk, dv) against the float64
    reference, with the reference in q's dtype as the low-precision error; the verdicts that fail, as text."""
    gold = _reference(q, k, v, params, None, False, grad_out, None, torch.float64)
    lowp = _reference(q, k, v, params, None, False, grad_out, None, q.dtype)
    verdicts = [compare(name, got.cpu(), gold[i].cpu(), lowp[i].cpu(), dtype=q.dtype)
                for i, (name, got) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), results))]
    return [str(verdict) for verdict in verdicts if not verdict.ok]


def check_attention(dtype="float16", device="cpu", batch=2, heads_q=2, heads_kv=None, seqlen_q=37, seqlen_k=45,
                    head_dim=32, head_dim_v=None, causal=None, window=None, mask=None, mask_grad=False,
                    dropout_p=0.0, softcap=None, layout="bhnd", overflow=False, grad_lse=False, det_runs=1,
                    seed=0, config=None, short=None):
    """Forward and backward of the Triton backend against the float64 reference (CONFORMANCE.md's rule:
    err <= factor * err_lowp + floor for fp16/bf16, relative 1e-4 for fp32). Raises AssertionError.
    ``config``: a configs string to pin (the Hopper paths, say); det_runs > 1 runs the backward that many
    times under torch.use_deterministic_algorithms(True) and requires bitwise-equal gradients.
    ``short`` True / False: no tile pinned (the backend's own choice), and every backward must run as the short
    backward's one launch (backward_short_kernel) / must not (the three FlashAttention-2 kernels)."""
    dt = DTYPES[dtype]
    heads_kv = heads_kv or heads_q
    head_dim_v = head_dim_v or head_dim
    gen = torch.Generator().manual_seed(1234 + seed)
    q, k, v = make_inputs(dt, device, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v, layout,
                          overflow, gen)
    attn_mask = make_mask(mask, batch, heads_q, seqlen_q, seqlen_k, device, gen, mask_grad)
    diag_offset, left, right = _window_params(causal, window, seqlen_q, seqlen_k)
    params = AttentionParams(scale=head_dim ** -0.5, diag_offset=diag_offset, window_left=left, window_right=right,
                             mask=attn_mask, mask_requires_grad=mask_grad, dropout_p=dropout_p,
                             seed=SEED_WORDS if dropout_p else (0, 0), softcap=softcap)
    grad_out = torch.randn(batch, heads_q, seqlen_q, head_dim_v, generator=gen).to(device=device, dtype=dt)
    glse = torch.randn(batch, heads_q, seqlen_q, generator=gen).to(device) if grad_lse else None

    backend = _backend()
    pinned = contextlib.nullcontext() if short is not None else _pinned_config(device, config)
    with pinned, poisoned_allocations(), _deterministic_algorithms(det_runs > 1):
        out, lse = backend.forward(q, k, v, params)
        with _launched_backward_kernels() as launched:
            grads = [backend.backward(grad_out, q, k, v, out, lse, params, grad_lse=glse) for _ in range(det_runs)]
    if short is not None:
        expected = {"backward_short_kernel": det_runs} if short else {}
        ran_short = {name: n for name, n in launched.items() if name == "backward_short_kernel"}
        assert ran_short == expected, f"backward kernels launched: {launched}"
        assert not short or launched == expected, f"the short backward is one launch, got {launched}"
    dq, dk, dv, dmask = grads[0]
    assert out.dtype == dt and lse.dtype == torch.float32 and out.shape == (batch, heads_q, seqlen_q, head_dim_v)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for again in grads[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), grads[0], again):
            assert torch.equal(a, b), f"{name} differs between two backward passes (not deterministic)"
    if mask_grad:
        assert dmask is not None and dmask.shape == attn_mask.shape and dmask.dtype == attn_mask.dtype
    else:
        assert dmask is None

    gold = _reference(q, k, v, params, attn_mask, mask_grad, grad_out, glse, torch.float64)
    lowp = None if dt == torch.float32 else _reference(q, k, v, params, attn_mask, mask_grad, grad_out, glse, dt)
    # Gradients that cancel to exactly 0 (a single visible key: P = 1, dS = 0) are judged on the scale of
    # the largest gradient, the size of the cancelling terms (the conformance runner does the same).
    grad_scale = max(float(g.abs().max()) for g in gold[2:5])
    results = []
    for i, (name, x) in enumerate((("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv), ("dmask", dmask))):
        if x is None:
            continue
        floor_scale = grad_scale if name in ("dq", "dk", "dmask") and bool((gold[i] == 0).all()) else None
        results.append(compare(name, x.cpu(), gold[i].cpu(), None if lowp is None else lowp[i].cpu(), dtype=dt,
                               floor_scale=floor_scale))
    if mask in ("bool_empty_rows", "key_padding", "key_padding_left", "key_padding_span"):
        empty = ~attn_mask[:, :, :, :].any(-1)
        assert bool((out[empty] == 0).all()), "a row that sees no key must give 0"
        assert bool((lse[empty] == float("-inf")).all()), "a row that sees no key must give lse -inf"
        assert bool((dq[empty] == 0).all()), "a row that sees no key must get dq 0"
    failed = [str(r) for r in results if not r.ok]
    assert not failed, "; ".join(failed) + " | all: " + "; ".join(str(r) for r in results)


def check_dropout_bits(device="cpu", batch=2, heads=3, seqlen_q=19, seqlen_k=70):
    """The Triton RNG helpers write the same 32-bit words as the torch specification."""
    from mhattn.dropout_rng import random_bits

    bits = _backend().dropout_bits(batch, heads, seqlen_q, seqlen_k, SEED_WORDS, device)
    spec = random_bits(SEED_WORDS, batch, heads, seqlen_q, seqlen_k, device=device)
    assert torch.equal(bits, spec), f"{int((bits != spec).sum())} of {bits.numel()} words differ from the spec"


def check_dropout_mask_in_attention(device="cpu", dtype="float32", batch=1, heads=2, seqlen_q=21, p=0.3):
    """Attention with V = identity returns P * keep / (1 - p), so out != 0 is the kernel's keep-mask:
    it must equal Backend.dropout_keep_mask (the torch specification)."""
    seqlen_k = head_dim_v = 32
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(batch, heads, seqlen_q, 16, generator=gen).to(device=device, dtype=dt)
    k = torch.randn(batch, heads, seqlen_k, 16, generator=gen).to(device=device, dtype=dt) * 0.5
    v = torch.eye(seqlen_k, dtype=dt, device=device).expand(batch, heads, seqlen_k, head_dim_v)
    params = AttentionParams(scale=0.25, dropout_p=p, seed=SEED_WORDS)
    backend = _backend()
    with _pinned_config(device):
        out, _ = backend.forward(q, k, v, params)
    kernel_keep = out != 0
    spec_keep = backend.dropout_keep_mask(batch, heads, seqlen_q, seqlen_k, params, device)
    assert torch.equal(kernel_keep, spec_keep), f"{int((kernel_keep != spec_keep).sum())} keep decisions differ"
    assert 0.5 < float(spec_keep.float().mean()) < 0.9


def check_interpreter_capabilities():
    """Under TRITON_INTERPRET=1 the backend declares CPU tensors and has nothing against running."""
    backend = _backend()
    assert "cpu" in backend.capabilities.device_types
    assert backend.unavailable() == []


def check_through_attention(dtype="float16"):
    """mhattn.attention(backend="triton") end to end on CPU tensors: custom ops, autograd, mask gradient."""
    import mhattn

    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 20, 16, generator=gen).to(dt).requires_grad_() for _ in range(3))
    mask = torch.randn(3, 20, 20, generator=gen).to(dt).requires_grad_()
    with _pinned_config("cpu"):
        out = mhattn.attention(q, k, v, attn_mask=mask, backend="triton")
        out.float().square().sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, mask)]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves)
    ref.square().sum().backward()
    for name, got, want in zip(("out", "dq", "dk", "dv", "dmask"), (out, q.grad, k.grad, v.grad, mask.grad),
                               (ref, *(t.grad for t in leaves))):
        err = float((got.double() - want).abs().max())
        assert err < 2e-2 * max(1.0, float(want.abs().max())), f"{name}: max error {err}"


def check_preprocess_zeroes_the_hopper_sums(zero_words=5000, guard=300):
    """The backward preprocess with ZERO_BLOCK on (what a one-launch Gluon Hopper backward asks of it): its programs
    zero exactly zero_words words of a NaN-poisoned buffer, chunk by chunk (the last chunk partial), and leave the
    words after them alone; delta and lse2 are the same as without it (the rows' sums of dO * O; lse in base 2, +inf
    for a row that saw no key)."""
    from mhattn.backends.triton import backend as triton_backend
    from mhattn.backends.triton.backward import backward_preprocess_kernel

    gen = torch.Generator().manual_seed(5)
    batch, heads, seqlen, head_dim, block_m = 2, 3, 70, 16, 64
    out, grad_out = (torch.randn(batch, heads, seqlen, head_dim, generator=gen) for _ in range(2))
    lse = torch.randn(batch, heads, seqlen, generator=gen)
    lse[0, 1, 5] = float("-inf")
    num_blocks = -(-seqlen // block_m)
    programs = batch * heads * num_blocks
    chunk = -(-(-(-zero_words // programs)) // triton_backend.ZERO_BLOCK) * triton_backend.ZERO_BLOCK
    results = []
    for zero_block in (0, triton_backend.ZERO_BLOCK):
        delta, lse2 = (torch.full((batch, heads, seqlen), float("nan")) for _ in range(2))
        zero = torch.full((zero_words + guard,), float("nan"))
        backward_preprocess_kernel[(programs,)](
            out, grad_out, lse, lse, delta, lse2, zero, *out.stride()[:3], *grad_out.stride()[:3], *lse.stride(),
            *lse.stride(), heads, seqlen, num_blocks, delta.stride(1), zero_words if zero_block else 0, chunk,
            HEAD_DIM_V=head_dim, BLOCK_DV=head_dim, BLOCK_M=block_m, HAS_GRAD_LSE=False, ZERO_BLOCK=zero_block)
        results.append((delta, lse2, zero))
    (delta, lse2, untouched), (delta_z, lse2_z, zero) = results
    assert torch.isnan(untouched).all()  # ZERO_BLOCK = 0 writes nothing there
    assert torch.equal(zero[:zero_words], torch.zeros(zero_words)) and torch.isnan(zero[zero_words:]).all()
    assert torch.equal(delta, delta_z) and torch.equal(lse2, lse2_z)
    assert torch.allclose(delta, (out * grad_out).sum(-1), atol=1e-5)
    want = torch.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    assert torch.allclose(lse2, want)


# ---- running checks under the interpreter -----------------------------------------------------------------

_WORKER_MAIN = r"""
import importlib.util, json, os, sys, traceback
replies = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # whatever the checks print goes to stderr, not into the replies
sys.path.insert(0, os.path.dirname(sys.argv[1]))  # the test files import each other's helpers
spec = importlib.util.spec_from_file_location("_triton_backend_checks", sys.argv[1])
checks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(checks)
replies.write(json.dumps({"ready": True}) + "\n")
for line in sys.stdin:
    request = json.loads(line)
    try:
        getattr(checks, request["check"])(**request["kwargs"])
        reply = {"ok": True}
    except BaseException:
        reply = {"ok": False, "error": traceback.format_exc()}
    replies.write(json.dumps(reply) + "\n")
"""


class _InterpreterWorker:
    """One child Python with TRITON_INTERPRET=1 that runs check functions of a test file (this one by
    default) on request."""

    def __init__(self, path=__file__):
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
        env.pop("MHATTN_TRITON_CONFIG", None)
        self.process = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN, os.path.abspath(path)], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lock = threading.Lock()
        ready = self.process.stdout.readline()
        if not ready:
            raise RuntimeError("the interpreter worker exited while starting (see stderr)")

    def run(self, check, **kwargs):
        with self.lock:
            self.process.stdin.write(json.dumps({"check": check, "kwargs": kwargs}) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        if not line:
            pytest.fail(f"the interpreter worker died during {check}", pytrace=False)
        reply = json.loads(line)
        if not reply["ok"]:
            pytest.fail(f"{check}({kwargs}) under TRITON_INTERPRET=1:\n{reply['error']}", pytrace=False)

    def close(self):
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class _InProcess:
    """Runs the check functions of a test module (its globals ``namespace``) in this process, which already
    interprets Triton."""

    def __init__(self, namespace):
        self.namespace = namespace

    def run(self, check, **kwargs):
        self.namespace[check](**kwargs)

    def close(self):
        pass


def interpreter_worker(path, namespace):
    """The body of a test module's ``interpreter`` fixture: a worker that runs the module's check functions
    under TRITON_INTERPRET=1 (in this process when it already interprets, else in a child for ``path``)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    worker = _InProcess(namespace) if INTERPRETING else _InterpreterWorker(path)
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def interpreter():
    yield from interpreter_worker(__file__, globals())


# ---- plain CPU tests (no kernel runs) ---------------------------------------------------------------------


def test_capabilities_declare_every_feature_and_dtype():
    from mhattn.backends.base import FEATURES

    caps = _backend().capabilities
    assert set(caps.features) == set(FEATURES)
    assert caps.dtypes == {torch.float16, torch.bfloat16, torch.float32}
    assert (caps.min_head_dim, caps.max_head_dim) == (1, 256)
    assert "cuda" in caps.device_types
    assert ("cpu" in caps.device_types) == INTERPRETING


@pytest.mark.skipif(HAS_CUDA or INTERPRETING, reason="only without a GPU and without TRITON_INTERPRET")
def test_unavailable_says_why_without_gpu():
    reasons = _backend().unavailable()
    assert reasons and any("CUDA" in r or "triton" in r for r in reasons)


def test_unsupported_reasons_are_sentences():
    from mhattn.problem import Problem

    problem = Problem(device_type="cuda", device_index=0, compute_capability=(9, 0), dtype=torch.float64, batch=1,
                      heads_q=2, heads_kv=2, seqlen_q=8, seqlen_k=8, head_dim=300, head_dim_v=300,
                      features=frozenset({"causal"}))
    reasons = _backend().unsupported(problem)
    assert "head dim 300 > 256" in reasons
    assert "value head dim 300 > 256" in reasons
    assert any("float64" in r for r in reasons)
    old = Problem(device_type="cuda", device_index=0, compute_capability=(7, 5), dtype=torch.float16, batch=1,
                  heads_q=2, heads_kv=2, seqlen_q=8, seqlen_k=8, head_dim=64, head_dim_v=64, features=frozenset())
    assert any("sm_80" in r for r in _backend().unsupported(old))


def test_tensor_maps_need_aligned_rows_and_no_broadcast_batch_or_head():
    """The copy-engine paths (the Hopper kernels' 4-D tensor maps, the descriptor loads) take tensors whose rows and
    starts are 16-byte aligned and whose batch and head dims are not broadcast; a size-1 dim's stride is free."""
    from mhattn.backends.triton.backend import _descriptor_ready

    q = torch.randn(2, 4, 64, 64, dtype=torch.float16)
    assert _descriptor_ready(q)
    assert not _descriptor_ready(q[:1].expand(2, 4, 64, 64))        # batch broadcast (stride 0)
    assert not _descriptor_ready(q[:, :1].expand(2, 4, 64, 64))     # head broadcast (stride 0)
    assert _descriptor_ready(q[:1, :1])                              # size-1 dims
    assert not _descriptor_ready(torch.randn(2, 4, 64, 65, dtype=torch.float16)[..., :64])  # 130-byte rows


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_hopper_tensor_maps_describe_the_tensors_as_the_kernels_read_them():
    """hopper_launch's host tensor maps: the tensor's own 4-D shape and strides (a size-1 dim's stride replaced by
    one the copy engine accepts), the kernels' blocks, a swizzled layout for tiles and none for per-row values."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from mhattn.backends.triton import hopper_launch

    q = torch.randn(3, 8, 200, 128, dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, D)
    k = torch.randn(1, 2, 300, 128, dtype=torch.bfloat16)
    q_map, k_map, v_map, o_map = hopper_launch.forward_maps(q, k, k, q, 128)
    assert list(q_map.shape) == [3, 8, 200, 128] and list(q_map.strides) == list(q.stride())
    assert list(q_map.block_shape) == [1, 1, hopper_launch.QUERY_ROWS_PER_CONSUMER, 128]
    assert list(k_map.strides) == [2 * 300 * 128, 300 * 128, 128, 1]  # batch of one: a stride the map accepts
    assert list(k_map.block_shape) == [1, 1, hopper_launch.KEY_BLOCK[128], 128]
    assert q_map.layout.swizzle_byte_width == 128 and q_map.layout.rank == 4
    # The forward stages each output tile in its Q slot for the copy engine: the same blocks in the same layout.
    assert list(o_map.strides) == list(q.stride()) and o_map.block_shape == q_map.block_shape
    assert o_map.layout == q_map.layout
    rows = torch.zeros(3, 8, 2, 200, dtype=torch.float32)[:, :, 0]
    dk = torch.empty_like(k)
    maps = hopper_launch.backward_maps(q, k, k, q, rows, rows, torch.zeros(q.shape), dk, dk, 128)
    assert maps[4].layout.swizzle_byte_width == 0 and list(maps[4].block_shape) == [1, 1, 64]
    assert list(maps[6].block_shape) == [1, 1, 64, 128] and maps[6].base.dtype == torch.float32
    # dK and dV are staged in K's and V's tiles for the copy engine: the same blocks in the same layout.
    assert maps[7].base is dk and maps[7].block_shape == maps[1].block_shape and maps[7].layout == maps[1].layout


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_hopper_kernels_take_head_dims_96_and_192_in_wider_tiles():
    """Head dims 96 and 192 run the Gluon kernels' 128- and 256-wide builds: the maps keep the tensor's own width (the
    copy engine zero-fills the columns past it and clips them from its stores) in blocks of the tile width, the builds
    get both (HEAD_DIM the tile, HEAD_COLS the head dim; products split to the head dim in the d = 192 forward and in
    both backwards), and the rule takes them where it takes their tile width; other widths stay on the FlashAttention-2
    kernels, with a reason that names the head dims taken."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from mhattn.backends.triton import hopper_launch

    for head_dim, width in ((96, 128), (192, 256)):
        q = torch.randn(2, 4, 300, head_dim, dtype=torch.bfloat16)
        q_map, k_map, _, o_map = hopper_launch.forward_maps(q, q, q, q, head_dim)
        assert list(q_map.shape) == [2, 4, 300, head_dim] and q_map.block_shape[-1] == width
        assert k_map.block_shape == [1, 1, hopper_launch.KEY_BLOCK[width], width]
        rows = torch.zeros(2, 4, 300, dtype=torch.float32)
        maps = hopper_launch.backward_maps(q, q, q, q, rows, rows, torch.zeros(q.shape), q, q, head_dim)
        assert maps[6].block_shape[-1] == min(width, 128) and list(maps[6].shape)[-1] == head_dim
        assert maps[1].block_shape == [1, 1, hopper_launch.BACKWARD_KEY_BLOCK[width], width]
        forward_args = hopper_launch.compile_time_args(head_dim, True, seqlen_k=300)
        backward_args = hopper_launch.backward_compile_time_args(head_dim, True)
        assert (forward_args["HEAD_DIM"], forward_args["HEAD_COLS"]) == (width, head_dim)
        assert (backward_args["HEAD_DIM"], backward_args["HEAD_COLS"]) == (width, head_dim)
        # Every setting but the columns (and the forward's split products at d = 192) is the tile width's.
        split = head_dim in hopper_launch.FORWARD_SPLIT_HEAD_DIMS
        assert forward_args["SPLIT_PRODUCTS"] == split and split == (head_dim == 192)
        assert ({**forward_args, "HEAD_COLS": width, "SPLIT_PRODUCTS": False}
                == hopper_launch.compile_time_args(width, True, seqlen_k=300))
        assert backward_args["SPLIT_PRODUCTS"] == (head_dim in (96, 192))
        assert ({**backward_args, "HEAD_COLS": width, "SPLIT_PRODUCTS": False}
                == hopper_launch.backward_compile_time_args(width, True))
        for min_keys in (hopper_launch.MIN_KEYS, hopper_launch.BACKWARD_MIN_KEYS):
            assert hopper_launch._rule("1", True, torch.bfloat16, head_dim, head_dim, 4096, 4096, True, False, False,
                                       min_keys, {}) is None
    reason = hopper_launch._rule("1", True, torch.bfloat16, 80, 80, 4096, 4096, True, False, False,
                                 hopper_launch.MIN_KEYS, {})
    assert reason == "head dims 80/80 (equal, one of [64, 96, 128, 192, 256])"
    assert "head dims 96/128" in hopper_launch._rule("1", True, torch.bfloat16, 96, 128, 4096, 4096, True, False,
                                                       False, hopper_launch.MIN_KEYS, {})


def test_config_parsing_and_pinning():
    from mhattn.backends.triton import configs

    one = configs.parse("64,32,4,2")
    assert one.forward == one.dkdv == one.dq == configs.KernelConfig(64, 32, 4, 2)
    per = configs.parse("fwd=128,64,8,3;dkdv=64,128,8,2;dq=128,64,8,2")
    assert per.dkdv.block_n == 128 and str(per) == "fwd=128,64,8,3;dkdv=64,128,8,2;dq=128,64,8,2"
    with pytest.raises(ValueError, match="BLOCK_M"):
        configs.parse("48,32,4,2")
    with pytest.raises(ValueError, match="missing"):
        configs.parse("fwd=64,64,4,2")
    with configs.pin("32,32,4,1"):
        assert configs.config_for((9, 0), torch.bfloat16, 128, False).forward.block_m == 32
    assert configs.config_for((9, 0), torch.bfloat16, 128, False) == configs.TABLE[("sm90", "half", 128, False)]
    assert configs.config_for(None, torch.float16, 40, True) == configs.INTERPRETER
    short = configs.config_for((9, 0), torch.bfloat16, 128, True, seqlen_q=512)
    assert short.forward == configs.SHORT_FORWARD[("sm90", "half", 128, True)][0][1]
    # At d = 64 without a causal mask the short forward's tile follows the key count; long queries keep the table's.
    short_keys = configs.config_for((9, 0), torch.bfloat16, 64, False, seqlen_q=197, seqlen_k=197).forward
    more_keys = configs.config_for((9, 0), torch.bfloat16, 64, False, seqlen_q=197, seqlen_k=512).forward
    assert (short_keys.block_m, short_keys.block_n, more_keys.block_m, more_keys.block_n) == (128, 32, 64, 32)
    masked = configs.config_for((9, 0), torch.bfloat16, 64, False, seqlen_q=197, seqlen_k=197, masked=True).forward
    assert (masked.block_m, masked.block_n) == (64, 32)  # 128 x 32 spills with a mask
    assert configs.config_for((9, 0), torch.bfloat16, 64, False, seqlen_q=4096, seqlen_k=197, masked=True) == \
        configs.TABLE[("sm90", "half", 64, False)]  # long query sequences keep the table
    assert configs.config_for((9, 0), torch.bfloat16, 64, False, seqlen_q=4096, seqlen_k=197) == \
        configs.TABLE[("sm90", "half", 64, False)]
    assert short.dkdv == configs.TABLE[("sm90", "half", 128, True)].dkdv
    assert [configs.padded_head_dim(d) for d in (1, 16, 17, 59, 256)] == [16, 16, 32, 64, 256]
    assert configs.shrink(configs.KernelConfig(16, 16, 4, 1)) is None


# ---- interpreter tests (CPU tensors, TRITON_INTERPRET=1 in a worker process) -------------------------------

CPU_CASES = {
    "plain_fp16": dict(),
    "plain_fp32": dict(dtype="float32", seqlen_q=29, seqlen_k=50),
    "causal_top_left_q_lt_k": dict(causal="top_left", seqlen_q=37, seqlen_k=61),
    "causal_top_left_q_gt_k": dict(causal="top_left", seqlen_q=50, seqlen_k=33, dtype="float32"),
    "causal_bottom_right_q_lt_k": dict(causal="bottom_right", seqlen_q=23, seqlen_k=64),
    "causal_bottom_right_q_gt_k": dict(causal="bottom_right", seqlen_q=53, seqlen_k=30),  # first rows see nothing
    "gqa_causal": dict(heads_q=6, heads_kv=2, batch=1, causal="bottom_right", seqlen_q=33, seqlen_k=40),
    "mqa": dict(heads_q=4, heads_kv=1, batch=1, seqlen_q=20, seqlen_k=35, dtype="float32"),
    "bool_mask": dict(mask="bool", seqlen_q=30, seqlen_k=47),
    "bool_mask_empty_rows": dict(mask="bool_empty_rows", seqlen_q=30, seqlen_k=40, dtype="float32"),
    "float_mask_grad": dict(mask="float", mask_grad=True, seqlen_q=33, seqlen_k=41),
    "key_padding_right": dict(mask="key_padding", batch=3, seqlen_q=30, seqlen_k=70, heads_q=4, heads_kv=2),
    "key_padding_holes_causal_fp32": dict(mask="key_padding_holes", batch=3, seqlen_q=40, seqlen_k=57,
                                          dtype="float32", causal=None, window=(30, 10)),
    "float_mask_grad_fp32_causal": dict(mask="float", mask_grad=True, dtype="float32", causal="top_left",
                                        seqlen_q=30, seqlen_k=30),
    "float_mask_neginf": dict(mask="float_neginf", seqlen_q=20, seqlen_k=52),
    "key_bias": dict(mask="key_bias", batch=3, seqlen_q=30, seqlen_k=70, heads_q=4, heads_kv=2),
    "key_bias_grad_causal_fp32": dict(mask="key_bias", mask_grad=True, batch=2, dtype="float32", causal="top_left",
                                      seqlen_q=30, seqlen_k=41),
    "dropout": dict(dropout_p=0.17, seqlen_q=33, seqlen_k=49),
    "dropout_causal_gqa_fp32": dict(dropout_p=0.17, dtype="float32", causal="top_left", heads_q=4, heads_kv=2,
                                    batch=1, seqlen_q=30, seqlen_k=30),
    "window": dict(window=(9, 4), seqlen_q=45, seqlen_k=50),
    "window_left_only_bottom_right": dict(window=(7, None), causal="bottom_right", seqlen_q=30, seqlen_k=47,
                                          dtype="float32"),
    "softcap": dict(softcap=3.0, overflow=True, seqlen_q=30, seqlen_k=37),
    "softcap_float_mask_grad": dict(softcap=5.0, mask="float", mask_grad=True, dtype="float32",
                                    seqlen_q=21, seqlen_k=34),
    "head_dim_40": dict(head_dim=40, seqlen_q=25, seqlen_k=33),
    "head_dim_3": dict(head_dim=3, seqlen_q=19, seqlen_k=28, dtype="float32"),
    "head_dim_1": dict(head_dim=1, seqlen_q=17, seqlen_k=20),
    "value_dim": dict(head_dim=24, head_dim_v=40, seqlen_q=22, seqlen_k=35),
    "single_query": dict(seqlen_q=1, seqlen_k=77, heads_q=4, heads_kv=2),
    "single_query_causal_bottom_right": dict(seqlen_q=1, seqlen_k=50, causal="bottom_right", dtype="float32"),
    "single_query_single_key": dict(seqlen_q=1, seqlen_k=1),
    "packed_qkv_views": dict(layout="packed", seqlen_q=40, seqlen_k=40, heads_q=3, causal="top_left"),
    "grad_lse": dict(grad_lse=True, causal="bottom_right", seqlen_q=26, seqlen_k=35),
    "overflow": dict(overflow=True, seqlen_q=32, seqlen_k=48),
    "deterministic": dict(det_runs=3, heads_q=4, heads_kv=2, batch=1, seqlen_q=40, seqlen_k=40, causal="top_left"),
}

# The sm_90 paths under the interpreter: K/V (and Q/dO in the backward) through tensor descriptors, dQ summed
# with atomics in the dK/dV kernel; the interpreter zero-fills descriptor reads past the ends as TMA does.
HOPPER_INTERPRETER = "fwd=16,16,4,1,tma,ws;dkdv=16,16,4,1,tma,ws;dq=atomic"
HOPPER_CPU_CASES = {
    "plain_fp16": dict(seqlen_q=37, seqlen_k=45),
    "causal_bottom_right_gqa": dict(heads_q=6, heads_kv=2, batch=1, causal="bottom_right", seqlen_q=33,
                                    seqlen_k=40, dtype="float32"),
    "head_dim_40_window_dropout": dict(head_dim=40, window=(9, 4), dropout_p=0.17, seqlen_q=45, seqlen_k=50),
    "softcap_bool_mask": dict(softcap=3.0, mask="bool_empty_rows", seqlen_q=30, seqlen_k=40, dtype="float32"),
    "packed_qkv_views_grad_lse": dict(layout="packed", seqlen_q=40, seqlen_k=40, heads_q=3, causal="top_left",
                                      grad_lse=True),
    "float_mask_grad_falls_back_to_dq_kernel": dict(mask="float", mask_grad=True, seqlen_q=33, seqlen_k=41),
    "deterministic_falls_back_to_dq_kernel": dict(det_runs=2, heads_q=4, heads_kv=2, batch=1, seqlen_q=40,
                                                  seqlen_k=40, causal="top_left"),
}


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_interpreter_attention(interpreter, case):
    interpreter.run("check_attention", **CPU_CASES[case])


# The short backward (backward_short_kernel: every key in one block, one launch) on the backend's own tiles, with
# the features it covers; a gradient into the lse or the mask keeps the three kernels.
SHORT_CPU_CASES = {
    "plain_fp16": dict(short=True),
    "causal_top_left_q_lt_k": dict(short=True, causal="top_left", seqlen_q=37, seqlen_k=61),
    "causal_bottom_right_q_gt_k_first_rows_see_nothing": dict(short=True, causal="bottom_right", seqlen_q=53,
                                                              seqlen_k=30, dtype="float32"),
    "gqa_causal": dict(short=True, heads_q=6, heads_kv=2, batch=1, causal="bottom_right", seqlen_q=33, seqlen_k=40),
    "bool_mask_empty_rows": dict(short=True, mask="bool_empty_rows", seqlen_q=30, seqlen_k=40, dtype="float32"),
    "key_padding_right": dict(short=True, mask="key_padding", batch=3, seqlen_q=30, seqlen_k=70, heads_q=4,
                              heads_kv=2),
    "key_padding_holes_window_fp32": dict(short=True, mask="key_padding_holes", batch=3, seqlen_q=40, seqlen_k=57,
                                          dtype="float32", window=(30, 10)),
    "float_mask_neginf": dict(short=True, mask="float_neginf", seqlen_q=20, seqlen_k=52),
    "key_bias_window": dict(short=True, mask="key_bias", batch=3, seqlen_q=30, seqlen_k=70, heads_q=4, heads_kv=2,
                            window=(20, 5)),
    "dropout_causal_gqa_fp32": dict(short=True, dropout_p=0.17, dtype="float32", causal="top_left", heads_q=4,
                                    heads_kv=2, batch=1, seqlen_q=30, seqlen_k=30),
    "window": dict(short=True, window=(9, 4), seqlen_q=45, seqlen_k=50),
    "softcap_overflow": dict(short=True, softcap=3.0, overflow=True, seqlen_q=30, seqlen_k=37),
    "value_dim": dict(short=True, head_dim=24, head_dim_v=40, seqlen_q=22, seqlen_k=35),
    "head_dim_3_fp32": dict(short=True, head_dim=3, seqlen_q=19, seqlen_k=28, dtype="float32"),
    "single_query": dict(short=True, seqlen_q=1, seqlen_k=77, heads_q=4, heads_kv=2),
    "single_query_single_key": dict(short=True, seqlen_q=1, seqlen_k=1),
    "packed_qkv_views": dict(short=True, layout="packed", seqlen_q=40, seqlen_k=40, heads_q=3, causal="top_left"),
    "deterministic": dict(short=True, det_runs=3, heads_q=4, heads_kv=2, batch=1, seqlen_q=40, seqlen_k=40,
                          causal="top_left"),
    "most_keys_at_d64": dict(short=True, head_dim=64, seqlen_q=70, seqlen_k=128, dtype="float32", batch=1),
    "more_keys_than_one_block": dict(short=False, head_dim=64, seqlen_q=20, seqlen_k=129, dtype="float32", batch=1),
    "grad_lse_keeps_three_kernels": dict(short=False, grad_lse=True, causal="bottom_right", seqlen_q=26,
                                         seqlen_k=35),
    "mask_grad_keeps_three_kernels": dict(short=False, mask="float", mask_grad=True, seqlen_q=33, seqlen_k=41),
}


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(SHORT_CPU_CASES))
def test_interpreter_short_backward(interpreter, case):
    interpreter.run("check_attention", **SHORT_CPU_CASES[case])


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(HOPPER_CPU_CASES))
def test_interpreter_hopper_paths(interpreter, case):
    interpreter.run("check_attention", config=HOPPER_INTERPRETER, **HOPPER_CPU_CASES[case])


@pytest.mark.interpret
def test_interpreter_dropout_bits_match_spec(interpreter):
    interpreter.run("check_dropout_bits")


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_interpreter_dropout_keep_mask_in_attention(interpreter, dtype):
    interpreter.run("check_dropout_mask_in_attention", dtype=dtype)


@pytest.mark.interpret
def test_interpreter_preprocess_zeroes_the_hopper_sums(interpreter):
    interpreter.run("check_preprocess_zeroes_the_hopper_sums")


@pytest.mark.interpret
def test_interpreter_capabilities(interpreter):
    interpreter.run("check_interpreter_capabilities")


@pytest.mark.interpret
def test_interpreter_through_mhattn_attention(interpreter):
    interpreter.run("check_through_attention")


# ---- GPU tests ----------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
needs_sm90 = pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_capability() != (9, 0),
                                reason="needs sm_90 (wgmma)")

# Head dims and (Nq, Nk) pairs of CONFORMANCE.md, spread over causal modes and head layouts.
GPU_SHAPES = [
    (16, 1, 1, None, (6, 6)), (32, 1, 513, "bottom_right", (6, 2)), (40, 113, 203, "top_left", (6, 1)),
    (59, 128, 217, None, (6, 2)), (64, 113, 211, "bottom_right", (6, 6)), (80, 108, 256, "top_left", (6, 2)),
    (96, 256, 512, None, (6, 1)), (111, 512, 256, "bottom_right", (6, 6)), (128, 1023, 1024, "top_left", (6, 2)),
    (160, 1024, 1023, "bottom_right", (6, 6)), (192, 113, 203, None, (6, 2)), (224, 128, 217, "top_left", (6, 1)),
    (256, 2048, 2048, "top_left", (6, 6)), (64, 2048, 2048, None, (6, 2)), (128, 512, 256, None, (6, 6)),
    (256, 108, 256, "bottom_right", (6, 2)),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"d{s[0]}-{s[1]}x{s[2]}-{s[3]}-h{s[4][0]}.{s[4][1]}")
def test_gpu_conformance_shapes(dtype, shape):
    head_dim, nq, nk, causal, (hq, hkv) = shape
    check_attention(dtype=dtype, device="cuda", batch=2, heads_q=hq, heads_kv=hkv, seqlen_q=nq, seqlen_k=nk,
                    head_dim=head_dim, causal=causal)


GPU_FEATURE_CASES = {
    "bool_mask": dict(mask="bool", seqlen_q=300, seqlen_k=517),
    "bool_mask_empty_rows": dict(mask="bool_empty_rows", seqlen_q=200, seqlen_k=300),
    "key_padding": dict(mask="key_padding", batch=4, seqlen_q=500, seqlen_k=700, heads_q=6, heads_kv=2),
    "key_padding_holes": dict(mask="key_padding_holes", batch=3, seqlen_q=300, seqlen_k=1000),
    "key_bias": dict(mask="key_bias", batch=4, seqlen_q=500, seqlen_k=700, heads_q=6, heads_kv=2),
    "key_bias_grad": dict(mask="key_bias", mask_grad=True, batch=2, seqlen_q=300, seqlen_k=400),
    "float_mask_grad": dict(mask="float", mask_grad=True, seqlen_q=257, seqlen_k=300, causal="bottom_right"),
    "dropout": dict(dropout_p=0.17, seqlen_q=333, seqlen_k=400, heads_q=6, heads_kv=2),
    "dropout_causal": dict(dropout_p=0.17, seqlen_q=512, seqlen_k=512, causal="top_left"),
    "window": dict(window=(100, 30), seqlen_q=700, seqlen_k=650),
    "softcap": dict(softcap=20.0, overflow=True, seqlen_q=300, seqlen_k=300, causal="top_left"),
    "packed_qkv_views": dict(layout="packed", seqlen_q=600, seqlen_k=600, heads_q=4, head_dim=64),
    "grad_lse": dict(grad_lse=True, seqlen_q=300, seqlen_k=350),
    "overflow": dict(overflow=True, seqlen_q=1000, seqlen_k=1000, head_dim=128, causal="bottom_right"),
    "value_dim": dict(head_dim=64, head_dim_v=128, seqlen_q=300, seqlen_k=300),
}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GPU_FEATURE_CASES))
def test_gpu_features(dtype, case):
    check_attention(dtype=dtype, device="cuda", **{"head_dim": 64, **GPU_FEATURE_CASES[case]})


# The short backward on the GPU: the backend's own tiles at the widest (128 keys at d = 64, 64 at d = 128) and
# narrowest blocks, with the features it covers, and the cases that keep the three kernels.
SHORT_GPU_CASES = {
    "d64_128_keys_causal_gqa": dict(head_dim=64, heads_q=8, heads_kv=2, seqlen_q=128, seqlen_k=128, causal="top_left"),
    "d64_vit_like_97_keys": dict(head_dim=64, batch=4, heads_q=12, seqlen_q=97, seqlen_k=97),
    "d128_64_keys_bottom_right": dict(head_dim=128, seqlen_q=100, seqlen_k=64, causal="bottom_right"),
    "d96_window_dropout": dict(head_dim=96, seqlen_q=80, seqlen_k=60, window=(20, 5), dropout_p=0.17),
    "d32_softcap_key_padding": dict(head_dim=32, batch=3, seqlen_q=50, seqlen_k=120, softcap=20.0,
                                    mask="key_padding"),
    "d64_single_query_float_mask": dict(head_dim=64, seqlen_q=1, seqlen_k=77, mask="float_neginf"),
    "d64_deterministic": dict(head_dim=64, seqlen_q=128, seqlen_k=128, det_runs=5, causal="top_left"),
}
SHORT_GPU_CASES = {name: dict(case, short=True) for name, case in SHORT_GPU_CASES.items()}
SHORT_GPU_CASES["d64_129_keys_three_kernels"] = dict(head_dim=64, seqlen_q=64, seqlen_k=129, short=False)
SHORT_GPU_CASES["d64_grad_lse_three_kernels"] = dict(head_dim=64, seqlen_q=64, seqlen_k=100, grad_lse=True, short=False)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(SHORT_GPU_CASES))
def test_gpu_short_backward(dtype, case):
    check_attention(dtype=dtype, device="cuda", **SHORT_GPU_CASES[case])


# The sm_90 paths pinned on whatever GPU runs the tests (the table picks them only on sm_90): descriptor loads,
# warp-specialised loops, dQ through atomics and through the copy engine's reduce-add.
HOPPER_GPU_CONFIGS = {
    "tma_ws_dq_tma": "fwd=128,128,8,3,tma,ws;dkdv=32,128,8,2,tma;dq=tma",
    "tma_dq_atomic": "fwd=128,64,8,3,tma;dkdv=64,64,4,2,tma;dq=atomic",
}
HOPPER_GPU_CASES = {
    "d128_causal_gqa": dict(head_dim=128, heads_q=6, heads_kv=2, seqlen_q=1023, seqlen_k=1024, causal="top_left"),
    "d64_bottom_right": dict(head_dim=64, seqlen_q=300, seqlen_k=517, causal="bottom_right"),
    "d96_window_dropout": dict(head_dim=96, seqlen_q=333, seqlen_k=400, window=(100, 30), dropout_p=0.17),
    "d256_softcap_bool_mask": dict(head_dim=256, seqlen_q=200, seqlen_k=300, softcap=20.0, mask="bool_empty_rows"),
    "d128_packed_grad_lse": dict(head_dim=128, layout="packed", seqlen_q=600, seqlen_k=600, heads_q=4, grad_lse=True),
}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_capability()[0] < 9, reason="needs sm_90 (TMA)")
@pytest.mark.parametrize("config", list(HOPPER_GPU_CONFIGS))
@pytest.mark.parametrize("case", list(HOPPER_GPU_CASES))
def test_gpu_hopper_paths(config, case):
    check_attention(dtype="bfloat16", device="cuda", config=HOPPER_GPU_CONFIGS[config], **HOPPER_GPU_CASES[case])


# The Gluon forward (hopper_forward.py), reached by small ragged shapes with its key threshold lowered: every
# alignment, more queries than keys, rows that see no key, GQA, packed QKV views, one key; the backward runs from
# its output and log-sum-exp.
GLUON_FORWARD_CASES = {
    "d64_ragged": dict(head_dim=64, seqlen_q=300, seqlen_k=517),
    "d64_bottom_right_gqa": dict(head_dim=64, heads_q=6, heads_kv=2, seqlen_q=300, seqlen_k=517, causal="bottom_right"),
    "d128_top_left_more_queries": dict(head_dim=128, seqlen_q=517, seqlen_k=300, causal="top_left"),
    "d128_bottom_right_empty_rows": dict(head_dim=128, seqlen_q=517, seqlen_k=300, causal="bottom_right"),
    "d256_one_key": dict(head_dim=256, seqlen_q=129, seqlen_k=1),
    "d256_packed_causal_grad_lse": dict(head_dim=256, layout="packed", seqlen_q=600, seqlen_k=600, heads_q=4,
                                        causal="top_left", grad_lse=True),
}


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_FORWARD_CASES))
def test_gpu_gluon_hopper_forward(monkeypatch, dtype, case):
    _check_gluon_kernel(monkeypatch, "MIN_KEYS", "forward", dtype, GLUON_FORWARD_CASES[case])


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("case", ["d64_ragged", "d128_top_left_more_queries", "d256_packed_causal_grad_lse"])
def test_gpu_gluon_forward_programs_walking_many_tiles(monkeypatch, case):
    """Through the backend: the Gluon forward's tile loop on 3 programs (each walks many tiles, so ring slots,
    barrier phases and Q's rounds run on across tiles), round-robin without a causal mask and from the tile table
    with one, causal tiles in groups of 3 heads (the last group shorter when the heads do not divide)."""
    from mhattn.backends.triton import backend as triton_backend
    from mhattn.backends.triton import hopper_launch

    monkeypatch.setattr(hopper_launch, "_sm_count", lambda index: 3)
    monkeypatch.setattr(hopper_launch, "PERSISTENT_MAX_KEYS", 1 << 30)
    monkeypatch.setattr(hopper_launch, "CAUSAL_PERSISTENT_MAX_KEYS", 1 << 30)
    head_bytes = hopper_launch.forward_head_bytes(GLUON_FORWARD_CASES[case]["seqlen_k"], GLUON_FORWARD_CASES[case]
                                                  ["head_dim"], 2, 1)
    monkeypatch.setattr(hopper_launch, "CAUSAL_GROUP_BYTES", 3 * head_bytes)
    monkeypatch.setattr(triton_backend, "_plans", {})  # plans keep their schedule: none made before this test
    monkeypatch.setattr(triton_backend, "_signatures", {})
    _check_gluon_kernel(monkeypatch, "MIN_KEYS", "forward", "bfloat16", GLUON_FORWARD_CASES[case])


# Three Q slots taken in turn by the two consumers (Q_ROTATING, d = 256): without a mask, both causal alignments with
# rows that see no key, GQA, a last tile whose upper consumer has no rows.
ROTATING_Q_CASES = {
    "ragged_gqa": dict(head_dim=256, heads_q=6, heads_kv=2, seqlen_q=300, seqlen_k=517),
    "top_left_more_queries": dict(head_dim=256, seqlen_q=517, seqlen_k=300, causal="top_left"),
    "bottom_right_empty_rows": dict(head_dim=256, heads_q=4, heads_kv=1, seqlen_q=700, seqlen_k=300,
                                    causal="bottom_right"),
    "last_tile_lower_rows_only": dict(head_dim=256, seqlen_q=320, seqlen_k=1000, causal="bottom_right"),
}


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(ROTATING_Q_CASES))
def test_gpu_gluon_forward_rotating_q_slots(monkeypatch, dtype, case):
    """Through the backend, the Gluon forward built with three rotating Q slots (asserted from the build's
    compile-time arguments), one program per tile and a persistent grid of 3 programs, so that each program's tiles
    take every slot in both consumers' turns."""
    from mhattn.backends.triton import hopper_launch

    monkeypatch.setattr(hopper_launch, "FORWARD_Q_ROTATING_MAX_KEYS", {256: 1 << 20})
    _check_gluon_forward_build(monkeypatch, "Q_ROTATING", dtype, ROTATING_Q_CASES[case])


def _check_gluon_forward_build(monkeypatch, flag: str, dtype, case: dict, value=True):
    """_check_gluon_kernel's forward on ``case`` with one program per tile and then a persistent grid of 3 programs
    (causal tiles from the counter), asserting that every build of the forward had compile-time argument ``flag`` at
    ``value`` (a flag on)."""
    from mhattn.backends.triton import backend as triton_backend
    from mhattn.backends.triton import hopper_launch

    built = []
    real_args = hopper_launch.compile_time_args
    monkeypatch.setattr(hopper_launch, "compile_time_args",
                        lambda *args: built.append(real_args(*args)[flag]) or real_args(*args))
    for programs in (None, 3):
        monkeypatch.setattr(triton_backend, "_plans", {})  # plans keep their schedule and build
        monkeypatch.setattr(triton_backend, "_signatures", {})
        if programs:
            monkeypatch.setattr(hopper_launch, "_sm_count", lambda index: programs)
        _check_gluon_kernel(monkeypatch, "MIN_KEYS", "forward", dtype, case)
    assert built and all(found == value for found in built)


# The lower consumer's causal diagonal block at half width (HALF_DIAGONAL): diagonals that start at a key block's first
# key (top-left with Nq = Nk and with more queries than keys, bottom-right 256 keys past it), GQA, one that does not.
HALF_DIAGONAL_CASES = {
    "top_left_gqa": dict(head_dim=64, heads_q=6, heads_kv=2, seqlen_q=700, seqlen_k=700, causal="top_left"),
    "top_left_more_queries": dict(head_dim=64, seqlen_q=517, seqlen_k=300, causal="top_left"),
    "bottom_right_aligned": dict(head_dim=64, seqlen_q=300, seqlen_k=556, causal="bottom_right"),
    "bottom_right_unaligned": dict(head_dim=64, seqlen_q=300, seqlen_k=517, causal="bottom_right"),
}


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(HALF_DIAGONAL_CASES))
def test_gpu_gluon_forward_half_width_diagonal(monkeypatch, dtype, case):
    """Through the backend, the Gluon forward built with the half-width diagonal block (asserted from the build's
    compile-time arguments), one program per tile and a persistent grid of 3 programs (tiles from the counter)."""
    _check_gluon_forward_build(monkeypatch, "HALF_DIAGONAL", dtype, HALF_DIAGONAL_CASES[case])


# A sliding window (its left bound) in the Gluon kernels: windows narrower than a key block (so the two consumers of a
# forward tile may see disjoint blocks, and a backward key block few query blocks), wider ones, both causal alignments,
# a window with no right bound (rows past the last key's window see none), one key per row, GQA.
GLUON_WINDOW_CASES = {
    "d64_top_left_narrow_gqa": dict(head_dim=64, heads_q=6, heads_kv=2, seqlen_q=700, seqlen_k=700, causal="top_left",
                                    window=(100, 0)),
    "d64_one_key_a_row": dict(head_dim=64, seqlen_q=300, seqlen_k=517, causal="bottom_right", window=(0, 0)),
    "d128_bottom_right_wide": dict(head_dim=128, seqlen_q=300, seqlen_k=900, causal="bottom_right", window=(257, 0)),
    "d128_no_right_bound_empty_rows": dict(head_dim=128, seqlen_q=517, seqlen_k=300, window=(64, None)),
    "d256_bottom_right_more_queries": dict(head_dim=256, heads_q=4, heads_kv=1, seqlen_q=517, seqlen_k=300,
                                           causal="bottom_right", window=(150, 0)),
    "d256_top_left": dict(head_dim=256, seqlen_q=600, seqlen_k=600, causal="top_left", window=(300, 0)),
}


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_WINDOW_CASES))
def test_gpu_gluon_forward_sliding_window(monkeypatch, dtype, case):
    """Through the backend, the Gluon forward built with a window (asserted from the build's compile-time arguments),
    one program per tile and a persistent grid of 3 programs, so that ring slots run on across tiles whose first key
    blocks differ."""
    _check_gluon_forward_build(monkeypatch, "WINDOW", dtype, GLUON_WINDOW_CASES[case])


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_WINDOW_CASES))
def test_gpu_gluon_backward_sliding_window(monkeypatch, dtype, case):
    """The Gluon backward built with a window (asserted from the build's compile-time arguments) against the
    reference."""
    _check_gluon_backward_build(monkeypatch, "WINDOW", dtype, GLUON_WINDOW_CASES[case])


def _check_gluon_backward_build(monkeypatch, flag: str, dtype, case: dict, value=True):
    """_check_gluon_kernel's backward on ``case``, asserting that every build of the backward had compile-time
    argument ``flag`` at ``value`` (a flag on)."""
    from mhattn.backends.triton import backend as triton_backend
    from mhattn.backends.triton import hopper_launch

    built = []
    real_args = hopper_launch.backward_compile_time_args
    monkeypatch.setattr(hopper_launch, "backward_compile_time_args",
                        lambda *args: built.append(real_args(*args)[flag]) or real_args(*args))
    monkeypatch.setattr(triton_backend, "_plans", {})  # plans keep their build
    monkeypatch.setattr(triton_backend, "_signatures", {})
    _check_gluon_kernel(monkeypatch, "BACKWARD_MIN_KEYS", "backward", dtype, case)
    assert built and all(found == value for found in built)


# Head dims 96 and 192 in the Gluon kernels' 128- and 256-wide tiles (hopper_launch.TILE_WIDTH): the copy engine
# zero-fills the columns past the head dim and clips them from the output and gradients it writes. GQA and MQA (a
# group's float32 dQ past CONVERT_IN_KERNEL_MAX_BYTES, converted after the launch), both causal alignments with rows
# that see no key, packed QKV views, a key-padding mask, a window with a softcap and dropout.
GLUON_PADDED_CASES = {
    "d96_ragged_gqa": dict(head_dim=96, heads_q=6, heads_kv=2, seqlen_q=300, seqlen_k=517),
    "d96_mqa_bottom_right": dict(head_dim=96, heads_q=8, heads_kv=1, seqlen_q=517, seqlen_k=300,
                                 causal="bottom_right"),
    "d96_top_left_key_padding": dict(head_dim=96, batch=3, seqlen_q=517, seqlen_k=300, causal="top_left",
                                     mask="key_padding"),
    "d96_window_softcap_dropout": dict(head_dim=96, seqlen_q=600, seqlen_k=600, causal="bottom_right", window=(200, 0),
                                       softcap=20.0, dropout_p=0.1),
    "d192_bottom_right_empty_rows": dict(head_dim=192, seqlen_q=517, seqlen_k=300, causal="bottom_right"),
    "d192_packed_grad_lse": dict(head_dim=192, layout="packed", seqlen_q=600, seqlen_k=600, heads_q=4,
                                 causal="top_left", grad_lse=True),
    "d192_gqa_softcap_dropout": dict(head_dim=192, heads_q=4, heads_kv=2, seqlen_q=300, seqlen_k=517, softcap=10.0,
                                     dropout_p=0.1),
    # Past FORWARD_Q_ROTATING_MAX_KEYS: both consumers store the output from registers.
    "d192_long_keys_bottom_right": dict(head_dim=192, batch=1, heads_q=2, seqlen_q=200, seqlen_k=4500,
                                        causal="bottom_right"),
}


def _recorded_split(monkeypatch, args_function: str) -> list:
    """SPLIT_PRODUCTS of every build made from here on through hopper_launch.<args_function> (the forward's or the
    backward's compile-time arguments), in a list that fills as they are made."""
    from mhattn.backends.triton import hopper_launch

    found = []
    real_args = getattr(hopper_launch, args_function)
    monkeypatch.setattr(hopper_launch, args_function,
                        lambda *args: found.append(real_args(*args)["SPLIT_PRODUCTS"]) or real_args(*args))
    return found


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_PADDED_CASES))
def test_gpu_gluon_forward_padded_head_dims(monkeypatch, dtype, case):
    """Through the backend, the Gluon forward built for head dim 96 or 192 in the wider tile (asserted from the
    build's compile-time arguments, with its products split where FORWARD_SPLIT_HEAD_DIMS says), one program per tile
    and a persistent grid of 3 programs."""
    from mhattn.backends.triton import hopper_launch

    head_dim = GLUON_PADDED_CASES[case]["head_dim"]
    split = _recorded_split(monkeypatch, "compile_time_args")
    _check_gluon_forward_build(monkeypatch, "HEAD_COLS", dtype, GLUON_PADDED_CASES[case], head_dim)
    assert split and all(found == (head_dim in hopper_launch.FORWARD_SPLIT_HEAD_DIMS) for found in split)


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_PADDED_CASES))
def test_gpu_gluon_backward_padded_head_dims(monkeypatch, dtype, case):
    """The Gluon backward built for head dim 96 or 192 in the wider tile (asserted from the build's compile-time
    arguments, with its products split where BACKWARD_SPLIT_HEAD_DIMS says) against the reference."""
    from mhattn.backends.triton import hopper_launch

    head_dim = GLUON_PADDED_CASES[case]["head_dim"]
    split = _recorded_split(monkeypatch, "backward_compile_time_args")
    _check_gluon_backward_build(monkeypatch, "HEAD_COLS", dtype, GLUON_PADDED_CASES[case], head_dim)
    assert split and all(found == (head_dim in hopper_launch.BACKWARD_SPLIT_HEAD_DIMS) for found in split)


# A deterministic backward on the Gluon kernel (each query block's dQ shares added by its key blocks in their order,
# hopper_backward.dq_turn), run several times under torch.use_deterministic_algorithms(True): bitwise-equal gradients
# that match the reference. Many key blocks a query block (long chains of turns), both causal alignments, windows with
# and without a right bound (runs of key blocks that start past the first), a right-padding key mask (key blocks that
# add nothing), a left-padding one (key blocks before a sequence's first key that take no turn), GQA and MQA (a group's
# dQ converted after the launch), dropout, the 96- and 192-wide head dims.
GLUON_DETERMINISTIC_CASES = {
    "d64_causal_gqa": dict(head_dim=64, heads_q=6, heads_kv=2, seqlen_q=700, seqlen_k=700, causal="top_left"),
    "d128_long_keys": dict(head_dim=128, batch=1, seqlen_q=300, seqlen_k=2100),
    "d128_window_bottom_right": dict(head_dim=128, seqlen_q=600, seqlen_k=1100, causal="bottom_right",
                                     window=(300, 0)),
    "d96_window_no_right_bound_dropout": dict(head_dim=96, seqlen_q=517, seqlen_k=700, window=(100, None),
                                              dropout_p=0.1),
    "d128_key_padding_more_queries": dict(head_dim=128, batch=3, seqlen_q=517, seqlen_k=300, causal="top_left",
                                          mask="key_padding"),
    "d64_left_padding_gqa": dict(head_dim=64, batch=3, heads_q=4, heads_kv=2, seqlen_q=700, seqlen_k=700,
                                 causal="top_left", mask="key_padding_left"),
    "d128_span_window_dropout": dict(head_dim=128, batch=4, seqlen_q=600, seqlen_k=900, causal="bottom_right",
                                     window=(300, 0), mask="key_padding_span", dropout_p=0.1),
    "d192_mqa": dict(head_dim=192, heads_q=8, heads_kv=1, seqlen_q=517, seqlen_k=600),
    "d256_causal_softcap": dict(head_dim=256, heads_q=4, heads_kv=2, seqlen_q=600, seqlen_k=600, causal="top_left",
                                softcap=20.0),
}


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_DETERMINISTIC_CASES))
def test_gpu_gluon_backward_deterministic(monkeypatch, dtype, case):
    """The Gluon backward's deterministic build (asserted from the build's compile-time arguments; its key thresholds
    lowered to one key), four backward passes of one forward: bitwise-equal gradients, and the first against the
    reference."""
    from mhattn.backends.triton import hopper_launch

    monkeypatch.setattr(hopper_launch, "DETERMINISTIC_MIN_KEYS", dict.fromkeys(hopper_launch.DETERMINISTIC_MIN_KEYS, 1))
    _check_gluon_backward_build(monkeypatch, "DETERMINISTIC", dtype, dict(GLUON_DETERMINISTIC_CASES[case], det_runs=4))


# A right-padding key mask in the Gluon kernels, as each batch entry's key count (batch entry 0 with none): with a
# causal mask of either alignment, GQA, a window; a mask with holes stays on the FlashAttention-2 kernels.
GLUON_KEY_PADDING_CASES = {
    "d64_ragged": dict(head_dim=64, batch=3, seqlen_q=300, seqlen_k=517, mask="key_padding"),
    "d128_bottom_right_gqa": dict(head_dim=128, batch=3, heads_q=6, heads_kv=2, seqlen_q=300, seqlen_k=700,
                                  causal="bottom_right", mask="key_padding"),
    "d128_top_left_more_queries": dict(head_dim=128, batch=3, seqlen_q=517, seqlen_k=300, causal="top_left",
                                       mask="key_padding"),
    "d256_window": dict(head_dim=256, batch=3, seqlen_q=600, seqlen_k=600, causal="top_left", window=(200, 0),
                        mask="key_padding"),
}


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_KEY_PADDING_CASES))
def test_gpu_gluon_forward_key_padding_as_lengths(monkeypatch, dtype, case):
    """Through the backend, the Gluon forward built with key counts (asserted from the build's compile-time
    arguments), one program per tile and a persistent grid of 3 programs."""
    _check_gluon_forward_build(monkeypatch, "KEY_LENGTHS", dtype, GLUON_KEY_PADDING_CASES[case])


# A left-padding key mask (True on a suffix of each batch entry's keys: a batch of prompts padded on the left) and one
# padded on both sides, in the Gluon kernels as each entry's first key and key count (KEY_STARTS; batch entry 0 with
# none): causal of both alignments (rows before an entry's first key see none), GQA, a window, a softcap, the 192-wide
# head dim, dropout (whose RNG hashes each key at its index from key 0, as every backend's does).
GLUON_KEY_SPAN_CASES = {
    "d64_left_top_left": dict(head_dim=64, batch=3, seqlen_q=517, seqlen_k=517, causal="top_left",
                              mask="key_padding_left"),
    "d128_left_bottom_right_gqa": dict(head_dim=128, batch=3, heads_q=6, heads_kv=2, seqlen_q=300, seqlen_k=700,
                                       causal="bottom_right", mask="key_padding_left"),
    "d128_span_no_causal_softcap": dict(head_dim=128, batch=4, seqlen_q=300, seqlen_k=900, softcap=20.0,
                                        mask="key_padding_span"),
    "d192_span_top_left": dict(head_dim=192, batch=3, seqlen_q=600, seqlen_k=600, causal="top_left",
                               mask="key_padding_span"),
    "d256_left_window": dict(head_dim=256, batch=3, seqlen_q=600, seqlen_k=600, causal="top_left", window=(200, 0),
                             mask="key_padding_left"),
    "d128_span_bottom_right_dropout": dict(head_dim=128, batch=3, seqlen_q=300, seqlen_k=700, causal="bottom_right",
                                           mask="key_padding_span", dropout_p=0.2),
}


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_KEY_SPAN_CASES))
def test_gpu_gluon_forward_key_padding_as_spans(monkeypatch, dtype, case):
    """Through the backend, the Gluon forward built with per-sequence first keys (asserted from the build's
    compile-time arguments), one program per tile and a persistent grid of 3 programs, forward and backward against
    the reference."""
    _check_gluon_forward_build(monkeypatch, "KEY_STARTS", dtype, GLUON_KEY_SPAN_CASES[case])


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_KEY_SPAN_CASES) + ["d64_left_dropout"])
def test_gpu_gluon_backward_key_padding_as_spans(monkeypatch, dtype, case):
    """The Gluon backward built with per-sequence first keys (asserted from the build's compile-time arguments)
    against the reference: key blocks before a sequence's first key write zero dK and dV. With dropout at d = 64 too,
    whose forward is the FlashAttention-2 one (FORWARD_DROPOUT_HEAD_DIMS)."""
    spans = dict(GLUON_KEY_SPAN_CASES, d64_left_dropout=dict(head_dim=64, batch=3, heads_q=4, heads_kv=2, seqlen_q=517,
                                                             seqlen_k=517, causal="top_left", mask="key_padding_left",
                                                             dropout_p=0.1))
    _check_gluon_backward_build(monkeypatch, "KEY_STARTS", dtype, spans[case])


@pytest.mark.gpu
@needs_gpu
@needs_sm90
def test_gpu_repeated_key_padded_calls_launch_the_prepared_gluon_kernels(monkeypatch):
    """Repeated forward+backward calls of one signature whose key-padding masks alternate between right padding, left
    padding and holes: once each kind's first call has prepared its Gluon launches, the calls with right or left
    padding launch them with their mask's kept bounds (no full path, forward or backward), a mask with holes takes the
    full paths (the FlashAttention-2 kernels), and every output, lse and gradient is within CONFORMANCE.md's rule of
    the reference."""
    import mhattn
    from mhattn.backends.triton import backend as triton_backend
    from mhattn.backends.triton import hopper_launch

    monkeypatch.setattr(hopper_launch, "MIN_KEYS", dict.fromkeys(hopper_launch.MIN_KEYS, 1))
    monkeypatch.setattr(hopper_launch, "BACKWARD_MIN_KEYS", dict.fromkeys(hopper_launch.BACKWARD_MIN_KEYS, 1))
    monkeypatch.setattr(triton_backend, "_signatures", {})
    batch, heads, seqlen, head_dim = 3, 4, 600, 64
    gen = torch.Generator(device="cuda").manual_seed(12)
    q, k, v, grad_out = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.float16,
                                     generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    positions = torch.arange(seqlen, device="cuda")
    masks = {
        "right": positions[None, :] < torch.tensor([[600], [250], [1]], device="cuda"),
        "left": positions[None, :] >= torch.tensor([[0], [333], [599]], device="cuda"),
        "holes": (positions % 4 != 2)[None, :].expand(batch, seqlen),
    }
    full = {"forward": [], "backward": []}
    for name in full:
        real = getattr(triton_backend.TritonBackend, f"_{name}_in_full")
        monkeypatch.setattr(triton_backend.TritonBackend, f"_{name}_in_full",
                            lambda *args, real=real, name=name: full[name].append(1) or real(*args))
    for round_ in range(3):
        for kind, keys in masks.items():
            keys = keys.reshape(batch, 1, 1, seqlen).clone()  # a new tensor each call, as a new batch brings
            out, lse = mhattn.attention(q, k, v, attn_mask=keys, window=(-1, 0), return_lse=True, backend="triton")
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
            params = AttentionParams(scale=head_dim ** -0.5, window_right=0,
                                     mask=keys.expand(batch, heads, seqlen, seqlen))
            failed = failures_against_reference(q, k, v, params, grad_out, (out, lse, *grads))
            assert not failed, (round_, kind, "; ".join(failed))
    # each kind's first call, then the calls with holes
    assert len(full["forward"]) == len(full["backward"]) == 3 + 2, full


@pytest.mark.gpu
@needs_gpu
@needs_sm90
def test_gpu_key_padding_masks_changed_between_graph_replays(monkeypatch):
    """A left-padded forward, run eagerly (the Gluon forward, its key bounds and first keys kept for the mask), then
    captured in a CUDA graph with the same mask: the captured call makes its key bounds in the graph and reads the
    mask (no read-back during capture), so replays after the mask changes in place (right padding, holes, left
    padding again) follow it, each within CONFORMANCE.md's rule of the reference."""
    import mhattn
    from mhattn.backends.triton import hopper_launch

    monkeypatch.setattr(hopper_launch, "MIN_KEYS", dict.fromkeys(hopper_launch.MIN_KEYS, 1))
    batch, heads, seqlen, head_dim = 3, 4, 700, 128
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    positions = torch.arange(seqlen, device="cuda")
    keys = (positions[None, :] >= torch.tensor([[0], [150], [400]], device="cuda")).view(batch, 1, 1, seqlen)
    launches = []
    real_forward = hopper_launch.forward
    monkeypatch.setattr(hopper_launch, "forward", lambda *args: launches.append(1) or real_forward(*args))

    def call():
        return mhattn.attention(q, k, v, attn_mask=keys, window=(-1, 0), backend="triton")

    def check(out):
        params = AttentionParams(scale=head_dim ** -0.5, window_right=0, mask=keys.expand(batch, heads, seqlen, seqlen))
        gold = naive_attention(q.double(), k.double(), v.double(), params)[0]
        lowp = naive_attention(q, k, v, params)[0]
        result = compare("out", out.cpu(), gold.cpu(), lowp.cpu(), dtype=torch.bfloat16)
        assert result.ok, str(result)

    check(call())
    assert launches, "the eager left-padded call did not run the Gluon forward"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for starts_or_holes in ("right", "holes", "left"):
        if starts_or_holes == "right":
            lengths = torch.tensor([[700], [300], [1]], device="cuda")
            keys.copy_((positions[None, :] < lengths).view(batch, 1, 1, seqlen))
        elif starts_or_holes == "holes":
            keys.copy_((positions % 3 != 1).view(1, 1, 1, seqlen).expand(batch, 1, 1, seqlen))
        else:
            starts = torch.tensor([[650], [10], [0]], device="cuda")
            keys.copy_((positions[None, :] >= starts).view(batch, 1, 1, seqlen))
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(captured)


@pytest.mark.gpu
@needs_gpu
@needs_sm90
def test_gpu_sliced_gluon_backward_with_left_padding(monkeypatch):
    """A left-padding key mask's backward run by the Gluon kernel in batch slices of 2, 2 and 1 entries: each launch
    reads its entries' key counts and first keys (hopper_launch._slice_bounds)."""
    from mhattn.backends.triton import backend as triton_backend
    from mhattn.backends.triton import hopper_launch

    batch, heads_q, heads_kv, seqlen, head_dim = 5, 4, 2, 300, 64
    per_head = (heads_q // heads_kv) * seqlen * head_dim * 4
    monkeypatch.setattr(hopper_launch, "ACCUMULATOR_BYTES", 4 * per_head)
    monkeypatch.setattr(hopper_launch, "MIN_WAVES", 0)
    monkeypatch.setattr(hopper_launch, "SINGLE_LAUNCH_BYTES", 0)
    monkeypatch.setattr(triton_backend, "_plans", {})  # plans keep their slices
    monkeypatch.setattr(triton_backend, "_signatures", {})
    assert hopper_launch.backward_slices(batch, heads_kv, per_head, 3, 132) == (2, 2)
    _check_gluon_backward_build(monkeypatch, "KEY_STARTS", "bfloat16",
                                dict(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen, seqlen_k=seqlen,
                                     head_dim=head_dim, causal="top_left", mask="key_padding_left"))


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_KEY_PADDING_CASES))
def test_gpu_gluon_backward_key_padding_as_lengths(monkeypatch, dtype, case):
    """The Gluon backward built with key counts (asserted from the build's compile-time arguments) against the
    reference; key blocks past a batch entry's keys write zero dK and dV."""
    _check_gluon_backward_build(monkeypatch, "KEY_LENGTHS", dtype, GLUON_KEY_PADDING_CASES[case])


# GQA and MQA in the Gluon backward with a key/value head's query heads split over programs that add float32 partial
# dK and dV (hopper_launch.backward_group_parts; one program per query head unless the case says how many heads each
# walks): both causal alignments, more queries than keys, groups of 3 and 4, MQA, a window with left padding, dropout
# with right padding, a softcap.
GLUON_PARTIAL_CASES = {
    "d128_gqa4_top_left": dict(head_dim=128, heads_q=8, heads_kv=2, seqlen_q=700, seqlen_k=700, causal="top_left"),
    "d64_gqa3_bottom_right": dict(head_dim=64, heads_q=6, heads_kv=2, seqlen_q=300, seqlen_k=517,
                                  causal="bottom_right"),
    "d128_mqa_more_queries": dict(head_dim=128, heads_q=4, heads_kv=1, seqlen_q=517, seqlen_k=300),
    "d128_window_left_padding": dict(head_dim=128, batch=3, heads_q=4, heads_kv=2, seqlen_q=600, seqlen_k=600,
                                     causal="bottom_right", window=(200, 0), mask="key_padding_left"),
    "d64_dropout_key_padding": dict(head_dim=64, batch=3, heads_q=4, heads_kv=1, seqlen_q=400, seqlen_k=400,
                                    mask="key_padding", dropout_p=0.2),
    "d128_softcap": dict(head_dim=128, heads_q=6, heads_kv=2, seqlen_q=300, seqlen_k=300, causal="top_left",
                         softcap=20.0),
    "d128_two_heads_a_program": dict(head_dim=128, heads_q=8, heads_kv=2, seqlen_q=517, seqlen_k=517,
                                     causal="top_left", heads_per_program=2),
}


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_PARTIAL_CASES))
def test_gpu_gluon_backward_partial_dk_dv(monkeypatch, dtype, case):
    """The Gluon backward built with partial dK and dV sums (asserted from the build's compile-time arguments) against
    the reference, its programs splitting each key/value head's query heads."""
    from mhattn.backends.triton import hopper_launch

    case = dict(GLUON_PARTIAL_CASES[case])
    monkeypatch.setattr(hopper_launch, "BACKWARD_HEADS_PER_PROGRAM", case.pop("heads_per_program", None))
    _check_gluon_backward_build(monkeypatch, "PARTIAL_DK_DV", dtype, case)


# Dropout in the Gluon kernels, with the RNG every backend shares (the reference applies the same keep-mask): GQA,
# both causal alignments, more queries than keys, a window and a right-padding key mask with it.
GLUON_DROPOUT_CASES = {
    "d64_top_left_gqa": dict(head_dim=64, heads_q=6, heads_kv=2, seqlen_q=300, seqlen_k=517, causal="top_left",
                             dropout_p=0.17),
    "d128_more_queries": dict(head_dim=128, seqlen_q=517, seqlen_k=300, dropout_p=0.3),
    "d128_window_key_padding": dict(head_dim=128, batch=3, seqlen_q=600, seqlen_k=600, causal="bottom_right",
                                    window=(200, 0), mask="key_padding", dropout_p=0.1),
    "d256_bottom_right": dict(head_dim=256, heads_q=4, heads_kv=2, seqlen_q=300, seqlen_k=517, causal="bottom_right",
                              dropout_p=0.1),
}


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_DROPOUT_CASES))
def test_gpu_gluon_forward_dropout(monkeypatch, dtype, case):
    """Through the backend, the Gluon forward built with dropout (asserted from the build's compile-time arguments),
    one program per tile and a persistent grid of 3 programs; at every head dim, whichever the backend's choice
    (hopper_launch.FORWARD_DROPOUT_HEAD_DIMS)."""
    from mhattn.backends.triton import hopper_launch

    monkeypatch.setattr(hopper_launch, "FORWARD_DROPOUT_HEAD_DIMS", (64, 128, 256))
    _check_gluon_forward_build(monkeypatch, "DROPOUT", dtype, GLUON_DROPOUT_CASES[case])


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_DROPOUT_CASES))
def test_gpu_gluon_backward_dropout(monkeypatch, dtype, case):
    """The Gluon backward built with dropout (asserted from the build's compile-time arguments) against the
    reference."""
    _check_gluon_backward_build(monkeypatch, "DROPOUT", dtype, GLUON_DROPOUT_CASES[case])


# A softcap in the Gluon kernels (each score through softcap * tanh(scale * qk / softcap) before the mask, and the
# tanh's slope in the backward): GQA, both causal alignments with rows that see no key, a softcap small enough that
# most scores saturate, a window and dropout with it.
GLUON_SOFTCAP_CASES = {
    "d64_top_left_gqa": dict(head_dim=64, heads_q=6, heads_kv=2, seqlen_q=300, seqlen_k=517, causal="top_left",
                             softcap=5.0),
    "d128_bottom_right_empty_rows": dict(head_dim=128, seqlen_q=517, seqlen_k=300, causal="bottom_right",
                                         softcap=30.0),
    "d128_saturating_window_dropout": dict(head_dim=128, batch=3, seqlen_q=600, seqlen_k=600, causal="top_left",
                                           window=(200, 0), softcap=0.5, dropout_p=0.1),
    "d256_ragged": dict(head_dim=256, heads_q=4, heads_kv=2, seqlen_q=300, seqlen_k=517, softcap=10.0),
}


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_SOFTCAP_CASES))
def test_gpu_gluon_forward_softcap(monkeypatch, dtype, case):
    """Through the backend, the Gluon forward built with a softcap (asserted from the build's compile-time arguments),
    one program per tile and a persistent grid of 3 programs, at every head dim whichever the backend's choice."""
    from mhattn.backends.triton import hopper_launch

    monkeypatch.setattr(hopper_launch, "FORWARD_DROPOUT_HEAD_DIMS", (64, 128, 256))
    monkeypatch.setattr(hopper_launch, "FORWARD_SOFTCAP_HEAD_DIMS", (64, 128, 256))
    _check_gluon_forward_build(monkeypatch, "SOFTCAP", dtype, GLUON_SOFTCAP_CASES[case])


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_SOFTCAP_CASES))
def test_gpu_gluon_backward_softcap(monkeypatch, dtype, case):
    """The Gluon backward built with a softcap (asserted from the build's compile-time arguments) against the
    reference, at every head dim whichever the backend's choice."""
    from mhattn.backends.triton import hopper_launch

    monkeypatch.setattr(hopper_launch, "BACKWARD_SOFTCAP_HEAD_DIMS", (64, 128, 256))
    _check_gluon_backward_build(monkeypatch, "SOFTCAP", dtype, GLUON_SOFTCAP_CASES[case])


@pytest.mark.gpu
@needs_gpu
@needs_sm90
def test_gpu_key_padding_with_holes_stays_on_the_flash_kernels(monkeypatch):
    """A key-padding mask that is not right padding (padded keys inside a sequence) runs the FlashAttention-2 kernels,
    which read it, even where the Gluon kernels take every key count: right, and neither Gluon kernel launched. The
    same call with a right-padding mask of the same layout launches both."""
    from mhattn.backends.triton import hopper_launch

    for threshold in ("MIN_KEYS", "BACKWARD_MIN_KEYS"):
        monkeypatch.setattr(hopper_launch, threshold, dict.fromkeys(getattr(hopper_launch, threshold), 1))
    launched = []
    for name in ("forward", "backward"):
        real = getattr(hopper_launch, name)
        monkeypatch.setattr(hopper_launch, name, lambda *args, _name=name, _real=real: launched.append(_name)
                            or _real(*args))
    case = dict(head_dim=128, batch=3, seqlen_q=300, seqlen_k=517, causal="bottom_right")
    check_attention(dtype="bfloat16", device="cuda", mask="key_padding_holes", **case)
    assert launched == []
    check_attention(dtype="bfloat16", device="cuda", mask="key_padding", **case)
    assert sorted(launched) == ["backward", "forward"]


@pytest.mark.gpu
@needs_gpu
@needs_sm90
def test_gpu_gluon_launches_repeated_on_streams_and_in_a_graph(monkeypatch):
    """Repeated calls through the backend's prepared Gluon launches (tensor maps kept per address, the causal
    forward's counter kept per stream and left at 0 by each launch; 5 programs over 64 tiles, so the counter hands out
    most of them): on one stream many times, on two streams at once, replayed from a CUDA graph, and with new inputs;
    each forward bitwise equal to the first call's on its inputs, every result within CONFORMANCE.md's rule of the
    reference (outputs poisoned before the kernels write them)."""
    from mhattn.backends.triton import backend as triton_backend
    from mhattn.backends.triton import hopper_launch

    monkeypatch.setattr(hopper_launch, "_sm_count", lambda index: 5)
    monkeypatch.setattr(hopper_launch, "MIN_KEYS", dict.fromkeys(hopper_launch.MIN_KEYS, 1))
    monkeypatch.setattr(hopper_launch, "BACKWARD_MIN_KEYS", dict.fromkeys(hopper_launch.BACKWARD_MIN_KEYS, 1))
    monkeypatch.setattr(hopper_launch, "_tile_counters", {})
    monkeypatch.setattr(triton_backend, "_plans", {})
    monkeypatch.setattr(triton_backend, "_signatures", {})
    batch, heads, seqlen, head_dim = 2, 4, 1000, 128
    backend = _backend()
    params = AttentionParams(scale=head_dim ** -0.5, window_right=0)
    launches = []
    real_forward = hopper_launch.forward
    monkeypatch.setattr(hopper_launch, "forward", lambda *args: launches.append(1) or real_forward(*args))

    def inputs():
        return [torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]

    def check(q, k, v, results, grad_out):
        failed = failures_against_reference(q, k, v, params, grad_out, results)
        assert not failed, "; ".join(failed)

    q, k, v = inputs()
    with poisoned_allocations():
        first = backend.forward(q, k, v, params)
    check(q, k, v, first, torch.zeros_like(q))
    for _ in range(10):
        assert all(torch.equal(a, b) for a, b in zip(backend.forward(q, k, v, params), first))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    results = {0: [], 1: []}
    for _ in range(5):
        for index, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                results[index].append(backend.forward(q, k, v, params))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for found in results.values() for pair in found for a, b in zip(pair, first))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.forward(q, k, v, params)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = backend.forward(q, k, v, params)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, first))
        assert all(torch.equal(a, b) for a, b in zip(backend.forward(q, k, v, params), first))
    assert len(launches) == 1  # the first call prepared the launch; every other call launched it directly
    for _ in range(2):  # new tensors (new maps), forward and backward, each against the reference
        q, k, v = inputs()
        grad_out = torch.randn_like(q)
        with poisoned_allocations():
            out, lse = backend.forward(q, k, v, params)
            dq, dk, dv, _ = backend.backward(grad_out, q, k, v, out, lse, params)
        check(q, k, v, (out, lse, dq, dk, dv), grad_out)


def _check_gluon_kernel(monkeypatch, threshold: str, launch: str, dtype, case: dict):
    """check_attention on ``case`` with hopper_launch's key threshold ``threshold`` lowered to one key, asserting
    that hopper_launch.``launch`` (the Gluon kernel's launch) ran."""
    from mhattn.backends.triton import hopper_launch

    monkeypatch.setattr(hopper_launch, threshold, dict.fromkeys(getattr(hopper_launch, threshold), 1))
    launches = []
    real_launch = getattr(hopper_launch, launch)
    monkeypatch.setattr(hopper_launch, launch, lambda *args: launches.append(1) or real_launch(*args))
    check_attention(dtype=dtype, device="cuda", **case)
    assert launches, f"the Gluon Hopper kernel (hopper_launch.{launch}) did not run"


# The Gluon backward (hopper_backward.py) on ragged shapes: GQA, both causal alignments with rows that see no key,
# more queries than keys, packed QKV views (strided heads), a gradient into the log-sum-exp, one key.
GLUON_BACKWARD_CASES = {
    "d64_ragged_gqa": dict(head_dim=64, heads_q=6, heads_kv=2, seqlen_q=300, seqlen_k=517),
    "d64_bottom_right_empty_rows": dict(head_dim=64, seqlen_q=517, seqlen_k=300, causal="bottom_right"),
    "d128_top_left_more_queries": dict(head_dim=128, heads_q=8, heads_kv=2, seqlen_q=517, seqlen_k=300,
                                       causal="top_left"),
    "d128_bottom_right": dict(head_dim=128, seqlen_q=129, seqlen_k=700, causal="bottom_right"),
    "d128_packed_grad_lse": dict(head_dim=128, layout="packed", seqlen_q=600, seqlen_k=600, heads_q=4,
                                 causal="top_left", grad_lse=True),
    "d64_one_key": dict(head_dim=64, seqlen_q=65, seqlen_k=1),
    "d256_ragged_gqa": dict(head_dim=256, heads_q=6, heads_kv=2, seqlen_q=300, seqlen_k=517),
    "d256_bottom_right_empty_rows": dict(head_dim=256, seqlen_q=517, seqlen_k=300, causal="bottom_right"),
    "d256_packed_grad_lse": dict(head_dim=256, layout="packed", seqlen_q=600, seqlen_k=600, heads_q=4,
                                 causal="top_left", grad_lse=True),
    "d256_one_key": dict(head_dim=256, seqlen_q=65, seqlen_k=1),
}


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GLUON_BACKWARD_CASES))
def test_gpu_gluon_hopper_backward(monkeypatch, dtype, case):
    _check_gluon_kernel(monkeypatch, "BACKWARD_MIN_KEYS", "backward", dtype, GLUON_BACKWARD_CASES[case])


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("slicing", ["heads", "batches"])
def test_gpu_gluon_hopper_backward_in_slices(monkeypatch, slicing):
    """The backward split into launches over single key/value heads, or over batch slices of 2, 2 and 1 entries
    (each with its own float32 dQ buffer), gives the same gradients as the reference."""
    from mhattn.backends.triton import hopper_launch

    batch, heads_q, heads_kv, seqlen, head_dim = 5, 4, 2, 300, 64
    per_head = (heads_q // heads_kv) * seqlen * head_dim * 4
    monkeypatch.setattr(hopper_launch, "ACCUMULATOR_BYTES", 1 if slicing == "heads" else 4 * per_head)
    monkeypatch.setattr(hopper_launch, "MIN_WAVES", 0)
    monkeypatch.setattr(hopper_launch, "SINGLE_LAUNCH_BYTES", 0)
    assert hopper_launch.backward_slices(batch, heads_kv, per_head, 3, 132) == ((1, 1) if slicing == "heads" else (2, 2))
    _check_gluon_kernel(monkeypatch, "BACKWARD_MIN_KEYS", "backward", "bfloat16",
                        dict(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen, seqlen_k=seqlen,
                             head_dim=head_dim, causal="bottom_right"))


@pytest.mark.gpu
@needs_gpu
@needs_sm90
@pytest.mark.parametrize("slicing", ["heads", "batches"])
def test_gpu_sliced_gluon_backward_with_dropout(monkeypatch, slicing):
    """A backward with dropout run by the Gluon kernel in slices of single key/value heads, or of 2, 2 and 1 batch
    entries: each launch draws the keep-mask by the call's batch and head numbers (call_batch_head0, call_heads_q), so
    the gradients match the reference's with the forward's mask."""
    from mhattn.backends.triton import backend as triton_backend
    from mhattn.backends.triton import hopper_launch

    batch, heads_q, heads_kv, seqlen, head_dim = 5, 4, 2, 300, 128
    per_head = (heads_q // heads_kv) * seqlen * head_dim * 4
    monkeypatch.setattr(hopper_launch, "ACCUMULATOR_BYTES", 1 if slicing == "heads" else 4 * per_head)
    monkeypatch.setattr(hopper_launch, "MIN_WAVES", 0)
    monkeypatch.setattr(hopper_launch, "SINGLE_LAUNCH_BYTES", 0)
    monkeypatch.setattr(triton_backend, "_plans", {})  # plans keep their slices
    monkeypatch.setattr(triton_backend, "_signatures", {})
    assert hopper_launch.backward_slices(batch, heads_kv, per_head, 3, 132) == ((1, 1) if slicing == "heads" else (2, 2))
    _check_gluon_kernel(monkeypatch, "BACKWARD_MIN_KEYS", "backward", "bfloat16",
                        dict(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen, seqlen_k=seqlen,
                             head_dim=head_dim, causal="bottom_right", dropout_p=0.2))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tf32", [False, True])
def test_gpu_fp32_follows_torch_matmul_precision(tf32):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        if tf32:
            with pytest.raises(AssertionError):  # TF32 misses the 1e-4 fp32 bound ...
                check_attention(dtype="float32", device="cuda", seqlen_q=300, seqlen_k=300, head_dim=64)
        else:  # ... full fp32 meets it
            check_attention(dtype="float32", device="cuda", seqlen_q=300, seqlen_k=300, head_dim=64, causal="top_left")
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.gpu
@needs_gpu
def test_gpu_backward_is_deterministic_over_50_runs():
    check_attention(dtype="bfloat16", device="cuda", batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_k=1000,
                    head_dim=128, causal="top_left", det_runs=50)


@pytest.mark.gpu
@needs_gpu
def test_gpu_dropout_bits_and_keep_mask():
    check_dropout_bits(device="cuda", batch=3, heads=5, seqlen_q=300, seqlen_k=333)
    check_dropout_mask_in_attention(device="cuda", dtype="float16", batch=2, heads=3, seqlen_q=100, p=0.2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_properties(0).total_memory < 40 * 2**30,
                    reason="needs 40 GiB of GPU memory")
def test_gpu_over_2_31_elements_and_huge_batch_heads():
    """q, k, v of 2**31 + 2**14 elements each (64-bit offsets), 131073 batch*heads (a grid past 65535)."""
    batch, heads, seqlen, head_dim = 131073, 1, 128, 128
    backend = _backend()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    assert q.numel() > 2**31
    params = AttentionParams(scale=head_dim ** -0.5, window_right=0)
    out, lse = backend.forward(q, k, v, params)
    grad_out = torch.randn_like(out)
    dq, dk, dv, _ = backend.backward(grad_out, q, k, v, out, lse, params)
    for b in (0, batch - 1):  # the first and the last (batch, head): the last needs 64-bit offsets
        sl = slice(b, b + 1)
        leaves = [t[sl].double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = naive_attention(*leaves, params)
        ref_grads = torch.autograd.grad(ref_out, leaves, grad_out[sl].double())
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out[sl], lse[sl], dq[sl], dk[sl], dv[sl]),
                                   (ref_out, ref_lse, *ref_grads)):
            err = float((got.double() - want).abs().max())
            assert err < 0.05 * max(1.0, float(want.abs().max())), f"batch {b} {name}: max error {err}"


# ---- ahead-of-time compilation for Hopper (no GPU needed) ------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_hopper_kernels_compile_for_sm90a_without_a_gpu():
    """Every table entry that uses the Hopper switches compiles for sm_90a through Triton's compiler, and the
    copy-engine switch really gives bulk tensor copies in the PTX. The Gluon kernels fit an H100's shared memory per
    block (227 KB) with no ptxas note on their wgmma, the forward with two Q buffers or three rotating Q slots writes
    its output through the copy engine (from Q's slot) and rescales its output lazily where FORWARD_LAZY_RESCALE says,
    and the backward its dK and dV where BACKWARD_STAGED_DK_DV says (from K's and V's tiles), or adds them to float32
    partial sums with paired float32 atomics (GQA's PARTIAL_DK_DV builds)."""
    from mhattn.backends.triton import ahead, hopper_launch

    tasks = ahead.table_tasks("sm_90a")
    assert tasks and all(task.tile.tma or task.tile.warp_specialize or task.dq_mode for task in tasks)
    for task in tasks:
        kernel = ahead.compile_kernel(task, 90)
        ptx = kernel.asm["ptx"]
        assert ".target sm_90a" in ptx, task.label
        if task.tile.tma:
            assert "cp.async.bulk.tensor" in ptx, task.label
        if task.kind in ahead.GLUON_KINDS:
            assert kernel.metadata.shared <= 227 * 1024, (task.label, kernel.metadata.shared)
            # ptxas keeps every wgmma asynchronous (a serialised build keeps its results and loses about a quarter
            # of its speed).
            notes = ahead.wgmma_notes(kernel)
            assert not notes, (task.label, notes)
        if task.kind == "hopper_bwd":  # dQ's shares summed by the copy engine; dK and dV stored by it where staged
            assert "cp.reduce.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx, task.label
            staged = "cp.async.bulk.tensor.4d.global.shared::cta" in ptx
            flags = dict(task.flags)
            partial = flags.get("PARTIAL_DK_DV", False)  # (GQA: float32 atomic additions of partial dK and dV)
            assert staged == (hopper_launch.BACKWARD_STAGED_DK_DV[task.head_dim] and not partial), task.label
            # (atom with Triton 3.6, red with later versions: the old value is not read)
            paired = re.search(r"\b(atom|red)\.global\.gpu\.relaxed\.add\.v2\.f32", ptx)
            assert bool(paired) == partial, task.label
            # Dropout, softcap and first-key (left padding) builds take BACKWARD_FEATURE_QUERY_BLOCK's rows a step
            # where the plain build's spill with them, and then keep every value in registers.
            rows = ahead._constexprs(task)["BLOCK_M"]
            assert rows == hopper_launch.backward_query_block(task.head_dim, flags.get("DROPOUT", False),
                                                              flags.get("SOFTCAP", False),
                                                              flags.get("KEY_STARTS", False)), task.label
            if rows != hopper_launch.BACKWARD_QUERY_BLOCK[task.head_dim]:
                assert ahead.resource_usage(kernel)["stack"] == 0, task.label
        if task.kind == "hopper_fwd":
            staged = "cp.async.bulk.tensor.4d.global.shared::cta" in ptx
            # (with three rotating Q slots the upper consumer stages its output: hopper_forward.consume_tile)
            rotating = dict(task.flags).get("Q_ROTATING", False)
            assert staged == (hopper_launch.Q_BUFFERS[task.head_dim] == 2 or rotating), task.label
            # A causal persistent grid's programs take their tiles from a counter (one atomic add per tile).
            assert ("atom.global" in ptx) == dict(task.flags).get("TILE_COUNTER", False), task.label
            # A half-width diagonal block (with 128-key blocks): S of 64 keys with Q from shared memory (the
            # full-width S takes 128, and the P V products read P from registers).
            if hopper_launch.KEY_BLOCK[task.head_dim] == 128:
                half_scores = re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd",
                                        ptx)
                assert bool(half_scores) == dict(task.flags).get("HALF_DIAGONAL", False), task.label
            # The lazy rescaling compares each row's alpha with 1 before the warpgroup's vote (attend_block).
            lazy = bool(re.search(r"setp\.\w+\.f32\s+%p\d+, %r\d+, 0f3F800000", ptx))
            assert lazy == hopper_launch.FORWARD_LAZY_RESCALE[task.head_dim], task.label
    assert {task.kind for task in tasks} >= {"hopper_fwd", "hopper_bwd"}
    with pytest.raises(ValueError, match="unknown architecture"):
        ahead.table_tasks("sm_91x")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_hopper_kernels_for_head_dims_96_and_192_compile_for_sm90a_without_a_gpu():
    """The Gluon builds of head dims 96 and 192 (in the 128- and 256-wide tiles) compile for sm_90a, fit shared memory
    with no ptxas note on their wgmma, and store as their tile width's builds do: the forward's output and the
    backward's dK and dV through the copy engine (which clips the columns past the head dim), except the 192-wide
    forward's output, from registers (one Q buffer: a column mask). A plain build of each, and the causal ones with
    dropout."""
    from mhattn.backends.triton import ahead, hopper_launch

    tasks = [task for task in ahead.table_tasks("sm_90a", head_dims=(96, 192)) if task.kind in ahead.GLUON_KINDS
             and (not task.flags and not task.causal or task.causal and dict(task.flags).get("DROPOUT")
                  and not dict(task.flags).get("KEY_STARTS"))]
    assert len(tasks) == 8
    for task in tasks:
        kernel = ahead.compile_kernel(task, 90)
        ptx = kernel.asm["ptx"]
        assert kernel.metadata.shared <= 227 * 1024, (task.label, kernel.metadata.shared)
        assert not ahead.wgmma_notes(kernel), task.label
        staged = "cp.async.bulk.tensor.4d.global.shared::cta" in ptx
        width = hopper_launch.TILE_WIDTH[task.head_dim]
        assert staged == (hopper_launch.BACKWARD_STAGED_DK_DV[width] if task.kind == "hopper_bwd"
                          else hopper_launch.Q_BUFFERS[width] == 2), task.label
        widths = {int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)}
        if task.kind == "hopper_fwd":
            # Split products (FORWARD_SPLIT_HEAD_DIMS): P V in two wgmmas, half and a quarter of the tile wide, and
            # none over the whole width; otherwise the tile's width.
            split = task.head_dim in hopper_launch.FORWARD_SPLIT_HEAD_DIMS
            key_block = hopper_launch.KEY_BLOCK[width]
            assert max(widths) == max(key_block, width // 2 if split else width), (task.label, widths)
            assert not split or {width // 2, width // 4} <= widths, (task.label, widths)
        elif width == 256:
            # The wide backward's two warpgroups split dK's and dV's columns: 128 each over the whole width, or with
            # split products (BACKWARD_SPLIT_HEAD_DIMS) 64 and 32 each over the head dim's 128 + 64 columns.
            split = task.head_dim in hopper_launch.BACKWARD_SPLIT_HEAD_DIMS
            assert max(widths) == (width // 4 if split else width // 2), (task.label, widths)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_softcap_tanh_is_the_hardware_approximation_for_16_bit_inputs_only():
    """Compiled for sm_90a without a GPU: with a softcap, the Gluon forward and backward, the FlashAttention-2 forward
    and dK/dV kernels and the split-KV decoding kernel take the tanh as tanh.approx.f32 with 16-bit inputs (one
    multi-function-unit operation instead of an exp2 and a division), and with float32 inputs keep the exact formula
    (scores.softcap_tanh); a build without a softcap has neither."""
    from mhattn.backends.triton import ahead, scores

    def tanh_ops(task):
        ptx = ahead.compile_kernel(task, 90).asm["ptx"]
        return ptx.count("tanh.approx.f32"), ptx.count("div.full.f32") + ptx.count("div.rn.f32")

    gluon = [next(task for task in ahead.table_tasks("sm_90a", head_dims=(128, )) if task.kind == kind
                  and ("SOFTCAP", True) in task.flags) for kind in ("hopper_fwd", "hopper_bwd")]
    for task in gluon:
        approx, divisions = tanh_ops(task)
        assert approx > 0 and divisions <= 8, (task.label, approx, divisions)  # (the few outside the scores: 1 / l)
    plain = dataclasses.replace(gluon[0], flags=tuple(flag for flag in gluon[0].flags if flag[0] != "SOFTCAP"))
    assert tanh_ops(plain)[0] == 0
    table = ahead.table_tasks("sm_90", head_dims=(64, ))
    for kind in ("fwd", "dkdv", "splitkv"):
        base = next(task for task in table if task.kind == kind)
        for dtype in ("fp16", "fp32"):
            task = dataclasses.replace(base, dtype=dtype, flags=base.flags + (("HAS_SOFTCAP", True), ))
            approx, divisions = tanh_ops(task)
            if dtype == "fp16":
                assert approx > 0 and scores.HARDWARE_TANH, task.label
            else:
                assert approx == 0 and divisions > 0, task.label


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernels_are_built_with_fused_multiply_adds_whatever_tritons_default(monkeypatch):
    """The builds ask Triton for fused multiply-adds (launcher.COMPILE_OPTIONS): with Triton's default turned off
    (TRITON_DEFAULT_FP_FUSION=0, the coming default), the Gluon forward for sm_90a still computes each exponent's
    argument as one fma, and ptxas is not told to split them (--fmad=false)."""
    from mhattn.backends.triton import ahead

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    task = next(task for task in ahead.table_tasks("sm_90a") if task.kind == "hopper_fwd")
    kernel = ahead.compile_kernel(task, 90)
    assert kernel.metadata.enable_fp_fusion and "fma.rn.f32" in kernel.asm["ptx"]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_hopper_tensor_maps_equal_gluons_checked_descriptors():
    """The Hopper kernels' host tensor maps are made without Gluon's constructor checks (hopper_launch.tensor_map):
    each equals the descriptor Gluon's checked constructor makes of the same fields, and has every field it has,
    for the forward's and the backward's maps, a head dim Gluon pads and a dim of extent 1 (whose stride is
    rewritten)."""
    import dataclasses

    from mhattn.backends.triton import hopper_launch

    if not hopper_launch.gluon_available():
        pytest.skip("needs Gluon")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    for head_dim, heads in ((128, 4), (64, 1), (256, 2)):
        # (B, N, H, D) storage seen as (B, H, N, D), as a projection's output is: with one head, its head stride (D)
        # is not what the copy engine accepts for an extent-1 dim.
        rows = torch.empty(2, 256, heads, head_dim, dtype=torch.bfloat16).transpose(1, 2)
        per_row = torch.empty(2, heads, 256, dtype=torch.float32)
        maps = hopper_launch.forward_maps(rows, rows, rows, rows, head_dim) + hopper_launch.backward_maps(
            rows, rows, rows, rows, per_row, per_row, rows.float(), rows, rows, head_dim)
        for made in maps:
            checked = TensorDescriptor(made.base, made.shape, made.strides, made.block_shape, made.layout)
            assert type(made) is TensorDescriptor and made == checked
            assert {f.name for f in dataclasses.fields(TensorDescriptor)} <= set(vars(made))
        if heads == 1:
            assert rows.stride(1) == head_dim and maps[0].strides[1] == 256 * head_dim


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_split_kv_kernel_compiles_for_sm90_without_spills():
    """The split-KV decoding kernel as the d = 64, 128 and 256 decoding tiles launch it (contiguous and paged cache,
    several splits; a contiguous cache's step writing its new keys and values first, with one barrier of the
    program's threads between those stores and the step's loads), its combine and the KV cache's append compile for
    sm_90 with no register spills. On sm_90 the
    split kernel lets the combine launch early (griddepcontrol.launch_dependents) and the combine, compiled as a
    programmatic dependent launch, waits for the splits' writes before it reads them (griddepcontrol.wait); for sm_80
    neither instruction is there."""
    from mhattn.backends.triton import ahead, scores

    for head_dim in (64, 128, 256):
        tasks = ahead.split_kv_tasks(head_dim, 90)
        # Last, dense steps with a key-padding bias and with a bias that varies over the query rows: no spill with the
        # key mask (its row read one block ahead); the rows' own mask spills 24 bytes a thread at d = 64 (a compiler
        # report, decode.split_kv_kernel).
        masked_steps = tasks[-2:]
        for masked, kind in zip(masked_steps, (scores.MASK_KEYS_FLOAT, scores.MASK_FLOAT)):
            assert dict(masked.flags)["MASK_KIND"] == kind and masked.flags[:-1] == tasks[0].flags
            kernel = ahead.compile_kernel(masked, 90)
            stack = ahead.resource_usage(kernel)["stack"]
            assert stack <= (24 if head_dim == 64 and kind == scores.MASK_FLOAT else 0), (masked.label, stack)
            assert kernel.metadata.shared <= 227 << 10, masked.label
        hopper = tasks[6:-2]  # the split kernels again with the HBM3e Hopper tile, at d = 128
        tasks = tasks[:6]
        assert [task.kind for task in tasks] == ["splitkv", "splitkv", "splitkv", "combine", "append_kv", "append_kv"]
        assert [dict(task.flags)["PAGED"] for task in tasks if task.kind != "combine"] == [False, True, False, False,
                                                                                            True]
        assert [dict(task.flags).get("APPEND", False) for task in tasks] == [False, False, True, False, False, False]
        assert [task.flags for task in hopper] == ([task.flags for task in tasks[:3]] if head_dim == 128 else [])
        assert all(task.tile.block_n == 128 for task in hopper)
        for task in hopper:
            kernel = ahead.compile_kernel(task, 90)
            assert ahead.resource_usage(kernel)["stack"] == 0 and kernel.metadata.shared <= 227 << 10, task.label
        assert all(task in ahead.table_tasks("sm_90") for task in tasks + hopper + masked_steps)
        split_ptx = []
        for task in tasks:
            kernel = ahead.compile_kernel(task, 90)
            assert ahead.resource_usage(kernel)["stack"] == 0, task.label
            assert kernel.metadata.shared <= 227 << 10, task.label  # (what a block may hold on sm_90)
            ptx = kernel.asm["ptx"]
            if task.kind == "splitkv":
                assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" not in ptx, task.label
                split_ptx.append(ptx)
            elif task.kind == "combine":
                assert "griddepcontrol.wait" in ptx and kernel.metadata.launch_pdl, task.label
            else:
                assert "griddepcontrol" not in ptx, task.label
        # The appending build (same tile as the first) adds the new rows' stores and a barrier before its loads.
        plain, appending = split_ptx[0], split_ptx[2]
        for instruction in ("st.global", "bar.sync"):
            assert appending.count(instruction) > plain.count(instruction), (head_dim, instruction)
    for task in ahead.split_kv_tasks(128, 80):
        assert "griddepcontrol" not in ahead.compile_kernel(task, 80).asm["ptx"], task.label


def test_backward_path_says_when_the_short_backward_runs():
    """explain's backward line for the Triton backend: the one-launch short backward where every key fits one block
    (and no mask gradient), the FlashAttention-2 kernels past it or with a mask gradient, on an sm_90 problem below the
    Gluon backward's key count and on an Ampere one."""
    import dataclasses

    from mhattn.backends.triton import configs
    from mhattn.problem import Problem

    backend = _backend()
    base = Problem(device_type="cuda", device_index=0, compute_capability=(9, 0), dtype=torch.bfloat16, batch=1,
                   heads_q=16, heads_kv=16, seqlen_q=128, seqlen_k=128, head_dim=64, head_dim_v=64,
                   features=frozenset(), needs_grad=True)
    short = backend.backward_path(base)
    assert short.startswith("the short backward in one launch") and "all 128 keys in one block of 128" in short
    assert "backward_short_kernel" in short
    ampere = backend.backward_path(dataclasses.replace(base, compute_capability=(8, 0), seqlen_k=50))
    assert "all 50 keys in one block of 64" in ampere
    for other in (dataclasses.replace(base, seqlen_k=129), dataclasses.replace(base, head_dim=128, head_dim_v=128,
                                                                                seqlen_k=100),
                  dataclasses.replace(base, dtype=torch.float32, head_dim=128, head_dim_v=128),
                  dataclasses.replace(base, features=frozenset({"float_mask", "mask_grad"}))):
        assert backend.backward_path(other).startswith("the FlashAttention-2 backward"), other
    with configs.pin("16,16,4,1"):
        assert backend.backward_path(base).startswith("the FlashAttention-2 backward")


def test_forward_path_of_decoding_steps_names_the_masks_the_split_kernels_take():
    """mhattn explain's forward path for a decoding step (few query rows per key/value head): the split-KV kernels
    without a mask, and with a mask (saying how they read it: a key-padding mask one row for all, another mask each
    row's own, a per-head one too); a mask with a gradient or dropout take another path."""
    from mhattn.problem import Problem

    backend = _backend()
    step = Problem(device_type="cuda", device_index=0, compute_capability=(9, 0), dtype=torch.bfloat16, batch=8,
                   heads_q=32, heads_kv=8, seqlen_q=1, seqlen_k=8192, head_dim=128, head_dim_v=128,
                   features=frozenset({"gqa"}))
    assert backend.forward_path(step) == ("the split-KV decoding kernels (decode.py): few query rows per key/value "
                                          "head")
    for mask in ("bool_mask", "float_mask"):
        path = backend.forward_path(dataclasses.replace(step, features=frozenset({"gqa", mask})))
        assert path.startswith("the split-KV decoding kernels") and "a per-head bias each row's own" in path, path
    for other in ({"float_mask", "mask_grad"}, {"dropout"}):
        path = backend.forward_path(dataclasses.replace(step, features=frozenset({"gqa"} | other)))
        assert not path.startswith("the split-KV decoding kernels"), (other, path)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("cc", [90, 80])
def test_short_backward_compiles_without_spills_at_every_tile_it_takes(cc):
    """The short backward (backward_short_kernel) holds dK and dV of all its keys in registers: every tile it takes
    (head dims 16 to 128, 16 keys up to its most: 128 at d <= 64, 64 at d = 128), causal, compiles for sm_90 and
    sm_80 with no stack (no spills) in bf16 and, up to d = 64, in float32 (TF32 dots); d = 256, float32 at d = 128
    and keys past the most take the three kernels. Its widest tiles are in the build's task list for both."""
    from mhattn.backends.triton import ahead, configs

    assert configs.short_backward_tile(16, 256, 256) is None and configs.short_backward_tile(16, 128, 256) is None
    assert configs.short_backward_tile(16, 128, 128, element_size=4) is None
    widest = {16: 128, 32: 128, 64: 128, 128: 64}
    for head_dim, most in widest.items():
        assert configs.short_backward_tile(most + 1, head_dim, head_dim) is None
        tiles = {configs.short_backward_tile(keys, head_dim, head_dim) for keys in (16, 32, 64, 128) if keys <= most}
        assert ahead.short_backward_widest_tile(head_dim).block_n == most and None not in tiles
        for tile in sorted(tiles, key=str):
            for dtype in ("bf16", "fp32") if head_dim <= 64 else ("bf16",):
                task = ahead.KernelTask("short_bwd", head_dim, True, tile, dtype=dtype)
                stack = ahead.resource_usage(ahead.compile_kernel(task, cc))["stack"]
                assert stack == 0, f"{task.label}: {stack} B of stack per thread"
        if head_dim in (64, 128):
            assert ahead.KernelTask("short_bwd", head_dim, True, ahead.short_backward_widest_tile(head_dim)) in \
                ahead.table_tasks(f"sm_{cc}")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_short_forward_tiles_compile_for_sm90_without_spills():
    """Every forward tile a short query sequence takes on sm_90 (configs.SHORT_FORWARD, and SHORT_FORWARD_MASKED for
    calls that read a mask) is in the build's task list and compiles for sm_90 in bf16 with no stack (no spills) and
    within a block's shared memory: without a mask, and with a boolean mask, a key-padding mask (one row of keys a
    block, with key bounds: scores.MASK_KEYS), a float mask and a key-padding bias (one row of keys a block:
    scores.MASK_KEYS_FLOAT) for the tiles masked calls take (config_for with ``masked``)."""
    from mhattn.backends.triton import ahead, configs

    tasks = ahead.table_tasks("sm_90")
    for key in set(configs.SHORT_FORWARD) | set(configs.SHORT_FORWARD_MASKED):
        arch, _, head_dim, causal = key
        assert arch == "sm90"
        plain = configs.SHORT_FORWARD.get(key, ())
        masked = configs.SHORT_FORWARD_MASKED.get(key, plain)
        for mask_kind, entries in ((0, plain), (1, masked), (3, masked), (2, masked), (4, masked)):
            for most_keys, tile in entries:
                seqlen_k = most_keys or configs.SHORT_SEQLEN
                chosen = configs.config_for((9, 0), torch.bfloat16, head_dim, causal, seqlen_q=128, seqlen_k=seqlen_k,
                                            masked=mask_kind != 0).forward
                assert chosen == tile, (key, mask_kind, most_keys)
                task = ahead.KernelTask("fwd", head_dim, causal, tile)
                assert task in tasks, task.label
                flags = {0: (), 1: (("MASK_KIND", 1),), 3: (("MASK_KIND", 3), ("KEY_LENGTHS", True)),
                         2: (("MASK_KIND", 2),), 4: (("MASK_KIND", 4),)}[mask_kind]
                kernel = ahead.compile_kernel(ahead.KernelTask("fwd", head_dim, causal, tile, flags=flags), 90)
                assert ahead.resource_usage(kernel)["stack"] == 0, f"{task.label} mask kind {mask_kind}"
                assert kernel.metadata.shared <= 227 << 10, task.label


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_float32_tiles_on_sm90_spill_little():
    """The sm_90 table's float32 tiles (TF32 and full-precision dots, d = 64, 128, 256, causal and not) compile with
    at most a little stack. The earlier full-precision tiles spilled 1-11 KB per thread and ran about 40x slower
    than torch's kernels on an H100 (B=16 H=16 N=1k d=128: 130 ms against 3 ms)."""
    from mhattn.backends.triton import ahead, configs

    for precision in ("ieee", "tf32"):
        for head_dim in (64, 128, 256):
            for causal in (False, True):
                config = configs.table_config((9, 0), torch.float32, head_dim, causal, precision=precision)
                for kind, tile in (("fwd", config.forward), ("dkdv", config.dkdv), ("dq", config.dq)):
                    task = ahead.KernelTask(kind, head_dim, causal, tile, dtype="fp32",
                                            flags=(("DOT_PRECISION", precision),))
                    stack = ahead.resource_usage(ahead.compile_kernel(task, 90))["stack"]
                    assert stack <= 512, f"{task.label}: {stack} B of stack per thread"
    assert configs.table_config((9, 0), torch.float32, 128, False, precision="ieee") != \
        configs.table_config((9, 0), torch.float32, 128, False, precision="tf32")


def test_hopper_backward_slices_bound_the_dq_buffer():
    """hopper_launch.backward_slices: one launch while the whole float32 dQ buffer is small; above, a buffer under
    ACCUMULATOR_BYTES per launch, whole batch entries when they fit, near-equal slices, and never fewer than
    MIN_WAVES waves of programs per launch."""
    from mhattn.backends.triton.hopper_launch import ACCUMULATOR_BYTES, backward_slices

    assert backward_slices(1, 16, 32768 * 128 * 4, 256, 132) == (1, 4)      # N = 32k, d = 128: 4 heads per launch
    assert backward_slices(16, 16, 1024 * 128 * 4, 8, 132) == (16, 16)     # N = 1k, B = 16: 128 MiB, one launch
    assert backward_slices(32, 16, 1024 * 128 * 4, 8, 132) == (8, 16)      # B = 32: 64 MiB per launch
    assert backward_slices(1, 32, ACCUMULATOR_BYTES, 8, 132) == (1, 32)    # few programs per head: one launch
    assert backward_slices(7, 4, ACCUMULATOR_BYTES // 8, 1000, 132) == (2, 4)  # 8 heads fit: slices of 2, 2, 2, 1


class RecordingLauncher:
    """A stand-in for a Gluon kernel's CompiledLauncher in hopper_launch: each launch hands ``record`` its grid, its
    arguments by the kernel's parameter names and its compile-time set (the constexprs it was given)."""

    def __init__(self, kernel, record):
        self.names, self.record = kernel.arg_names, record

    def constexprs(self, *args, **kwargs):
        return kwargs

    def launch(self, grid, args, constexprs, device_index):
        self.record(grid, dict(zip(self.names, args)), constexprs)

    def prepare_maps(self, grid, args, constexprs, device_index):
        return RecordingMapSite(self, grid, args, constexprs)


class RecordingMapSite:
    """A stand-in for launcher.PreparedMapLaunch over a RecordingLauncher: each launch makes the maps from the
    prepared ones' geometry and the tensors given in their places, as the site's launch through Triton does."""

    def __init__(self, launcher, grid, args, constexprs):
        self.launcher, self.grid, self.constexprs = launcher, grid, constexprs
        self.maps = {i: a for i, a in enumerate(args) if type(a).__name__ == "TensorDescriptor"}

    def launch(self, args):
        from mhattn.backends.triton.launcher import with_base

        args = tuple(with_base(self.maps[i], a) if i in self.maps else a for i, a in enumerate(args))
        self.launcher.launch(self.grid, args, self.constexprs, None)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_deterministic_turn_counters_cover_the_query_blocks_of_every_build(monkeypatch):
    """A one-launch deterministic backward's zeroed words hold a turn counter for every query block of the build with
    the shortest steps: a left-padded call's build (KEY_STARTS) takes 64-row steps at d = 64 where the plain
    deterministic one takes 128, and the kernel numbers its counters by its own steps."""
    from types import SimpleNamespace

    from mhattn.backends.triton import hopper_launch

    monkeypatch.setattr(hopper_launch, "_sm_count", lambda index: 132)
    batch, heads_q, heads_kv, seqlen_q, head_dim = 2, 6, 2, 700, 64
    plan = SimpleNamespace(head_dim=head_dim, seqlen_q=seqlen_q, seqlen_k=700, batch=batch, heads_kv=heads_kv,
                           kv_group=heads_q // heads_kv, has_right=True, has_left=False, key_lengths=True,
                           heads_q=heads_q, has_dropout=False, has_softcap=False, hopper_backward_constexprs={},
                           hopper_backward_slices=None)
    assert hopper_launch.backward_query_block(head_dim, key_starts=True) < hopper_launch.backward_query_block(head_dim)
    turns = (hopper_launch.backward_sums_words(plan, None, True)
             - batch * heads_kv * ((heads_q // heads_kv) * seqlen_q * head_dim + 1))
    for flags in ({}, {"key_starts": True}, {"dropout": True}, {"softcap": True}):
        assert turns >= batch * heads_q * -(-seqlen_q // hopper_launch.backward_query_block(head_dim, **flags)), flags


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("shape, expected", [
    # (B, Hq, Hkv, N, d, causal, window, deterministic) -> programs per key block of a key/value head
    ((2, 16, 16, 4096, 128, True, False, False), 1),  # no GQA
    ((2, 16, 4, 4096, 128, True, False, False), 4),   # 256 programs -> 1024 (6 an SM wanted: 792)
    ((4, 32, 8, 2048, 128, True, False, False), 2),   # 512 -> 1024
    ((2, 28, 4, 4096, 128, True, False, False), 7),   # a group of 7: 1 or 7
    ((2, 32, 4, 4096, 128, True, False, False), 4),   # a group of 8: two heads a program
    ((8, 16, 4, 1024, 128, True, False, False), 1),   # 1k keys: the group in one program
    ((2, 16, 4, 1024, 128, True, False, False), 4),   # ... unless the grid is short of one program an SM (64)
    ((2, 16, 4, 4096, 128, False, False, False), 1),  # no causal mask: programs of equal lengths
    ((2, 16, 1, 4096, 128, False, False, False), 4),  # MQA: 64 programs, short of one an SM -> 256
    ((2, 16, 1, 4096, 128, True, False, False), 16),  # ... causal: 792 wanted, 1024
    ((1, 8, 1, 512, 64, False, False, False), 8),     # 4 programs: as many as the group gives
    ((4, 16, 4, 2048, 64, True, False, False), 1),    # head dim 64
    ((2, 16, 4, 4096, 128, True, True, False), 1),    # a window
    ((2, 16, 4, 4096, 128, True, False, True), 1),    # deterministic
    ((2, 16, 4, 4096, 96, True, False, False), 1),    # a head dim narrower than its tile
    ((1, 16, 1, 4096, 256, False, False, False), 1),  # head dim 256
])
def test_hopper_backward_group_parts_rule(monkeypatch, shape, expected):
    """hopper_launch.backward_group_parts on 132 SMs: a causal GQA grid at head dim 128 and 2k keys or more is split
    until it has six programs per SM, another grid short of one program per SM until it has one, by divisors of the
    group; one program walks the group otherwise. BACKWARD_HEADS_PER_PROGRAM overrides the rule where it divides the group."""
    from types import SimpleNamespace

    from mhattn.backends.triton import hopper_launch

    monkeypatch.setattr(hopper_launch, "_sm_count", lambda index: 132)
    batch, heads_q, heads_kv, seqlen, head_dim, causal, window, deterministic = shape
    plan = SimpleNamespace(batch=batch, heads_q=heads_q, heads_kv=heads_kv, kv_group=heads_q // heads_kv,
                           seqlen_q=seqlen, seqlen_k=seqlen, head_dim=head_dim, has_right=causal, has_left=window)
    assert hopper_launch.backward_group_parts(plan, deterministic, None) == expected
    monkeypatch.setattr(hopper_launch, "BACKWARD_HEADS_PER_PROGRAM", 2)
    group = heads_q // heads_kv
    overridden = group // 2 if group % 2 == 0 and group > 1 else 1
    assert hopper_launch.backward_group_parts(plan, deterministic, None) == (1 if expected == 1 and (
        deterministic or head_dim in (96, 256)) else overridden)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_explain_says_where_the_gluon_backward_splits_a_group(monkeypatch):
    """backward_path names the split of GQA's query heads over programs where group_parts makes one (a causal
    Llama-shaped step on 132 SMs: 4 query heads over 4 programs), and not without GQA, nor deterministic."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from mhattn.backends.triton import hopper_launch
    from mhattn.problem import Problem

    monkeypatch.setattr(hopper_launch, "_sm_count", lambda index: 132)
    backend = _backend()

    def path(heads_kv, deterministic=False):
        monkeypatch.setattr(backend, "_deterministic", lambda: deterministic)
        return backend.backward_path(Problem(
            device_type="cuda", device_index=0, compute_capability=(9, 0), dtype=torch.bfloat16, batch=2, heads_q=16,
            heads_kv=heads_kv, seqlen_q=4096, seqlen_k=4096, head_dim=128, head_dim_v=128,
            features=frozenset({"causal", "gqa"} if heads_kv < 16 else {"causal"})))

    assert "Gluon Hopper backward" in path(4)
    assert "4 query heads split over 4 programs a key block" in path(4)
    assert "split over" not in path(16) and "split over" not in path(4, deterministic=True)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("seqlen_q, slices, deterministic", [(200, False, False), (2500, False, False),
                                                              (200, True, False), (200, False, True),
                                                              (2500, True, True)])
def test_hopper_backward_host_side_hands_dq_conversion_to_the_kernel_where_a_head_is_small(monkeypatch, seqlen_q,
                                                                                             slices, deterministic):
    """hopper_launch.backward's arguments, by the kernel's own parameter names, with a launcher that records them:
    dQ's float32 sums zeroed and followed by one zeroed int32 counter per (batch, key/value head) in the same buffer;
    the kernel converts dQ itself (convert_in_kernel 1, dq not written on the host) where a head's sums take at
    most CONVERT_IN_KERNEL_MAX_BYTES, else the host copies the sums into dq after the launch; one launch per slice
    with its own sums and counters, zeroed on the host; with one launch, the caller's buffer of
    backward_sums_words words (zeroed by the preprocess kernel). Each launch numbers its batch entries and heads for
    the dropout keep-mask from its slice's first in the call. A deterministic backward's build gets its zeroed int32
    turn counters, one per (batch entry, query head, query block), right after the counters (the counters stand in
    for them otherwise). GQA (two query heads a key/value head) not deterministic: one program per query head
    (group_parts 2, twice the programs), dK and dV as zeroed float32 partial sums right after the counters, copied
    into dk and dv after the launch; deterministic: one program walks both heads, dK and dV written by the kernel."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from types import SimpleNamespace

    from mhattn.backends.triton import hopper_backward, hopper_launch

    batch, heads_q, heads_kv, head_dim = 2, 4, 2, 128
    q = torch.randn(batch, heads_q, seqlen_q, head_dim, dtype=torch.bfloat16)
    k = torch.randn(batch, heads_kv, 300, head_dim, dtype=torch.bfloat16)
    rows = torch.zeros(batch, heads_q, seqlen_q, dtype=torch.float32)
    dq = torch.full_like(q, float("nan"))
    dk, dv = torch.empty_like(k), torch.empty_like(k)
    calls = []

    def record(grid, named, constexprs):
        calls.append((grid, named, named["dQacc"].clone(), named["DqCounters"].clone(), named["DqTurns"].clone(),
                      constexprs, named["dK"].clone(), named["dV"].clone()))  # as the kernel finds them
        named["dQacc"].fill_(len(calls))  # what the kernel adds: a value per launch, so a host copy shows in dq
        if constexprs["PARTIAL_DK_DV"]:
            named["dK"].fill_(10 + len(calls))
            named["dV"].fill_(20 + len(calls))

    monkeypatch.setattr(hopper_launch, "_backward_launcher",
                        [RecordingLauncher(hopper_backward.hopper_backward_kernel, record)])
    monkeypatch.setattr(hopper_launch, "_sm_count", lambda index: 132)
    if slices:  # a launch per batch entry
        monkeypatch.setattr(hopper_launch, "SINGLE_LAUNCH_BYTES", 1)
        # (a batch entry's float32 sums: dQ's, and the partial dK and dV sums by which slices are sized)
        monkeypatch.setattr(hopper_launch, "ACCUMULATOR_BYTES", heads_kv * (2 * seqlen_q + 2 * 300) * head_dim * 4)
        monkeypatch.setattr(hopper_launch, "MIN_WAVES", 0)
    plan = SimpleNamespace(head_dim=head_dim, seqlen_q=seqlen_q, seqlen_k=300, batch=batch, heads_kv=heads_kv,
                           kv_group=heads_q // heads_kv, has_right=False, has_left=False, key_lengths=False,
                           heads_q=heads_q, has_dropout=False, has_softcap=False, hopper_backward_constexprs={},
                           hopper_backward_slices=None)
    run = SimpleNamespace(qk_scale2=1.0, sm_scale=1.0, diag_offset=0, window_left=0, key_bounds=None,
                          threshold=0, dropout_scale=1.0, softcap_in2=0.0, softcap_out2=0.0)
    # One launch: the caller allocates the sums and counters beside lse2 and delta, and the preprocess zeroes them.
    words = hopper_launch.backward_sums_words(plan, None, deterministic)
    query_blocks = -(-seqlen_q // hopper_launch.BACKWARD_QUERY_BLOCK[head_dim])
    turns = heads_q * query_blocks if deterministic else 0
    partial = not deterministic
    partial_words = 2 * heads_kv * 300 * head_dim if partial else 0
    assert hopper_launch.backward_group_parts(plan, deterministic) == (2 if partial else 1)
    assert words == (0 if slices else batch * (heads_kv * ((heads_q // heads_kv) * seqlen_q * head_dim + 1) + turns
                                               + partial_words))
    given = torch.zeros(words) if words else None
    hopper_launch.backward(q, k, k, q, rows, rows, dq, dk, dv, run, plan, None, given, deterministic)

    small = (heads_q // heads_kv) * seqlen_q * head_dim * 4 <= hopper_launch.CONVERT_IN_KERNEL_MAX_BYTES
    assert len(calls) == (batch if slices else 1)
    entries = 1 if slices else batch
    for launch_index, (grid, named, sums, counters, turn_counters, constexprs, dk_sums, dv_sums) in enumerate(calls):
        assert named["dQ"].shape == (entries, heads_q, seqlen_q, head_dim) and named["dQ"].dtype == q.dtype
        assert sums.shape == named["dQ"].shape and sums.dtype == torch.float32 and not sums.any()
        assert counters.dtype == torch.int32 and counters.tolist() == [0] * (entries * heads_kv)
        assert named["DqCounters"].data_ptr() == named["dQacc"].data_ptr() + sums.numel() * 4  # right after the sums
        assert dict(constexprs)["DETERMINISTIC"] == deterministic
        assert dict(constexprs)["PARTIAL_DK_DV"] == partial and named["group_parts"] == (2 if partial else 1)
        if partial:  # dK's then dV's float32 sums (k's shape, contiguous, zeroed) from the next 16 bytes on
            padded_counters = -(-counters.numel() // 4) * 4
            assert named["dK"].data_ptr() == named["DqCounters"].data_ptr() + padded_counters * 4
            assert named["dK"].data_ptr() % 16 == 0
            assert named["dV"].data_ptr() == named["dK"].data_ptr() + dk_sums.numel() * 4
            for sums_kv in (dk_sums, dv_sums):
                assert sums_kv.shape == (entries, heads_kv, 300, head_dim) and sums_kv.is_contiguous()
                assert sums_kv.dtype == torch.float32 and not sums_kv.any()
            strides = (heads_kv * 300 * head_dim, 300 * head_dim, head_dim)
            assert (named["stride_dkb"], named["stride_dkh"], named["stride_dkn"]) == strides
            assert (named["stride_dvb"], named["stride_dvh"], named["stride_dvn"]) == strides
        else:
            assert named["dK"].data_ptr() == dk[launch_index * entries:].data_ptr()
            assert (named["stride_dkb"], named["stride_dkh"], named["stride_dkn"]) == dk.stride()[:3]
        if deterministic:  # the turn counters right after the counters
            assert named["DqTurns"].data_ptr() == named["DqCounters"].data_ptr() + counters.numel() * 4
            assert turn_counters.dtype == torch.int32 and turn_counters.tolist() == [0] * (entries * turns)
        else:
            assert named["DqTurns"] is named["DqCounters"]
        if not slices:  # the caller's buffer: the sums from its start, the counters (and turns) filling the rest
            assert named["dQacc"].data_ptr() == given.data_ptr()
            assert words == (sums.numel() + counters.numel() + turn_counters.numel() * deterministic
                             + partial_words * batch)
        assert named["convert_in_kernel"] == int(small)
        # the dropout keep-mask's numbering: this launch's first (batch entry, query head) in the call's
        assert named["call_heads_q"] == heads_q and named["call_batch_head0"] == launch_index * entries * heads_q
        assert (named["stride_dqb"], named["stride_dqh"], named["stride_dqn"]) == dq.stride()[:3]
        for name, grad in (("dk_desc", dk), ("dv_desc", dv)):  # written through the copy engine, in K's blocks
            assert named[name].base.data_ptr() == grad[launch_index * entries:].data_ptr()
            assert named[name].shape == [entries, heads_kv, 300, head_dim] and named[name].block_shape == [
                1, 1, hopper_launch.BACKWARD_KEY_BLOCK[head_dim], head_dim]
        assert grid[0] == (entries * heads_kv * (2 if partial else 1)
                           * -(-300 // hopper_launch.BACKWARD_KEY_BLOCK[head_dim]))
    launch_of_entry = torch.arange(1.0, len(calls) + 1).repeat_interleave(batch // len(calls)).view(batch, 1, 1, 1)
    if partial:  # the partial sums copied into dk and dv after each launch
        assert torch.equal(dk, (10 + launch_of_entry).expand_as(k).to(k.dtype))
        assert torch.equal(dv, (20 + launch_of_entry).expand_as(k).to(k.dtype))
    if small:
        assert torch.isnan(dq).all()  # left to the kernel
    else:
        assert torch.equal(dq, launch_of_entry.expand_as(q).to(q.dtype))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [False, True])
def test_hopper_forward_host_side_keeps_a_tile_counter_per_stream(monkeypatch, causal, softcap):
    """hopper_launch.forward's arguments, by the kernel's own parameter names, with a launcher that records them: a
    causal persistent grid (more tiles than programs) gets TILE_COUNTER and its stream's int32 counter, the same one at
    every launch on the stream (the kernel leaves it at 0) and 0 when made; without a causal mask, a round-robin grid
    and no counter. The launch is prepared once per signature, and a repeated call passes its own tensors. With a
    softcap, the SOFTCAP build, the tanh's input scale and softcap * log2(e) as what qk_scale2 multiplies."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from types import SimpleNamespace

    from mhattn.backends.triton import hopper_forward, hopper_launch

    batch, heads, seqlen, head_dim = 4, 8, 1024, 128
    calls = []

    def record(grid, named, constexprs):
        calls.append((grid, constexprs, named, named["TileCounter"].clone()))

    monkeypatch.setattr(hopper_launch, "_launcher", [RecordingLauncher(hopper_forward.hopper_forward_kernel, record)])
    monkeypatch.setattr(hopper_launch, "_sm_count", lambda index: 132)
    monkeypatch.setattr(hopper_launch, "_tile_counters", {})
    plan = SimpleNamespace(head_dim=head_dim, seqlen_q=seqlen, seqlen_k=seqlen, batch=batch, heads_q=heads, kv_group=1,
                           has_right=causal, has_left=False, key_lengths=False, has_dropout=False,
                           has_softcap=softcap, hopper_schedule=None)
    run = SimpleNamespace(qk_scale2=1.0, diag_offset=0, window_left=0, window_right=0, key_bounds=None, threshold=0,
                          dropout_scale=1.0, softcap_in2=0.25, softcap_out2=43.0,
                          signature=SimpleNamespace(hopper_forward=None))
    tensors = []
    for _ in range(2):
        q = torch.randn(batch, heads, seqlen, head_dim, dtype=torch.bfloat16)
        out, lse = torch.empty_like(q), torch.empty(batch, heads, seqlen, dtype=torch.float32)
        tensors.append((q, out, lse))
        prepared = hopper_launch.forward(q, q, q, out, lse, run, plan, None)
        assert run.signature.hopper_forward is prepared and prepared.current(plan)
    tiles = batch * heads * seqlen // (2 * hopper_launch.QUERY_ROWS_PER_CONSUMER)
    assert [grid for grid, *_ in calls] == [(132,), (132,)] and tiles > 132
    for (grid, constexprs, named, at_launch), (q, out, lse) in zip(calls, tensors):
        assert constexprs["TILE_COUNTER"] == causal and constexprs["SOFTCAP"] == softcap
        assert named["qk_scale2"] == (43.0 if softcap else 1.0) and named["softcap_in2"] == 0.25
        assert named["q_desc"].base is q and named["o_desc"].base is out and named["Out"] is out
        assert named["Lse"] is lse and named["num_tiles"] == tiles
        if causal:
            assert named["TileCounter"].dtype == torch.int32 and at_launch.tolist() == [0]
        else:
            assert named["TileCounter"] is lse  # a placeholder the kernel does not read
    if causal:
        assert calls[0][2]["TileCounter"] is calls[1][2]["TileCounter"]  # one counter for the stream
    plan.hopper_schedule = None  # the forward's settings changed: the launch is made again
    assert not prepared.current(plan)


def check_key_bias_rows_and_gradient():
    """A float mask shared by heads and query rows (a key-padding bias) runs as scores.MASK_KEYS_FLOAT (one row of
    keys a block) without its gradient and as a full float mask with it; calls of one layout alternating between the
    two each get what they ask: the gradient of the bias whenever it requires one, against the float64 reference."""
    import mhattn
    from mhattn.backends.base import AttentionParams
    from mhattn.backends.triton import backend as triton_backend

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, n, 16, generator=gen, dtype=torch.float32) for n in (9, 21, 21))
    bias = torch.randn(2, 1, 1, 21, generator=gen).masked_fill(torch.arange(21) >= 15, float("-inf"))
    kinds = [triton_backend._signature_for(q, k, v, AttentionParams(scale=0.25, mask=bias.expand(2, 4, 9, 21),
                                                                    mask_requires_grad=grad), dense=True).plan.mask_kind
             for grad in (False, True)]
    assert kinds == [4, 2], kinds
    for grad in (False, True, False, True):
        leaf = bias.clone().requires_grad_(grad)
        out = mhattn.attention(q, k, v, attn_mask=leaf.expand(2, 4, 9, 21), backend="triton")
        want_leaf = bias.double().requires_grad_(grad)
        want = mhattn.attention(q.double(), k.double(), v.double(), attn_mask=want_leaf.expand(2, 4, 9, 21),
                                backend="reference")
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
        if grad:
            out.sum().backward()
            want.sum().backward()
            assert leaf.grad is not None
            torch.testing.assert_close(leaf.grad.double(), want_leaf.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.interpret
def test_key_bias_read_by_rows_unless_its_gradient_is_asked_for(interpreter):
    interpreter.run("check_key_bias_rows_and_gradient")


def check_module_key_padding_reads_rows():
    """mhattn.MultiheadAttention's key_padding_mask reaches the Triton kernels as a mask they read one row of keys a
    block: a boolean one as scores.MASK_KEYS (with key bounds), a float one as MASK_KEYS_FLOAT; with an attn_mask as
    well, the merged mask varies along the queries and is read as a tile. The outputs match torch's module."""
    import mhattn
    from mhattn.backends.triton import backend as triton_backend

    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    mine = mhattn.MultiheadAttention(32, 4, batch_first=True)
    mine.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 20, 32)
    pad = torch.arange(20)[None, :] >= torch.tensor([20, 13, 7])[:, None]  # True = padded, as torch takes it
    causal = torch.triu(torch.ones(20, 20, dtype=torch.bool), 1)
    cases = ((pad, None, 3), (torch.zeros(3, 20).masked_fill(pad, float("-inf")), None, 4), (pad, causal, 1))
    for key_padding_mask, attn_mask, kind in cases:
        triton_backend._signatures.clear()
        with mhattn.use_backend("triton"):
            out, _ = mine(x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False)
        want, _ = theirs(x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        kinds = {signature.plan.mask_kind for signature in triton_backend._signatures.values()}
        assert kinds == {kind}, (kind, kinds)


@pytest.mark.interpret
def test_module_key_padding_masks_are_read_by_rows(interpreter):
    interpreter.run("check_module_key_padding_reads_rows")


def test_key_bounds_of_key_padding_masks():
    """Per-batch key bounds for masks shared by heads and rows (no Triton needed); None for other masks."""
    from mhattn.backends.triton.key_padding import key_bounds

    keys = torch.tensor([[True, True, False, False], [False, False, False, False], [True, False, True, False]])
    mask = keys.view(3, 1, 1, 4).expand(3, 2, 5, 4)
    assert key_bounds(mask).tolist() == [2, 0, 3] and key_bounds(mask).dtype == torch.int32
    assert key_bounds(torch.ones(3, 2, 5, 4, dtype=torch.bool)) is None  # varies along H and Nq (strides)
    assert key_bounds(mask.float()) is None and key_bounds(None) is None


def test_hopper_decision_on_key_padding_kinds():
    """hopper_launch.why_not on a plan with key lengths (its shape part passing): right padding runs the Gluon kernels
    in every case; left padding (key_padding.SPAN) too (dropout and deterministic backwards included);
    a mask with holes never; the caller's padding kind is taken instead of asking the call."""
    from types import SimpleNamespace

    from mhattn.backends.triton import hopper_launch, key_padding

    class Passing(dict):
        def get(self, key, default=None):
            return (None, None, None)  # (the plan's shape part: no reason)

    def reason(kind, forward=True, dropout=False, deterministic=False, padding=None):
        plan = SimpleNamespace(has_right=True, key_lengths=True, has_dropout=dropout, hopper_reasons=Passing())
        run = SimpleNamespace(window_right=0, qk_scale2=1.0, tma_ok=True, key_padding_kind=lambda: kind)
        min_keys = None if forward else hopper_launch.backward_min_keys(deterministic)
        return hopper_launch.why_not(plan, run, min_keys, deterministic, padding)

    for forward in (True, False):
        for dropout in (False, True):
            assert reason(key_padding.RIGHT_PADDING, forward, dropout) is None
            assert reason(key_padding.OTHER, forward, dropout) == hopper_launch.NOT_KEY_LENGTHS
    assert reason(key_padding.RIGHT_PADDING, False, deterministic=True) is None
    for forward in (True, False):
        assert reason(key_padding.SPAN, forward) is None and reason(key_padding.SPAN, forward, True) is None
    assert reason(key_padding.SPAN, False, deterministic=True) is None
    assert reason(key_padding.OTHER, padding=key_padding.SPAN) is None  # the caller's kind, not the call's


def test_key_bounds_are_made_once_per_unchanged_mask(monkeypatch):
    """key_padding.key_bounds: the same tensor for the same unchanged mask (another view of it, as each layer and a
    call's backward get) on one stream; made again once the mask changes in place, and on another stream; made afresh
    (not kept) during CUDA graph capture, where the captured work must make them from what the mask holds at each
    replay."""
    from mhattn.backends.triton import key_padding

    monkeypatch.setattr(key_padding, "_key_bounds", {})
    keys = torch.tensor([[True, True, False, False], [True, True, True, False]])

    def bounds():
        return key_padding.key_bounds(keys.view(2, 1, 1, 4).expand(2, 3, 5, 4))

    first = bounds()
    assert first.tolist() == [2, 3] and bounds() is first
    keys[0, 2] = True  # a new version: made again, from the new values
    second = bounds()
    assert second is not first and second.tolist() == [3, 3] and bounds() is second
    # Another stream makes its own (its work, queued there, makes them before its kernels read them).
    monkeypatch.setattr(key_padding, "_stream_of", lambda keys: 7)
    other = bounds()
    assert other is not second and other.tolist() == [3, 3] and bounds() is other
    assert sorted(key_padding._key_bounds) == [0, 7] and len(key_padding._key_bounds[0]) == 2
    monkeypatch.setattr(key_padding, "host_checks_allowed", lambda tensor: False)  # as during capture
    during = bounds()
    assert during is not other and during.tolist() == [3, 3] and len(key_padding._key_bounds[7]) == 1


def test_right_padding_is_read_back_once_per_mask(monkeypatch):
    """key_padding.padding_kind: right padding exactly where each batch entry's kept keys are a prefix; asked again of
    the same unchanged mask (another view of it, as each layer gets) it answers without a read-back; changed in place
    (its version moves) it reads the mask again; a kept entry holds its mask; during graph capture it says no."""
    from mhattn.backends.triton import key_padding

    monkeypatch.setattr(key_padding, "_padding_kinds", {})
    reads = []
    real_sum = torch.Tensor.sum
    monkeypatch.setattr(torch.Tensor, "sum", lambda self, *a, **k: reads.append(1) or real_sum(self, *a, **k))

    def answer(keys):
        mask = keys.view(keys.shape[0], 1, 1, keys.shape[1]).expand(keys.shape[0], 2, 5, keys.shape[1])
        return key_padding.padding_kind(mask, key_padding.key_bounds(mask))[0] == key_padding.RIGHT_PADDING

    prefix = torch.tensor([[True, True, False, False], [False, False, False, False], [True, True, True, True]])
    holes = torch.tensor([[True, True, False, False], [True, False, True, False]])
    assert answer(prefix) is True and answer(holes) is False and len(reads) == 2
    assert answer(prefix) is True and answer(holes) is False and len(reads) == 2  # kept: no read-back
    prefix[1, 0] = True  # still right padding, a new version: read again
    assert answer(prefix) is True and len(reads) == 3
    prefix[1, 2] = True  # a hole at key 1
    assert answer(prefix) is False and len(reads) == 4
    assert all(entry[0].data_ptr() in (prefix.data_ptr(), holes.data_ptr())
               for per_stream in key_padding._padding_kinds.values() for entry in per_stream.values())
    # During CUDA graph capture: False (the mask is read by the kernels), even for a mask answered True before.
    right = torch.tensor([[True, True, False], [True, False, False]])
    assert answer(right) is True and len(reads) == 5
    monkeypatch.setattr(key_padding, "host_checks_allowed", lambda tensor: False)  # as during capture
    assert answer(right) is False and len(reads) == 5


def test_padding_kind_gives_each_sequence_first_key_and_bound_of_one_run():
    """key_padding.padding_kind: right padding (no spans: the bounds say it all); one run of keys per batch entry
    starting past the first key somewhere (left padding, padding on both sides) as SPAN with the (2B,) int32 bounds
    then first keys, an entry with no key at start 0; holes anywhere, OTHER. The uint8 view the kernels read answers
    as the bool mask does."""
    from mhattn.backends.triton import key_padding

    def kind(rows):
        keys = torch.tensor(rows, dtype=torch.bool)
        mask = keys.view(keys.shape[0], 1, 1, keys.shape[1]).expand(keys.shape[0], 3, 4, keys.shape[1])
        bounds = key_padding.key_bounds(mask)
        found = key_padding.padding_kind(mask.view(torch.uint8), bounds)
        assert key_padding.padding_kind(mask, bounds)[0] == found[0]
        return found[0], None if found[1] is None else found[1].tolist()

    assert kind([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]) == (key_padding.RIGHT_PADDING, None)
    left = kind([[0, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 1]])
    assert left == (key_padding.SPAN, [4, 0, 4, 4, 2, 0, 0, 3])
    assert kind([[0, 1, 1, 0], [1, 0, 0, 0]]) == (key_padding.SPAN, [3, 1, 1, 0])  # both sides
    assert kind([[0, 1, 0, 1], [1, 1, 1, 1]]) == (key_padding.OTHER, None)  # a hole after the first key
    assert kind([[1, 0, 1, 0]]) == (key_padding.OTHER, None)
    spans = key_padding.padding_kind(*(lambda m: (m, key_padding.key_bounds(m)))(
        torch.tensor([[False, True]]).view(1, 1, 1, 2)))[1]
    assert spans.dtype == torch.int32 and spans.tolist() == [2, 1]


@pytest.mark.gpu
@needs_gpu
def test_gpu_launches_through_kept_handles_stay_correct_as_addresses_strides_and_sizes_change():
    """The compiled-handle launcher (launcher.py) reuses a handle only where Triton would: a sequence of calls
    whose q/k/v alternate between aligned and misaligned views, two layouts, two sizes and causal or not
    (outputs poisoned each time) all meet CONFORMANCE.md's rule against the reference, forward and backward,
    and most launches went through kept handles."""
    from mhattn.backends.triton import backend as triton_backend
    from mhattn.backends.triton import hopper_launch

    backend = _backend()
    dt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(5)
    kinds = triton_backend.launchers()
    # At these key counts the backward is the Gluon backward where the rows suit the copy engine, else the one-launch
    # short kernel or the dK/dV kernel with its dQ kernel.
    def handle_launches():
        gluon = sum(launcher[0].handle_launches for launcher in (hopper_launch._launcher,
                                                                 hopper_launch._backward_launcher) if launcher)
        return (kinds.forward.handle_launches + kinds.dkdv.handle_launches + kinds.short_backward.handle_launches
                + gluon)

    before = handle_launches()
    for step in range(12):  # six call signatures, twice: the second time through kept handles
        seqlen = (200, 256)[step % 2]
        storage = torch.randn(3, 2, 4, seqlen, 72, device="cuda", dtype=dt, generator=gen)
        offset = step % 3  # starts 0, 2 or 4 bytes past a 16-byte boundary
        q, k, v = (storage[i, ..., offset:offset + 64] for i in range(3))
        if step % 6 >= 3:  # (B, N, H, D) memory, as a packed projection gives
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        params = AttentionParams(scale=0.125, window_right=0 if step % 6 < 2 else None)
        grad_out = torch.randn(2, 4, seqlen, 64, device="cuda", dtype=dt, generator=gen)
        with poisoned_allocations():
            out, lse = backend.forward(q, k, v, params)
            dq, dk, dv, _ = backend.backward(grad_out, q, k, v, out, lse, params)
        failed = failures_against_reference(q, k, v, params, grad_out, (out, lse, dq, dk, dv))
        assert not failed, f"step {step}: " + "; ".join(failed)
    assert handle_launches() - before >= 12


def check_repeated_backwards_match_full(device="cpu", shapes=((1, 4, 4, 40, False), (2, 4, 2, 48, True)), dim=16):
    """A repeated backward of a signature without a mask (backend._RepeatedBackward: the launches its first
    backward prepared) with new tensors each call, at 16-byte aligned and misaligned addresses, gives bitwise the
    gradients of the same backward worked out from scratch (deterministic: dQ from its own kernel, a fixed order of
    additions). shapes: (B, Hq, Hkv, N, causal)."""
    from mhattn.backends.triton import backend as triton_backend

    backend = triton_backend.TritonBackend(deterministic=True)
    dt = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(7)
    with _pinned_config(device):
        for batch, heads_q, heads_kv, seqlen, causal in shapes:
            params = AttentionParams(scale=dim ** -0.5, window_right=0 if causal else None)
            for step in range(4):
                offset = step % 2  # 0 or 2 bytes past a 16-byte boundary
                q, k, v = (torch.randn(batch, heads, seqlen, dim + 8, device=device, dtype=dt, generator=gen)
                           [..., offset:offset + dim] for heads in (heads_q, heads_kv, heads_kv))
                grad_out = torch.randn(batch, heads_q, seqlen, dim, device=device, dtype=dt, generator=gen)
                with poisoned_allocations():
                    out, lse = backend.forward(q, k, v, params)
                    signature = triton_backend._signature_for(q, k, v, params, dense=True)
                    # Steps 2 and 3 repeat steps 0 and 1 (each alignment's first backward prepared its launches).
                    assert (len(signature.repeated_backwards) == 2) == (step >= 2), signature.repeated_backwards
                    repeated = backend.backward(grad_out, q, k, v, out, lse, params)[:3]
                kept = dict(triton_backend._signatures)
                triton_backend._signatures.clear()  # no prepared launch: everything worked out anew
                try:
                    with poisoned_allocations():
                        in_full = backend.backward(grad_out, q, k, v, out, lse, params)[:3]
                finally:
                    triton_backend._signatures.clear()
                    triton_backend._signatures.update(kept)
                for name, a, b in zip(("dq", "dk", "dv"), repeated, in_full):
                    assert torch.equal(a, b), f"{name} differs (N {seqlen}, step {step})"
                    assert not torch.isnan(a).any(), f"{name} has NaN (N {seqlen}, step {step})"


def test_repeated_backwards_match_a_backward_worked_out_in_full_interpreted(interpreter):
    interpreter.run("check_repeated_backwards_match_full")


@pytest.mark.gpu
@needs_gpu
def test_gpu_repeated_backwards_give_what_a_backward_worked_out_in_full_gives():
    """check_repeated_backwards_match_full on the GPU at the latency shape and a GQA causal one (the
    FlashAttention-2 kernels: a deterministic backward)."""
    check_repeated_backwards_match_full("cuda", ((1, 16, 16, 128, False), (2, 8, 2, 300, True)), dim=64)


@pytest.mark.gpu
@needs_gpu
@needs_sm90
def test_gpu_repeated_gluon_backwards_match_the_reference(monkeypatch):
    """A plain signature's backward that the Gluon kernel runs as shipped (GQA causal at d = 64, 300 keys; d = 128,
    256 keys), repeated with new tensors at each call: the first call works it out in full (hopper_launch.backward),
    the others launch what it prepared (backend._RepeatedHopperBackward), and every call's output and gradients, with
    outputs poisoned, pass CONFORMANCE.md's rule against the float64 reference."""
    from mhattn.backends.triton import backend as triton_backend
    from mhattn.backends.triton import hopper_launch

    worked_out = []
    real_backward = hopper_launch.backward
    monkeypatch.setattr(hopper_launch, "backward", lambda *args: worked_out.append(1) or real_backward(*args))
    monkeypatch.delenv(hopper_launch.ENV_SWITCH, raising=False)
    backend = triton_backend.TritonBackend(deterministic=False)
    gen = torch.Generator().manual_seed(5)
    for batch, heads_q, heads_kv, seqlen, dim, causal in ((2, 8, 2, 300, 64, True), (2, 4, 4, 256, 128, False)):
        assert seqlen >= hopper_launch.BACKWARD_MIN_KEYS[dim]
        params = AttentionParams(scale=dim ** -0.5, window_right=0 if causal else None)
        worked_out.clear()
        for step in range(3):
            q, k, v = (torch.randn(batch, heads, seqlen, dim, generator=gen).to("cuda", torch.bfloat16)
                       for heads in (heads_q, heads_kv, heads_kv))
            grad_out = torch.randn(batch, heads_q, seqlen, dim, generator=gen).to("cuda", torch.bfloat16)
            with poisoned_allocations():
                out, lse = backend.forward(q, k, v, params)
                dq, dk, dv, _ = backend.backward(grad_out, q, k, v, out, lse, params)
            repeats = list(triton_backend._signature_for(q, k, v, params, dense=True).repeated_backwards.values())
            assert len(repeats) == 1 and isinstance(repeats[0], triton_backend._RepeatedHopperBackward), repeats
            failed = failures_against_reference(q, k, v, params, grad_out, (out, lse, dq, dk, dv))
            assert not failed, f"d = {dim}, step {step}: " + "; ".join(failed)
        assert worked_out == [1], "the repeated calls did not launch the first call's prepared backward"


def check_output_only_forward_matches_forward(device="cpu", shapes=((1, 4, 4, 40, False), (2, 4, 2, 48, True)), dim=16,
                                              dtype=torch.float16):
    """mhattn.attention on the Triton backend for calls that need no gradient and return no lse (the backend's
    native_call: its output alone, the lse written into a kept scratch buffer) gives bitwise the output of the
    backend's forward, at first and repeated calls, with outputs poisoned; a call that returns its lse gets one of
    its own, equal to the forward's; and so does a decoding step. shapes: (B, Hq, Hkv, N, causal)."""
    import mhattn
    from mhattn.backends.triton import backend as triton_backend

    backend = triton_backend.TritonBackend()
    gen = torch.Generator(device=device).manual_seed(11)
    with _pinned_config(device):
        for batch, heads_q, heads_kv, seqlen, causal in shapes:
            params = AttentionParams(scale=dim ** -0.5, window_right=0 if causal else None)
            for step in range(3):
                q, k, v = (torch.randn(batch, heads, seqlen, dim, device=device, dtype=dtype, generator=gen)
                           for heads in (heads_q, heads_kv, heads_kv))
                with poisoned_allocations():
                    want, want_lse = backend.forward(q, k, v, params)
                    got = mhattn.attention(q, k, v, is_causal=causal, enable_gqa=heads_q != heads_kv,
                                           backend="triton")
                    got_out, got_lse = mhattn.attention(q, k, v, is_causal=causal, enable_gqa=heads_q != heads_kv,
                                                        backend="triton", return_lse=True)
                plan = triton_backend._signature_for(q, k, v, params, dense=True).plan
                assert plan.lse_scratch is not None, "the output-only path did not run"
                assert torch.equal(got, want), f"output differs (N {seqlen}, step {step})"
                assert torch.equal(got_out, want) and torch.equal(got_lse, want_lse)
                assert got_lse.data_ptr() != plan.lse_scratch.data_ptr()
        # A decoding step (one query row, GQA: the split-KV kernels and their combine).
        params = AttentionParams(scale=dim ** -0.5)
        q = torch.randn(1, 8, 1, dim, device=device, dtype=dtype, generator=gen)
        k, v = (torch.randn(1, 2, 700, dim, device=device, dtype=dtype, generator=gen) for _ in range(2))
        assert triton_backend._signature_for(q, k, v, params, dense=True).decode
        with poisoned_allocations():
            want, _ = backend.forward(q, k, v, params)
            got = mhattn.attention(q, k, v, enable_gqa=True, backend="triton")
        assert triton_backend._signature_for(q, k, v, params, dense=True).plan.lse_scratch is not None
        assert torch.equal(got, want), "decoding step differs"


def test_output_only_forward_matches_forward_interpreted(interpreter):
    interpreter.run("check_output_only_forward_matches_forward")


@pytest.mark.gpu
@needs_gpu
def test_gpu_output_only_forward_matches_forward():
    """check_output_only_forward_matches_forward on the GPU: the latency shape (FlashAttention-2 forward) and, on
    sm_90, a causal GQA one the Gluon forward takes."""
    check_output_only_forward_matches_forward("cuda", ((1, 16, 16, 128, False), (2, 8, 2, 1024, True)), dim=64,
                                              dtype=torch.bfloat16)


def test_explain_names_the_kernel_families(monkeypatch):
    """explain's decision says which Triton forward and backward run and why the Gluon Hopper kernels do not, from
    the problem alone (device capability, dtype, head dims, features, key count, determinism); the split-KV kernels
    for decoding."""
    from dataclasses import replace

    from mhattn.backends.triton import hopper_launch
    from mhattn.backends.triton.backend import TritonBackend
    from mhattn.problem import Problem

    def problem(cc=(9, 0), dtype=torch.bfloat16, head_dim=128, seqlen_q=4096, seqlen_k=4096, features=()):
        return Problem(device_type="cuda", device_index=0, compute_capability=cc, dtype=dtype, batch=2, heads_q=8,
                       heads_kv=8, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim, head_dim_v=head_dim,
                       features=frozenset(features))

    monkeypatch.setattr(hopper_launch, "gluon_available", lambda: True)
    backend = TritonBackend()
    assert "Gluon Hopper forward (hopper_forward.py)" in backend.forward_path(problem(features=("causal",)))
    for kwargs, reason in ((dict(seqlen_q=256, seqlen_k=256), "256 keys < 384"), (dict(cc=(8, 0)), "not an sm_90"),
                           (dict(dtype=torch.float32), "fp16/bf16 only"), (dict(head_dim=80), "head dims 80/80"),
                           (dict(features=("float_mask",)), "a float mask")):
        path = backend.forward_path(problem(**kwargs))
        assert path.startswith("the FlashAttention-2 forward") and reason in path, (kwargs, path)
    assert "split-KV" in backend.forward_path(problem(seqlen_q=1))
    # Head dims 96 and 192: the Gluon kernels (in the 128- and 256-wide tiles).
    for head_dim in (96, 192):
        assert backend.forward_path(problem(head_dim=head_dim)).startswith("the Gluon Hopper")
        assert backend.backward_path(problem(head_dim=head_dim, features=("causal",))).startswith("the Gluon Hopper")
    # A sliding window: the Gluon kernels, where its right bound is the causal diagonal or none.
    for path in (backend.forward_path(problem(features=("causal", "window"))),
                 backend.backward_path(problem(features=("window",)))):
        assert path.startswith("the Gluon Hopper") and "right bound is the causal diagonal or none" in path, path
    # Dropout: the Gluon kernels, with the shared RNG (the forward at d = 64: the FlashAttention-2 kernel).
    for path in (backend.forward_path(problem(features=("dropout",))),
                 backend.backward_path(problem(features=("causal", "dropout"))),
                 backend.backward_path(problem(head_dim=64, features=("dropout",)))):
        assert path.startswith("the Gluon Hopper"), path
    assert hopper_launch.DROPOUT_FORWARD in backend.forward_path(problem(head_dim=64, features=("dropout",)))
    # A softcap: the Gluon kernels at the head dims of FORWARD_SOFTCAP_HEAD_DIMS / BACKWARD_SOFTCAP_HEAD_DIMS.
    monkeypatch.setattr(hopper_launch, "FORWARD_SOFTCAP_HEAD_DIMS", (128, 256))
    monkeypatch.setattr(hopper_launch, "BACKWARD_SOFTCAP_HEAD_DIMS", (256,))
    assert backend.forward_path(problem(features=("causal", "softcap"))).startswith("the Gluon Hopper")
    assert backend.backward_path(problem(head_dim=256, features=("softcap",))).startswith("the Gluon Hopper")
    for path in (backend.forward_path(problem(head_dim=64, features=("softcap",))),
                 backend.backward_path(problem(features=("causal", "softcap")))):
        assert not path.startswith("the Gluon Hopper") and hopper_launch.SOFTCAP in path, path
    # A boolean mask: the Gluon kernels where it is one run of keys per sequence (right or left padding).
    for path in (backend.forward_path(problem(features=("bool_mask",))),
                 backend.backward_path(problem(features=("causal", "bool_mask")))):
        assert path.startswith("the Gluon Hopper"), path
        assert "one run of keys per sequence (right or left padding" in path, path
    # d = 64: the Gluon forward from 384 keys, causal or not.
    for features in ((), ("causal",)):
        assert "Gluon Hopper forward" in backend.forward_path(problem(head_dim=64, seqlen_q=384, seqlen_k=384,
                                                                      features=features))
        assert "383 keys < 384" in backend.forward_path(problem(head_dim=64, seqlen_q=383, seqlen_k=383,
                                                                features=features))
    # d = 128: from 128 keys where the query tiles (128 rows of a head) are at least as many as the SMs.
    monkeypatch.setattr(hopper_launch.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hopper_launch, "_sm_count", lambda device_index: 132)
    full = replace(problem(seqlen_q=256, seqlen_k=256), batch=9)  # 9 x 8 heads x 2 tiles = 144 tiles
    assert "Gluon Hopper forward" in backend.forward_path(full)
    assert "127 keys < 128" in backend.forward_path(replace(full, seqlen_q=127, seqlen_k=127, batch=17))
    assert "256 keys < 384" in backend.forward_path(replace(full, batch=8))  # 128 tiles
    assert "256 keys < 384" in backend.forward_path(replace(full, head_dim=64, head_dim_v=64))  # d = 64: from 384
    assert "Gluon Hopper backward" in backend.backward_path(replace(full, batch=1))  # the backward: from 128 keys
    monkeypatch.undo()
    monkeypatch.setattr(hopper_launch, "gluon_available", lambda: True)
    assert "Gluon Hopper backward (hopper_backward.py)" in backend.backward_path(problem(features=("causal",)))
    assert "Gluon Hopper backward" in backend.backward_path(problem(head_dim=64, seqlen_k=192))
    assert "191 keys < 192" in backend.backward_path(problem(head_dim=64, seqlen_k=191))
    for kwargs, reason in ((dict(head_dim=80), "head dims 80/80"), (dict(seqlen_k=100), "100 keys < 128"),
                           (dict(features=("float_mask",)), "a float mask")):
        path = backend.backward_path(problem(**kwargs))
        assert path.startswith("the FlashAttention-2 backward") and reason in path, (kwargs, path)
    deterministic = TritonBackend(deterministic=True).backward_path(problem())
    assert deterministic.startswith("the Gluon Hopper backward") and "fixed order (deterministic)" in deterministic
    # (its own key thresholds: at d = 64 with a causal mask from 16k keys)
    assert "4096 keys < 16384" in TritonBackend(deterministic=True).backward_path(problem(head_dim=64,
                                                                                          features=("causal",)))

    from mhattn.dispatch import Decision

    shown = str(Decision(problem=replace(problem(), needs_grad=True), requested="triton", source="argument",
                         chosen="triton"))
    assert "  forward: the Gluon Hopper forward" in shown and "  backward: the Gluon Hopper backward" in shown, shown
    assert "backward:" not in str(Decision(problem=problem(), requested="triton", source="argument", chosen="triton"))
    monkeypatch.setattr(hopper_launch, "MIN_KEYS", dict.fromkeys(hopper_launch.KEY_BLOCK, 1))  # read at each call
    assert "Gluon Hopper forward" in backend.forward_path(problem(seqlen_q=1024, seqlen_k=1024))
    monkeypatch.undo()
    monkeypatch.setattr(hopper_launch, "gluon_available", lambda: True)
    monkeypatch.setenv(hopper_launch.ENV_SWITCH, "always")  # any key count (a conformance run's small shapes)
    small = problem(seqlen_q=100, seqlen_k=100, head_dim=64)
    assert "Gluon Hopper forward" in backend.forward_path(small) and "Gluon Hopper backward" in backend.backward_path(small)
    monkeypatch.setenv(hopper_launch.ENV_SWITCH, "0")
    assert f"{hopper_launch.ENV_SWITCH}=0" in backend.forward_path(problem())
    assert f"{hopper_launch.ENV_SWITCH}=0" in backend.backward_path(problem())


def test_gluon_forward_half_width_diagonal_up_to_its_key_count(monkeypatch):
    """hopper_launch.compile_time_args builds the half-width diagonal block (HALF_DIAGONAL) only for causal calls at
    a head dim FORWARD_HALF_DIAGONAL_MAX_KEYS names, up to that many keys; None keys (the longest) and every other
    call get the full-width kernel."""
    from mhattn.backends.triton import hopper_launch

    monkeypatch.setattr(hopper_launch, "FORWARD_HALF_DIAGONAL_MAX_KEYS", {64: 4096})
    half = lambda d, causal, keys: hopper_launch.compile_time_args(d, causal, True, keys)["HALF_DIAGONAL"]  # noqa: E731
    assert half(64, True, 1024) and half(64, True, 4096)
    assert not half(64, True, 4097) and not half(64, True, None)
    assert not half(64, False, 1024) and not half(128, True, 1024) and not half(256, True, 1024)
    assert hopper_launch.compile_time_args(64, True)["HALF_DIAGONAL"] is False


def test_gluon_forward_rotating_q_slots_up_to_their_key_count(monkeypatch):
    """hopper_launch.compile_time_args builds three rotating Q slots (Q_ROTATING) only where the forward has one Q
    buffer and a head dim FORWARD_Q_ROTATING_MAX_KEYS names, up to that many keys, causal or not; None keys (the
    longest) and the two-buffer head dims get the two fixed slots."""
    from mhattn.backends.triton import hopper_launch

    monkeypatch.setattr(hopper_launch, "FORWARD_Q_ROTATING_MAX_KEYS", {256: 2048, 128: 1 << 20})
    rotating = lambda d, causal, keys: hopper_launch.compile_time_args(d, causal, causal, keys)["Q_ROTATING"]  # noqa: E731
    assert rotating(256, False, 1024) and rotating(256, True, 2048)
    assert not rotating(256, False, 2049) and not rotating(256, True, None)
    assert not rotating(128, False, 1024)  # two Q buffers there: nothing to rotate
    assert not rotating(64, True, 1024)


def test_gluon_forward_schedule(monkeypatch):
    """hopper_launch.forward_schedule: one program per SM (at most one per tile) without a causal mask up to
    PERSISTENT_MAX_KEYS keys, with one up to CAUSAL_PERSISTENT_MAX_KEYS (then tiles from a counter), one program per
    tile otherwise or when asked; causal tiles in groups of heads whose K/V take CAUSAL_GROUP_BYTES (at least one
    head, at most all)."""
    from mhattn.backends.triton import hopper_launch

    limit = hopper_launch.PERSISTENT_MAX_KEYS
    head = hopper_launch.forward_head_bytes(1024, 128, 2, 1)  # K and V of 1k keys at d = 128 in bf16: 512 KiB
    assert head == 512 << 10 and hopper_launch.forward_head_bytes(1024, 128, 2, 4) == 128 << 10
    groups = hopper_launch.CAUSAL_GROUP_BYTES // head
    assert hopper_launch.forward_schedule(16, 16, 1024, limit, False, head, 132) == (132, 8, 2048, 1, False)
    assert hopper_launch.forward_schedule(16, 16, 1024, 1024, True, head, 132)[:4] == (132, 8, 2048, groups)
    assert hopper_launch.forward_schedule(16, 16, 1024, 1024, True, head, 132, persistent=False) == (
        2048, 8, 2048, groups, False)
    assert hopper_launch.forward_schedule(1, 2, 1024, limit, True, head, 132)[3] == 2             # all the heads
    assert hopper_launch.forward_schedule(1, 2, 1024, limit, True, 1 << 40, 132)[3] == 1          # one head
    assert hopper_launch.forward_schedule(1, 16, 1024, 2 * limit, False, head, 132) == (128, 8, 128, 1, False)
    assert hopper_launch.forward_schedule(1, 1, 300, 300, False, head, 132) == (3, 3, 3, 1, False)
    assert hopper_launch.forward_schedule(16, 16, 1024, 1024, False, head, 132, persistent=False)[0] == 2048
    causal = hopper_launch.forward_schedule(16, 16, 1024, 1024, True, head, 132, persistent=True)
    assert causal.programs == 132 and causal.tile_counter                       # causal tiles from the counter
    assert not hopper_launch.forward_schedule(16, 16, 1024, 1024, False, head, 132, persistent=True).tile_counter
    monkeypatch.setattr(hopper_launch, "CAUSAL_PERSISTENT_MAX_KEYS", 512)
    assert hopper_launch.forward_schedule(16, 16, 512, 512, True, head, 132).programs == 132      # up to the limit
    assert hopper_launch.forward_schedule(16, 16, 1024, 1024, True, head, 132).programs == 2048   # above it
    # Fewer tiles than SMs: one program each, no counter.
    assert not hopper_launch.forward_schedule(1, 1, 256, 256, True, head, 132, persistent=True).tile_counter
