"""The call path: saved tensors, the backend request under torch.compile, dropout seeds, cache keys, layouts,
and the inputs SDPA accepts (empty sizes, broadcast batch dims, 0-dim arguments, meta tensors)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import mhattn
from mhattn import dispatch, dropout_rng
from mhattn.backends import layouts
from mhattn.dropout_rng import keep_mask
from mhattn.reference import ReferenceBackend
from mhattn.reference.naive import naive_attention

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("MHATTN_BACKEND", raising=False)
    yield
    dispatch.clear_cache()


def rand(*shape, dtype=torch.float32, requires_grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


# ---- saved tensors -------------------------------------------------------------------------------------------


def test_float_mask_changed_in_place_after_forward_raises_at_backward():
    q = rand(1, 2, 6, 8, requires_grad=True)
    k, v = rand(1, 2, 7, 8), rand(1, 2, 7, 8)
    mask = torch.randn(6, 7)
    out = mhattn.attention(q, k, v, attn_mask=mask)
    mask.add_(1.0)  # the backward would read the new values: autograd must refuse, as for SDPA
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_no_grad_inputs_skip_autograd():
    q, k, v = rand(1, 2, 6, 8), rand(1, 2, 6, 8), rand(1, 2, 6, 8)
    assert mhattn.attention(q, k, v).grad_fn is None
    qg = q.clone().requires_grad_(True)
    assert mhattn.attention(qg, k, v).grad_fn is not None
    with torch.no_grad():
        assert mhattn.attention(qg, k, v).grad_fn is None


# ---- the backend request under torch.compile ---------------------------------------------------------------


def test_compiled_code_honours_the_request_made_after_the_first_trace(recorders, monkeypatch):
    a, b = recorders
    q, k, v = rand(1, 2, 5, 8), rand(1, 2, 5, 8), rand(1, 2, 5, 8)
    compiled = torch.compile(lambda x, y, z: mhattn.attention(x, y, z), fullgraph=True, backend="aot_eager")
    with mhattn.use_backend("rec_a"):
        compiled(q, k, v)
    with mhattn.use_backend("rec_b"):
        compiled(q, k, v)
    assert a.calls == ["forward"] and b.calls == ["forward"]
    monkeypatch.setenv("MHATTN_BACKEND", "rec_b")
    compiled(q, k, v)
    assert a.calls == ["forward"] and b.calls == ["forward", "forward"]


def test_compiled_backward_runs_on_the_forwards_backend(recorders):
    a, b = recorders
    q = rand(1, 2, 5, 8, requires_grad=True)
    k, v = rand(1, 2, 5, 8), rand(1, 2, 5, 8)
    compiled = torch.compile(lambda x, y, z: mhattn.attention(x, y, z).sum(), fullgraph=True, backend="aot_eager")
    with mhattn.use_backend("rec_a"):
        loss = compiled(q, k, v)
    with mhattn.use_backend("rec_b"):  # the request in force at the backward does not matter
        loss.backward()
    assert a.calls == ["forward", "backward"] and b.calls == []
    want = q.detach().clone().requires_grad_(True)
    F.scaled_dot_product_attention(want, k, v).sum().backward()
    assert (q.grad - want.grad).abs().max() <= 1e-5


# ---- dropout seeds -------------------------------------------------------------------------------------------


def test_dropout_seed_is_a_tensor_drawn_on_the_inputs_device(recorders):
    a, _ = recorders
    q, k, v = rand(1, 2, 9, 8), rand(1, 2, 13, 8), rand(1, 2, 13, 8)
    torch.manual_seed(7)
    out = mhattn.attention(q, k, v, dropout_p=0.3, backend="rec_a")
    seed = a.seeds[-1]
    # On the device, from its generator: kernels read it from memory, so captured graphs draw fresh words.
    assert isinstance(seed, torch.Tensor) and seed.device == q.device and seed.shape == (2,)
    torch.manual_seed(7)
    want_seed = torch.randint(0, 2**32, (2,), dtype=torch.int64, device=q.device)
    assert torch.equal(seed, want_seed)
    keep = keep_mask(dropout_rng.seed_words(seed), 1, 2, 9, 13, 0.3)
    params = mhattn.AttentionParams(scale=8**-0.5, dropout_p=0.3, seed=dropout_rng.seed_words(seed))
    want, _ = naive_attention(q, k, v, params, keep=keep)
    assert (out - want).abs().max() <= 1e-6


def test_a_tensor_seed_and_its_words_draw_the_same_mask():
    words = (0xDEADBEEF, 12345)
    as_tensor = torch.tensor(words, dtype=torch.int64)
    assert torch.equal(keep_mask(words, 2, 3, 17, 33, 0.4), keep_mask(as_tensor, 2, 3, 17, 33, 0.4))
    assert dropout_rng.seed_words(as_tensor) == words
    assert torch.equal(dropout_rng.seed_tensor(words, torch.device("cpu")), as_tensor)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cupy", "reference"])
def test_gpu_dropout_seed_follows_the_cuda_generator_and_graph_replays_draw_fresh_masks(backend):
    if mhattn.get_backend(backend).unavailable():
        pytest.skip(f"{backend} unavailable")
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    torch.cuda.manual_seed(3)
    first = mhattn.attention(q, k, v, dropout_p=0.3, backend=backend)
    torch.cuda.manual_seed(3)
    assert torch.equal(first, mhattn.attention(q, k, v, dropout_p=0.3, backend=backend))
    # Every backend draws the same keep-mask for the same seed.
    torch.cuda.manual_seed(3)
    assert (first - mhattn.attention(q, k, v, dropout_p=0.3, backend="reference")).abs().max() <= 2e-2

    static_out = torch.empty_like(first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compilation, caches) outside the capture
        for _ in range(2):
            mhattn.attention(q, k, v, dropout_p=0.3, backend=backend)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out.copy_(mhattn.attention(q, k, v, dropout_p=0.3, backend=backend))
    graph.replay()
    one = static_out.clone()
    graph.replay()
    assert not torch.equal(one, static_out)  # fresh seed words at each replay


# ---- cache keys ---------------------------------------------------------------------------------------------


def test_decision_cache_key_holds_the_request_source_and_explain_is_current(recorders, monkeypatch):
    q = rand(1, 2, 5, 8)
    monkeypatch.setenv("MHATTN_BACKEND", "rec_a")
    mhattn.attention(q, q, q)
    monkeypatch.delenv("MHATTN_BACKEND")
    with mhattn.use_backend("rec_a"):
        mhattn.attention(q, q, q)
        assert mhattn.explain(q, q, q).source == "use_backend()"
    sources = {key[1] for key in dispatch._cache}
    assert {"MHATTN_BACKEND=rec_a", "use_backend()"} <= sources
    for key in dispatch._cache:
        assert all(isinstance(part, (str, int, bool, type(None), torch.dtype)) for part in key), key


def test_decision_cache_evicts_the_oldest_entries_not_all(monkeypatch):
    monkeypatch.setattr(dispatch, "_CACHE_LIMIT", 4)
    dispatch.clear_cache()
    for n in (1, 2, 4, 8, 16, 32):  # six size buckets
        t = rand(1, 1, n, 8)
        mhattn.attention(t, t, t)
    assert len(dispatch._cache) == 4
    kept_buckets = sorted(key[-1] for key in dispatch._cache)
    assert kept_buckets == [4, 8, 16, 32]


def test_bucketed_decision_respects_a_limit_inside_the_bucket(recorders):
    a, _ = recorders

    class Capped(ReferenceBackend):
        name = "capped"

        def unsupported(self, problem):
            return ["longer than 6"] if problem.seqlen_q > 6 else []

    mhattn.register_backend(Capped())
    try:
        small, large = rand(1, 1, 5, 8), rand(1, 1, 7, 8)  # one bucket (5..8), the limit between them
        mhattn.attention(small, small, small, backend="capped")
        with pytest.raises(mhattn.BackendUnavailableError, match="longer than 6"):
            mhattn.attention(large, large, large, backend="capped")
    finally:
        mhattn.unregister_backend("capped")


def test_triton_tile_shrink_cache_is_keyed_by_device_and_flags():
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from mhattn.backends.triton import backend as tb
    from mhattn.backends.triton import configs

    q, k, v = rand(1, 2, 64, 32), rand(1, 2, 64, 32), rand(1, 2, 64, 32)
    plain = tb._Launch(q, k, v, mhattn.AttentionParams(scale=0.2)).plan
    dropout = tb._Launch(q, k, v, mhattn.AttentionParams(scale=0.2, dropout_p=0.1, seed=(1, 2))).plan
    assert plain.shrink_key != dropout.shrink_key
    assert "cpu" in plain.shrink_key and torch.float32 in plain.shrink_key  # device and dtype take part
    tile = configs.KernelConfig(64, 64, 4, 2)
    tried = []

    def too_big(t):
        tried.append(t)
        if t == tile:
            raise OutOfResources(1 << 20, 1 << 16, "shared memory")

    tb._shrunk.clear()
    tb._run("forward", tile, dropout.shrink_key, too_big)
    assert tried[-1] != tile
    tried.clear()
    tb._run("forward", tile, plain.shrink_key, tried.append)  # another kernel keeps its tile
    assert tried == [tile]
    tb._shrunk.clear()


def test_cupy_argument_template_splices_each_calls_pointers_into_values_converted_once():
    import numpy as np

    from mhattn.backends.cupy.launcher import ArgumentTemplate, f32, i32, i64, numpy_value, slot, u32

    template = ArgumentTemplate([slot(1), i32(-1), u32(-1), slot(0), i64(1 << 40), f32(-0.0), ("ptr", 7), slot(1)])
    splice = template.splicer(numpy_value)
    first, second = splice((10, 20)), splice((30, 40))
    assert [type(x) for x in first] == [int, np.int32, np.uint32, int, np.int64, np.float32, np.uint64, int]
    assert [first[i] for i in (0, 3, 7)] == [20, 10, 20] and [second[i] for i in (0, 3, 7)] == [40, 30, 40]
    assert [int(x) for x in first[1:3]] == [-1, 0xFFFFFFFF] and int(first[4]) == 1 << 40 and int(first[6]) == 7
    assert np.signbit(first[5])  # -0.0 stays -0.0
    assert all(a is b for a, b in zip(first[1:7], second[1:7]) if not isinstance(a, int))  # converted once
    assert template.bind((10, 20)) == [("ptr", 20), ("i32", -1), ("u32", 0xFFFFFFFF), ("ptr", 10),
                                       ("i64", 1 << 40), ("f32", -0.0), ("ptr", 7), ("ptr", 20)]
    with pytest.raises(IndexError):  # too few pointers fail instead of shifting the constants
        splice((10,))
    assert ArgumentTemplate([slot(0)]).splicer(numpy_value)((5,)) == (5,)  # one argument: still a tuple
    with pytest.raises(ValueError, match="unknown kinds"):
        ArgumentTemplate([("i16", 3)])


# ---- repeated calls -----------------------------------------------------------------------------------------


def test_a_repeated_call_skips_the_checks_and_the_decision_but_follows_the_request(recorders, monkeypatch):
    from mhattn import functional

    a, b = recorders
    prepared = []
    real_prepare = functional._prepare
    monkeypatch.setattr(functional, "_prepare", lambda *args: prepared.append(1) or real_prepare(*args))
    q, k, v = rand(2, 3, 6, 8), rand(2, 3, 7, 8), rand(2, 3, 7, 8)
    first = mhattn.attention(q, k, v, is_causal=True, backend="rec_a")
    again = mhattn.attention(q, k, v, is_causal=True, backend="rec_a")
    assert len(prepared) == 1 and a.calls == ["forward", "forward"] and torch.equal(first, again)
    with mhattn.use_backend("rec_b"):  # the request is part of the key
        mhattn.attention(q, k, v, is_causal=True)
        mhattn.attention(q, k, v, is_causal=True)
    assert b.calls == ["forward", "forward"] and len(prepared) == 2
    with pytest.raises(mhattn.InputError, match="dropout_p"):  # equal to 0.0, but not a float: checked again
        mhattn.attention(q, k, v, dropout_p=False, is_causal=True, backend="rec_a")
    strided = torch.randn(2, 3, 6, 16)[..., ::2]  # a last dim that is not contiguous: copied at every call
    want = F.scaled_dot_product_attention(strided, k, v)
    for _ in range(2):
        assert (mhattn.attention(strided, k, v, backend="rec_a") - want).abs().max() <= 1e-6
    broadcast = rand(1, 3, 7, 8)  # leading dims broadcast: every call takes the full path
    shapes = []
    real_forward = a.forward
    monkeypatch.setattr(a, "forward", lambda q, k, v, params: shapes.append(k.shape) or real_forward(q, k, v, params))
    for _ in range(2):
        out = mhattn.attention(q, broadcast, broadcast, backend="rec_a")
        assert (out - F.scaled_dot_product_attention(q, broadcast, broadcast)).abs().max() <= 1e-6
    assert shapes == [(2, 3, 7, 8)] * 2  # the backend sees the broadcast batch
    assert functional._known_calls
    mhattn.unregister_backend("rec_b")  # a registry change drops the remembered decisions
    mhattn.register_backend(b)
    assert not functional._known_calls


# ---- layouts: what backends write is what the fake implementations promise -------------------------------------


class _NoLaunch:
    def launch(self, *args, **kwargs):
        pass


def _packed_qkv(batch=2, seqlen=64, heads=2, dim=64, dtype=torch.float32):
    qkv = torch.randn(batch, seqlen, 3, heads, dim, dtype=dtype)
    return [qkv[:, :, i].transpose(1, 2) for i in range(3)]  # non-dense (B, H, N, D) views


def test_cupy_writes_the_layouts_the_fake_promises():
    from mhattn.backends.cupy import CupyBackend

    backend = CupyBackend(launcher=_NoLaunch(), compute_capability=(9, 0))
    q, k, v = _packed_qkv(dtype=torch.bfloat16)
    params = mhattn.AttentionParams(scale=0.125)
    out, lse = backend.forward(q, k, v, params)
    assert out.stride() == layouts.output_buffer(q, v).stride()
    assert lse.stride() == layouts.lse_buffer(q).stride()
    dq, dk, dv, _ = backend.backward(torch.randn_like(out), q, k, v, out, lse, params)
    for grad, t in ((dq, q), (dk, k), (dv, v)):
        assert grad.stride() == layouts.grad_strides(t)


def test_reference_writes_the_layouts_the_fake_promises():
    q, k, v = _packed_qkv()
    params = mhattn.AttentionParams(scale=0.125)
    out, lse = ReferenceBackend().forward(q, k, v, params)
    assert out.stride() == layouts.output_buffer(q, v).stride()
    dq, dk, dv, _ = ReferenceBackend().backward(torch.randn_like(out), q, k, v, out, lse, params)
    for grad, t in ((dq, q), (dk, k), (dv, v)):
        assert grad.stride() == layouts.grad_strides(t)


def test_compiled_and_eager_calls_return_the_same_strides_without_copies(monkeypatch):
    q, k, v = (t.detach().requires_grad_(True) for t in _packed_qkv(seqlen=9, dim=8))
    copies = []
    original = layouts.placed

    def counting(t, strides):
        placed = original(t, strides)
        if placed is not t:
            copies.append(tuple(t.shape))
        return placed

    monkeypatch.setattr(layouts, "placed", counting)
    eager = mhattn.attention(q, k, v, is_causal=True)
    eager_grads = torch.autograd.grad(eager.square().sum(), (q, k, v))
    compiled_fn = torch.compile(lambda a, b, c: mhattn.attention(a, b, c, is_causal=True), fullgraph=True,
                                backend="aot_eager")
    compiled = compiled_fn(q, k, v)
    compiled_grads = torch.autograd.grad(compiled.square().sum(), (q, k, v))
    assert compiled.stride() == eager.stride()
    for a, b in zip(compiled_grads, eager_grads):
        assert a.stride() == b.stride()
        assert (a - b).abs().max() <= 1e-6
    assert copies == []


# ---- inputs SDPA accepts -------------------------------------------------------------------------------------


def _both(q, k, v, **kwargs):
    """mhattn's and SDPA's outputs and input gradients (float64)."""
    results = []
    for fn in (mhattn.attention, F.scaled_dot_product_attention):
        inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*inputs, **kwargs)
        grads = torch.autograd.grad(out.sum(), inputs, allow_unused=True, materialize_grads=True)
        results.append((out, grads))
    return results


@pytest.mark.parametrize("shapes", [
    ((2, 3, 4, 8), (2, 3, 0, 8), (2, 3, 0, 5)),  # no key: zeros
    ((2, 0, 4, 8), (2, 0, 5, 8), (2, 0, 5, 6)),  # no head
    ((2, 3, 0, 8), (2, 3, 5, 8), (2, 3, 5, 6)),  # no query
    ((0, 3, 4, 8), (0, 3, 5, 8), (0, 3, 5, 6)),  # no batch
    ((2, 3, 4, 0), (2, 3, 5, 0), (2, 3, 5, 6)),  # D = 0: uniform weights
    ((2, 3, 4, 8), (1, 3, 5, 8), (1, 3, 5, 6)),  # key/value batch broadcast
    ((2, 3, 4, 8), (3, 5, 8), (3, 5, 6)),        # key/value with fewer leading dims
    ((1, 3, 4, 8), (2, 3, 5, 8), (2, 3, 5, 6)),  # query batch broadcast
])
def test_inputs_sdpa_accepts_give_sdpas_result(shapes):
    q, k, v = (torch.randn(*s, dtype=torch.float64) for s in shapes)
    (out, grads), (want, want_grads) = _both(q, k, v)
    assert out.shape == want.shape
    assert (out - want).abs().max().item() <= 1e-10 if out.numel() else True
    for g, w in zip(grads, want_grads):
        assert g.shape == w.shape
        if w.numel():
            assert (g - w).abs().max() <= 1e-10


def test_dropout_one_gives_zeros_and_bounds_are_checked():
    q, k, v = (rand(2, 3, 4, 8, requires_grad=True) for _ in range(3))
    out = mhattn.attention(q, k, v, dropout_p=1.0)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(mhattn.InputError, match="dropout_p"):
            mhattn.attention(q, k, v, dropout_p=bad)


def test_zero_dim_tensors_as_dropout_p_and_scale():
    q, k, v = rand(2, 3, 4, 8), rand(2, 3, 5, 8), rand(2, 3, 5, 8)
    out = mhattn.attention(q, k, v, dropout_p=torch.tensor(0.0), scale=torch.tensor(0.3))
    assert (out - F.scaled_dot_product_attention(q, k, v, scale=0.3)).abs().max() <= 1e-6


def test_meta_tensors_give_shapes_and_the_compiled_layout():
    q, k, v = (torch.empty(2, 3, 4, 8, device="meta"), torch.empty(2, 3, 5, 8, device="meta"),
               torch.empty(2, 3, 5, 6, device="meta"))
    out = mhattn.attention(q, k, v, is_causal=True)
    assert out.device.type == "meta" and out.shape == (2, 3, 4, 6)
    out, lse = mhattn.attention(q.requires_grad_(True), k, v, dropout_p=0.2, return_lse=True)
    assert out.shape == (2, 3, 4, 6) and lse.shape == (2, 3, 4)
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert dq.shape == q.shape and dq.device.type == "meta"


# ---- the module and the CLI ----------------------------------------------------------------------------------


def test_module_scripts_with_torchscript():
    module = mhattn.MultiheadAttention(8, 2).eval()
    scripted = torch.jit.script(module)
    x = torch.randn(5, 3, 8)
    want, want_weights = module(x, x, x)
    out, weights = scripted(x, x, x)
    assert (out - want).abs().max() <= 1e-6 and (weights - want_weights).abs().max() <= 1e-6
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
    encoder = mhattn.replace_multihead_attention(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    encoder.eval()
    assert (torch.jit.script(encoder)(x) - encoder(x)).abs().max() <= 1e-5
    assert len(module._forward_pre_hooks) == 1  # scripting leaves the module itself unchanged


def test_module_dropout_bounds_and_all_dropped_as_torch():
    module = mhattn.MultiheadAttention(8, 2, dropout=1.0).train()
    x = torch.randn(5, 3, 8)
    out, weights = module(x, x, x)
    assert torch.equal(weights, torch.zeros_like(weights))
    assert (out - module.out_proj.bias).abs().max() == 0  # torch returns out_proj.bias
    out, _ = module(x, x, x, need_weights=False)
    assert (out - module.out_proj.bias).abs().max() == 0
    module.dropout = 1.5
    with pytest.raises(ValueError, match="between 0 and 1"):
        module(x, x, x)
    module.eval()
    module(x, x, x)  # dropout applies only in training, as in torch


def _mhattn_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mhattn.cli", *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **(env or {})))


@pytest.mark.skipif(HAS_CUDA, reason="checks the report of a machine without a GPU")
def test_info_says_cupy_needs_a_gpu_and_a_bad_backend_is_a_clear_error():
    result = _mhattn_cli("info")
    line = next(line for line in result.stdout.splitlines() if line.strip().startswith("cupy ") and "available" in line)
    assert "unavailable" in line and "GPU" in line
    result = _mhattn_cli("info", env={"MHATTN_BACKEND": "bogus"})
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    assert "bogus" in result.stdout and "valid names" in result.stdout


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
def test_triton_dropout_kernels_read_their_seed_and_compile_for_the_gpu(kind, monkeypatch):
    """The kernels with dropout (seed words loaded from the device) compile for sm_80 without a GPU."""
    pytest.importorskip("triton")
    from mhattn.backends.triton import ahead, configs

    plain = ahead._constexprs
    monkeypatch.setattr(ahead, "_constexprs", lambda task: dict(plain(task), HAS_DROPOUT=True))
    kernel = ahead.compile_kernel(ahead.KernelTask(kind=kind, head_dim=64, causal=True,
                                                   tile=configs.KernelConfig(64, 64, 4, 2)), 80)
    assert ".target sm_80" in kernel.asm["ptx"]
