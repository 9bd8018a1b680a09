"""mhattn.MultiheadAttention against torch.nn.MultiheadAttention, and replace_multihead_attention.

CPU, float32. Each case builds a torch module with torch's initialisation (plus small random biases so
they matter), loads its state_dict into mhattn's, runs both on the same fresh random inputs and
compares outputs, attention weights and the gradients of the inputs and of every parameter: max abs
difference <= 1e-5. The masks keep at least one key visible in every row, except in the test of
fully masked rows (the one intended difference: 0 where torch's weights path gives NaN).
"""

from __future__ import annotations

import copy
import io
import itertools
import warnings

import pytest
import torch

import mhattn
from mhattn.dropout_rng import keep_mask

TOL = 1e-5
EMBED, HEADS, BATCH = 8, 2, 2
KDIM, VDIM = 6, 5


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: one intra-op thread is fastest, and avoids spinning threads on a busy CI box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- building blocks ----------------------------------------------------------------------------------


def make_pair(seed=0, *, embed=EMBED, heads=HEADS, **flags):
    """A torch module with torch's init (biases made random and nonzero) and mhattn's loaded from it."""
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(embed, heads, **flags)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
    ours = mhattn.MultiheadAttention(embed, heads, **flags)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def layout(batched, batch_first, length, features, batch=BATCH):
    if not batched:
        return (length, features)
    return (batch, length, features) if batch_first else (length, batch, features)


def make_inputs(batched, batch_first, tgt_len, src_len, self_attn, kdim=EMBED, vdim=EMBED, embed=EMBED):
    query = torch.randn(layout(batched, batch_first, tgt_len, embed))
    if self_attn:
        return query, query, query
    key = torch.randn(layout(batched, batch_first, src_len, kdim))
    value = torch.randn(layout(batched, batch_first, src_len, vdim))
    return query, key, value


def padding_mask(kind, batched, src_len, batch=BATCH):
    """Key 1 + b % (S - 2) of batch entry b is padding: never the first key (the only one a causal row 0
    sees) nor the last (which attention_mask keeps visible)."""
    if kind is None:
        return None
    pad = torch.zeros(batch, src_len, dtype=torch.bool)
    for b in range(batch):
        pad[b, 1 + b % (src_len - 2)] = True
    if not batched:
        pad = pad[0]
    if kind == "bool":
        return pad
    return torch.where(pad, torch.full(pad.shape, float("-inf")), 0.3 * torch.randn(pad.shape))


def attention_mask(kind, batched, tgt_len, src_len, heads=HEADS, batch=BATCH):
    """kind: None or '2b', '2f', '3b', '3f' (rank, bool/float); the last key stays visible to every row."""
    if kind is None:
        return None
    shape = (tgt_len, src_len) if kind[0] == "2" else ((batch if batched else 1) * heads, tgt_len, src_len)
    blocked = torch.rand(shape) < 0.4
    blocked[..., -1] = False
    if kind[1] == "b":
        return blocked
    return torch.where(blocked, torch.full(shape, float("-inf")), torch.randn(shape))


def causal_mask(kind, tgt_len, src_len):
    """(L, S) causal mask, top-left aligned as torch's is_causal: bool (True = blocked) or float -inf."""
    blocked = torch.ones(tgt_len, src_len, dtype=torch.bool).triu(1)
    if kind == "bool":
        return blocked
    return torch.zeros(tgt_len, src_len).masked_fill(blocked, float("-inf"))


def run(module, inputs, kwargs, seed=1):
    """Forward + backward of a fixed random projection of the outputs; returns (out, weights, grads)."""
    query, key, value = inputs
    module.zero_grad(set_to_none=True)
    q = query.detach().clone().requires_grad_()
    k = q if key is query else key.detach().clone().requires_grad_()
    v = k if value is key else value.detach().clone().requires_grad_()
    out, weights = module(q, k, v, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen)).sum()
    if weights is not None:
        loss = loss + (weights * torch.randn(weights.shape, generator=gen)).sum()
    loss.backward()
    grads = {"query": q.grad, "key": k.grad, "value": v.grad}
    grads.update({name: p.grad for name, p in module.named_parameters()})
    return out, weights, grads


def assert_close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != torch's {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert err <= TOL, f"{what}: max abs difference {err:.3g} > {TOL}"


def compare(ref, ours, inputs, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the mismatched-mask deprecation warning; tested on its own
        out_ref, w_ref, g_ref = run(ref, inputs, kwargs)
        out, w, g = run(ours, inputs, kwargs)
    assert_close(out, out_ref, "output")
    if w_ref is None:
        assert w is None
    else:
        assert_close(w, w_ref, "attention weights")
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        assert (g[name] is None) == (g_ref[name] is None), f"grad of {name}: presence differs"
        if g_ref[name] is not None:
            assert_close(g[name], g_ref[name], f"grad of {name}")
    return out, w


# ---- construction ---------------------------------------------------------------------------------------

MODULE_FLAGS = [
    {},
    {"bias": False},
    {"add_bias_kv": True, "add_zero_attn": True},
    {"kdim": KDIM, "vdim": VDIM, "batch_first": True, "dropout": 0.1},
    {"kdim": KDIM, "vdim": VDIM, "bias": False, "add_bias_kv": True},
]


@pytest.mark.parametrize("flags", MODULE_FLAGS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "default")
def test_same_class_parameters_and_initialisation(flags):
    torch.manual_seed(123)
    ref = torch.nn.MultiheadAttention(EMBED, HEADS, **flags)
    torch.manual_seed(123)
    ours = mhattn.MultiheadAttention(EMBED, HEADS, **flags)
    assert isinstance(ours, torch.nn.MultiheadAttention)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    ref_state, state = ref.state_dict(), ours.state_dict()
    assert list(state) == list(ref_state)
    for name in ref_state:
        assert torch.equal(state[name], ref_state[name]), f"{name} initialised differently"
    # state_dicts move both ways
    ref.load_state_dict(ours.state_dict())
    ours.load_state_dict(ref.state_dict())
    for attr in ("embed_dim", "num_heads", "dropout", "batch_first", "kdim", "vdim", "head_dim", "add_zero_attn",
                 "_qkv_same_embed_dim"):
        assert getattr(ours, attr) == getattr(ref, attr)


# ---- the forward against torch's, over the flags ------------------------------------------------------------


MODULE_CASES = [
    c for c in itertools.product([False, True], [True, False], [True, False], [False, True], [False, True],
                                 [False, True], [True, False])
    if not (c[5] and c[6])  # different kdim/vdim cannot be self-attention
]
MASK_FORMS = list(itertools.product([None, "bool", "float"], [None, "2b", "2f", "3b", "3f"],
                                    [(False, True), (True, True), (True, False)]))


def _module_id(case):
    batch_first, batched, bias, add_bias_kv, add_zero_attn, kv_dims, self_attn = case
    return "-".join([
        "batch_first" if batch_first else "seq_first", "batched" if batched else "unbatched",
        "bias" if bias else "nobias", "bias_kv" if add_bias_kv else "no_bias_kv", "zero_attn" if add_zero_attn else
        "no_zero_attn", "kvdims" if kv_dims else "embed_kv", "self" if self_attn else "cross",
    ])


@pytest.mark.parametrize("case", MODULE_CASES, ids=[_module_id(c) for c in MODULE_CASES])
def test_every_flag_layout_and_mask(case):
    """Every constructor flag x input form, each with every mask form (key padding none/bool/float x
    attn_mask none/2-D/3-D bool/float) and need_weights off / averaged / per head."""
    batch_first, batched, bias, add_bias_kv, add_zero_attn, kv_dims, self_attn = case
    dims = {"kdim": KDIM, "vdim": VDIM} if kv_dims else {}
    ref, ours = make_pair(seed=MODULE_CASES.index(case), bias=bias, add_bias_kv=add_bias_kv,
                          add_zero_attn=add_zero_attn, batch_first=batch_first, **dims)
    tgt_len, src_len = (4, 4) if self_attn else (3, 5)
    inputs = make_inputs(batched, batch_first, tgt_len, src_len, self_attn, kdim=KDIM if kv_dims else EMBED,
                         vdim=VDIM if kv_dims else EMBED)
    for kpm_kind, mask_kind, (need_weights, average) in MASK_FORMS:
        try:
            compare(ref, ours, inputs, key_padding_mask=padding_mask(kpm_kind, batched, src_len),
                    attn_mask=attention_mask(mask_kind, batched, tgt_len, src_len), need_weights=need_weights,
                    average_attn_weights=average)
        except AssertionError as error:
            raise AssertionError(f"key_padding_mask={kpm_kind} attn_mask={mask_kind} need_weights={need_weights} "
                                 f"average_attn_weights={average}: {error}") from None


CAUSAL_MODULES = list(itertools.product([False, True], [True, False], [True, False], [0, 1, 2, 3]))


@pytest.mark.parametrize("case", CAUSAL_MODULES,
                         ids=[f"batch_first={c[0]}-batched={c[1]}-self={c[2]}-extra={c[3]}" for c in CAUSAL_MODULES])
def test_is_causal(case):
    """torch's rule: with need_weights=False and no key_padding_mask, is_causal replaces attn_mask (causal
    top-left, even when the mask given is not causal); otherwise attn_mask is used and the hint ignored.
    extra: 0 none, 1 add_bias_kv, 2 add_zero_attn, 3 both (the extra keys come after the causal diagonal)."""
    batch_first, batched, self_attn, extra = case
    ref, ours = make_pair(seed=CAUSAL_MODULES.index(case), batch_first=batch_first, add_bias_kv=extra in (1, 3),
                          add_zero_attn=extra in (2, 3))
    tgt_len, src_len = (4, 4) if self_attn else (5, 3)
    inputs = make_inputs(batched, batch_first, tgt_len, src_len, self_attn)
    for mask_kind, kpm_kind, need_weights in itertools.product(["bool", "float", "not-causal"], [None, "bool"],
                                                               [False, True]):
        if mask_kind == "not-causal":
            mask = attention_mask("2b", batched, tgt_len, src_len)
        else:
            mask = causal_mask(mask_kind, tgt_len, src_len)
        try:
            compare(ref, ours, inputs, key_padding_mask=padding_mask(kpm_kind, batched, src_len), attn_mask=mask,
                    need_weights=need_weights, is_causal=True)
        except AssertionError as error:
            raise AssertionError(f"attn_mask={mask_kind} key_padding_mask={kpm_kind} need_weights={need_weights}: "
                                 f"{error}") from None


def test_is_causal_needs_attn_mask():
    ref, ours = make_pair()
    x = torch.randn(4, BATCH, EMBED)
    for module in (ref, ours):
        with pytest.raises(RuntimeError, match="attn_mask"):
            module(x, x, x, need_weights=False, is_causal=True)


def test_larger_heads_and_every_feature():
    ref, ours = make_pair(seed=7, embed=32, heads=4, add_bias_kv=True, add_zero_attn=True, kdim=24, vdim=20,
                          batch_first=True)
    inputs = make_inputs(True, True, 7, 9, False, kdim=24, vdim=20, embed=32)
    for need_weights in (False, True):
        compare(ref, ours, inputs, key_padding_mask=padding_mask("float", True, 9),
                attn_mask=attention_mask("3f", True, 7, 9, heads=4), need_weights=need_weights,
                average_attn_weights=False)


def test_float_mask_gradients():
    ref, ours = make_pair(seed=3, add_bias_kv=True)
    inputs = make_inputs(True, False, 3, 5, False)
    mask = attention_mask("2f", True, 3, 5)
    mask = torch.where(torch.isinf(mask), torch.zeros_like(mask), mask)
    kpm = 0.5 * torch.randn(BATCH, 5)
    for need_weights in (False, True):
        grads = []
        for module in (ref, ours):
            m2, k2 = mask.clone().requires_grad_(), kpm.clone().requires_grad_()
            out, _ = module(*inputs, attn_mask=m2, key_padding_mask=k2, need_weights=need_weights)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            grads.append((out, m2.grad, k2.grad))
        for a, b, what in zip(grads[1], grads[0], ("output", "grad of attn_mask", "grad of key_padding_mask")):
            assert_close(a, b, what)


def test_eval_and_train_agree_without_dropout():
    ref, ours = make_pair(seed=5, batch_first=True, add_zero_attn=True)
    inputs = make_inputs(True, True, 4, 4, True)
    outs = []
    for train in (False, True):
        ref.train(train)
        ours.train(train)
        out, _ = compare(ref, ours, inputs, key_padding_mask=padding_mask("bool", True, 4), need_weights=False)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_inference_matches_torch_fast_path():
    """Under no_grad in eval, torch runs its fused fast path; the results still agree."""
    ref, ours = make_pair(seed=9, batch_first=True)
    ref.eval()
    ours.eval()
    x = torch.randn(BATCH, 5, EMBED)
    kpm = padding_mask("bool", True, 5)
    with torch.no_grad():
        for need_weights in (False, True):
            out_ref, w_ref = ref(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
            out, w = ours(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
            assert_close(out, out_ref, "output")
            if need_weights:
                assert_close(w, w_ref, "attention weights")


# ---- dropout --------------------------------------------------------------------------------------------


def test_dropout_only_in_training_and_reproducible():
    ref, ours = make_pair(seed=11, dropout=0.3, batch_first=True)
    x = torch.randn(BATCH, 6, EMBED)
    ref.eval()
    ours.eval()
    compare(ref, ours, (x, x, x), need_weights=False)  # eval: no dropout, torch's output
    ours.train()
    for need_weights in (False, True):
        torch.manual_seed(42)
        first, _ = ours(x, x, x, need_weights=need_weights)
        second, _ = ours(x, x, x, need_weights=need_weights)
        torch.manual_seed(42)
        again, _ = ours(x, x, x, need_weights=need_weights)
        assert not torch.allclose(first, second), "two training calls drew the same dropout"
        assert torch.equal(first, again), "the same seed must give the same dropout"
    # Both paths draw the seed the same way and use the same keep-mask.
    torch.manual_seed(7)
    via_attention, _ = ours(x, x, x, need_weights=False)
    torch.manual_seed(7)
    via_weights, weights = ours(x, x, x, need_weights=True, average_attn_weights=False)
    assert (weights == 0).any(), "dropout zeroed no attention weight"
    assert_close(via_attention, via_weights, "need_weights=False vs True under one seed")


def test_dropout_matches_the_keep_mask_definition():
    """Training output = torch's attention with P * keep / (1 - p), keep drawn by mhattn's RNG from the seed."""
    p = 0.25
    ref, ours = make_pair(seed=13, dropout=p)
    ours.train()
    tgt_len = src_len = 6
    x = torch.randn(tgt_len, BATCH, EMBED)
    torch.manual_seed(99)
    out, _ = ours(x, x, x, need_weights=False)
    torch.manual_seed(99)
    seed = torch.randint(0, 2**32, (2,), dtype=torch.int64).tolist()
    keep = keep_mask(seed, BATCH, HEADS, tgt_len, src_len, p)
    # The same computation written with torch ops: projections, softmax, dropout by keep, out_proj.
    head_dim = EMBED // HEADS
    qkv = torch.nn.functional.linear(x, ref.in_proj_weight, ref.in_proj_bias)
    q, k, v = (t.reshape(tgt_len, BATCH, HEADS, head_dim).permute(1, 2, 0, 3) for t in qkv.chunk(3, dim=-1))
    probs = torch.softmax(q @ k.transpose(-1, -2) / head_dim**0.5, dim=-1)
    attn = (probs * keep / (1 - p)) @ v
    expected = ref.out_proj(attn.permute(2, 0, 1, 3).reshape(tgt_len, BATCH, EMBED))
    assert_close(out, expected, "dropout output")
    assert 0.5 < keep.float().mean().item() < 0.95


# ---- documented differences and errors ------------------------------------------------------------------------


def test_fully_masked_rows_give_zero_not_nan():
    ref, ours = make_pair(seed=17)
    x = torch.randn(4, BATCH, EMBED, requires_grad=True)
    kpm = torch.zeros(BATCH, 4, dtype=torch.bool)
    kpm[0] = True  # batch entry 0 sees no key at all
    for need_weights in (False, True):
        out, weights = ours(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
        assert not torch.isnan(out).any()
        # attention output 0 there, so the module returns out_proj's bias
        assert torch.equal(out[:, 0], ours.out_proj.bias.detach().expand(4, EMBED))
        if need_weights:
            assert torch.equal(weights[0], torch.zeros(4, 4))
            _, ref_weights = ref(x, x, x, key_padding_mask=kpm, need_weights=True)
            assert torch.isnan(ref_weights[0]).all()  # torch's weights path: NaN (the intended difference)
        out.sum().backward()
        assert torch.isfinite(x.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in ours.parameters())
        x.grad = None
        ours.zero_grad()
    # the rows that do see keys still match torch
    out_ref, _ = ref(x, x, x, key_padding_mask=kpm, need_weights=False)
    out, _ = ours(x, x, x, key_padding_mask=kpm, need_weights=False)
    assert_close(out[:, 1], out_ref[:, 1], "rows with visible keys")


def test_mismatched_mask_types_warn_like_torch():
    ref, ours = make_pair()
    x = torch.randn(4, BATCH, EMBED)
    for module in (ref, ours):
        with pytest.warns(UserWarning, match="mismatched"):
            module(x, x, x, key_padding_mask=padding_mask("bool", True, 4), attn_mask=attention_mask("2f", True, 4, 4))


@pytest.mark.parametrize("case", ["query-rank", "kpm-shape", "attn-mask-shape", "attn-mask-3d-shape", "mask-dtype",
                                  "embed-dim"])
def test_bad_input_raises_what_torch_raises(case):
    ref, ours = make_pair()
    x = torch.randn(4, BATCH, EMBED)
    args, kwargs = (x, x, x), {}
    if case == "query-rank":
        args = (x[None], x[None], x[None])
    elif case == "kpm-shape":
        kwargs["key_padding_mask"] = torch.zeros(BATCH, 3, dtype=torch.bool)
    elif case == "attn-mask-shape":
        kwargs["attn_mask"] = torch.zeros(4, 3, dtype=torch.bool)
    elif case == "attn-mask-3d-shape":
        kwargs["attn_mask"] = torch.zeros(BATCH, 4, 4, dtype=torch.bool)
    elif case == "mask-dtype":
        kwargs["attn_mask"] = torch.zeros(4, 4, dtype=torch.int64)
    elif case == "embed-dim":
        args = (torch.randn(4, BATCH, EMBED + 1),) * 3
    with pytest.raises(Exception) as torch_error:
        ref(*args, **kwargs)
    with pytest.raises(mhattn.InputError) as our_error:
        ours(*args, **kwargs)
    assert isinstance(our_error.value, type(torch_error.value)), (
        f"torch raises {type(torch_error.value).__name__}, mhattn {type(our_error.value).__mro__}"
    )


def test_nested_input_is_rejected_with_advice():
    _, ours = make_pair(batch_first=True)
    ours.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype-stage notice for strided nested tensors
        nested = torch.nested.nested_tensor([torch.randn(3, EMBED), torch.randn(2, EMBED)])
    with pytest.raises(AssertionError, match="enable_nested_tensor=False"):
        ours(nested, nested, nested)


# ---- replace_multihead_attention --------------------------------------------------------------------------------


class _CountForward:
    """Counts calls of mhattn.MultiheadAttention.forward (patched on the class: a hook would change the path)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = mhattn.MultiheadAttention.forward

        def counted(module, *args, **kwargs):
            self.calls += 1
            return original(module, *args, **kwargs)

        monkeypatch.setattr(mhattn.MultiheadAttention, "forward", counted)


class _CountFastPath:
    """Counts torch's fused encoder-layer calls (the path that bypasses self_attn.forward)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = torch._transformer_encoder_layer_fwd

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counted)


def _transformer(seed, d_model=8, nhead=2):
    torch.manual_seed(seed)
    encoder = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=16, dropout=0.0, batch_first=True),
        num_layers=2,
    )
    decoder = torch.nn.TransformerDecoder(
        torch.nn.TransformerDecoderLayer(d_model, nhead, dim_feedforward=16, dropout=0.0, batch_first=True),
        num_layers=2,
    )
    model = torch.nn.ModuleDict({"encoder": encoder, "decoder": decoder})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("in_proj_bias") or name.endswith("out_proj.bias"):
                p.normal_(0.0, 0.2)
    return model


def _encode_decode(model, src, tgt, src_pad, tgt_pad):
    memory = model["encoder"](src, src_key_padding_mask=src_pad)
    tgt_mask = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool).triu(1)  # bool, like the padding masks
    out = model["decoder"](tgt, memory, tgt_mask=tgt_mask, tgt_is_causal=True, tgt_key_padding_mask=tgt_pad,
                           memory_key_padding_mask=src_pad)
    return memory, out


def _transformer_inputs():
    torch.manual_seed(21)
    src, tgt = torch.randn(BATCH, 6, 8), torch.randn(BATCH, 5, 8)
    src_pad = torch.zeros(BATCH, 6, dtype=torch.bool)
    src_pad[1, 4:] = True  # right padding: torch's encoder takes its nested-tensor path in inference
    tgt_pad = torch.zeros(BATCH, 5, dtype=torch.bool)
    tgt_pad[0, 4] = True
    return src, tgt, src_pad, tgt_pad


def test_replace_in_transformer_inference(monkeypatch):
    src, tgt, src_pad, tgt_pad = _transformer_inputs()
    ref = _transformer(seed=1).eval()
    ref_no_nested = copy.deepcopy(ref)
    ref_no_nested["encoder"].use_nested_tensor = False
    ours = mhattn.replace_multihead_attention(copy.deepcopy(ref))
    assert sum(isinstance(m, mhattn.MultiheadAttention) for m in ours.modules()) == 6
    assert not any(type(m) is torch.nn.MultiheadAttention for m in ours.modules())

    fast = _CountFastPath(monkeypatch)
    with torch.no_grad():
        memory_ref, out_ref = _encode_decode(ref, src, tgt, src_pad, tgt_pad)
        # no padding masks: the decoder's tgt_is_causal hint then replaces its tgt_mask (torch's rule)
        memory_flat_ref, out_flat_ref = _encode_decode(ref_no_nested, src, tgt, None, None)
    assert fast.calls > 0, "torch's model should take the fused encoder path here (else this test proves nothing)"

    fast.calls = 0
    ours_forward = _CountForward(monkeypatch)
    with torch.no_grad():
        memory, out = _encode_decode(ours, src, tgt, src_pad, tgt_pad)
        memory_flat, out_flat = _encode_decode(ours, src, tgt, None, None)
    assert fast.calls == 0, "the fused encoder layer bypassed mhattn"
    assert ours_forward.calls == 2 * (2 + 2 * 2)  # two runs of 2 encoder + 2 decoder layers (2 attentions each)
    # torch's nested path zeroes padded source positions; compare where src is real, and all of the decoder
    real = ~src_pad
    assert_close(memory[real], memory_ref[real], "encoder output (real positions)")
    assert_close(out, out_ref, "decoder output")
    assert_close(memory_flat, memory_flat_ref, "encoder output without padding")
    assert_close(out_flat, out_flat_ref, "decoder output without padding")
    # and against torch's own non-nested path, every position
    ref_no_nested_memory, _ = _encode_decode(ref_no_nested, src, tgt, src_pad, tgt_pad)
    assert_close(memory, ref_no_nested_memory.detach(), "encoder output vs torch non-nested path")


def test_replace_in_transformer_training(monkeypatch):
    src, tgt, src_pad, tgt_pad = _transformer_inputs()
    ref = _transformer(seed=2).train()
    ours = mhattn.replace_multihead_attention(copy.deepcopy(ref))
    assert all(m.training for m in ours.modules())
    counter = _CountForward(monkeypatch)
    results = []
    for model in (ref, ours):
        memory, out = _encode_decode(model, src, tgt, src_pad, tgt_pad)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((memory, out, {n: p.grad for n, p in model.named_parameters()}))
    assert counter.calls == 2 + 2 * 2
    (memory_ref, out_ref, grads_ref), (memory, out, grads) = results
    assert_close(memory, memory_ref, "encoder output")
    assert_close(out, out_ref, "decoder output")
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        if grads_ref[name] is not None:
            assert_close(grads[name], grads_ref[name], f"grad of {name}")


def test_replace_keeps_parameters_modes_and_sharing():
    shared = torch.nn.MultiheadAttention(EMBED, HEADS, kdim=KDIM, vdim=VDIM, bias=False, add_bias_kv=True)
    shared.k_proj_weight.requires_grad_(False)
    model = torch.nn.Sequential(shared, torch.nn.Sequential(shared), torch.nn.MultiheadAttention(EMBED, HEADS))
    model[2].eval()
    old_params = {n: p for n, p in shared.named_parameters()}
    first_params = list(model[2].parameters())
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    assert mhattn.replace_multihead_attention(model) is model
    assert torch.equal(torch.rand(1), before), "replacing drew from the global RNG"
    new = model[0]
    assert isinstance(new, mhattn.MultiheadAttention) and model[1][0] is new
    for name, p in new.named_parameters():
        assert p is old_params[name], f"{name} is not the old Parameter object"
    assert not new.k_proj_weight.requires_grad and new.q_proj_weight.requires_grad
    assert (new.kdim, new.vdim, new.bias_k is not None, new.in_proj_bias is None) == (KDIM, VDIM, True, True)
    assert new.training and not model[2].training
    assert all(a is b for a, b in zip(model[2].parameters(), first_params))

    # the root itself, and a subclass that must keep its own behaviour
    root = torch.nn.MultiheadAttention(EMBED, HEADS)
    assert isinstance(mhattn.replace_multihead_attention(root), mhattn.MultiheadAttention)

    class Custom(torch.nn.MultiheadAttention):
        pass

    holder = torch.nn.Sequential(Custom(EMBED, HEADS))
    mhattn.replace_multihead_attention(holder)
    assert type(holder[0]) is Custom


def test_replaced_model_pickles():
    model = mhattn.replace_multihead_attention(_transformer(seed=3))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded["encoder"].layers[0].self_attn, mhattn.MultiheadAttention)
    assert loaded["encoder"].use_nested_tensor is False


def test_layers_given_one_padding_mask_pass_one_mask_on(monkeypatch):
    """A boolean key_padding_mask reaches mhattn.attention as its inverse (True = attend), made once for the same
    unchanged mask: two modules (a model's layers) given one mask pass the very same tensor on, so a backend reading
    a mask's values back once per mask (the Triton backend's right-padding check) does it once, not once a layer. A
    mask changed in place gets a new inverse with its new values."""
    from mhattn import modules

    seen = []
    real = modules.attention
    monkeypatch.setattr(modules, "attention", lambda *a, **k: seen.append(k["attn_mask"]) or real(*a, **k))
    layers = [make_pair()[1] for _ in range(2)]
    x = torch.randn(5, BATCH, EMBED)
    kpm = torch.zeros(BATCH, 5, dtype=torch.bool)
    kpm[0, 3:] = True
    for layer in layers:
        layer(x, x, x, key_padding_mask=kpm, need_weights=False)
    assert seen[0] is seen[1] and seen[0].dtype == torch.bool
    assert torch.equal(seen[0][:, 0, 0, :], ~kpm)
    kpm[1, 4] = True  # in place: a new version
    layers[0](x, x, x, key_padding_mask=kpm, need_weights=False)
    assert seen[2] is not seen[0] and torch.equal(seen[2][:, 0, 0, :], ~kpm)


def test_compiled_module_inverts_each_padding_mask_it_is_given():
    """Under torch.compile the module's inverse of key_padding_mask is part of the graph (not a tensor kept from the
    trace): the compiled module follows a mask changed in place between calls, as eager does."""
    torch._dynamo.reset()
    _, ours = make_pair()
    ours.eval()
    x = torch.randn(5, BATCH, EMBED)
    kpm = torch.zeros(BATCH, 5, dtype=torch.bool)
    kpm[0, 3:] = True
    compiled = torch.compile(lambda x, m: ours(x, x, x, key_padding_mask=m, need_weights=False)[0], backend="eager")
    for change in (None, (1, 2)):
        if change is not None:
            kpm[change] = True  # in place, between calls
        expected = ours(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
        torch.testing.assert_close(compiled(x, kpm), expected)
