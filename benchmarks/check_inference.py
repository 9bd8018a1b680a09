"""GPU check of the inference paths (issue 13): decode table, paged vs contiguous, varlen vs padded cuDNN.

    source benchmarks/device_env.sh
    python benchmarks/check_inference.py            # H100: about 2-3 minutes; logs under $OUT when set

Prints, for bf16 and fp16 (Hq = 32, Hkv = 8, d = 128; B in 1, 8, 64; Nk in 1k, 8k, 32k, 128k; Nq = 1 and 4):
SDPA's default and cuDNN times, mhattn's (``attention`` with backend="triton", the KV-cache entry contiguous
and paged), triton's speed-up over each, its bandwidth (KV bytes / time) and paged / contiguous. Then the
varlen comparison: forward+backward of packed sequences (lengths 100 .. 8k, 16k tokens, d = 128, causal)
against the same sequences as a right-padded batch through SDPA's cuDNN kernel (causal, so the padding
after each sequence is never seen). Last, a right-padding key mask as (B, 1, 1, Nk) (the kernels stop at each
entry's last key) against the same mask materialised per query row (every key block read). Before timing, a
few outputs are checked against SDPA.

``--device cpu --tiny`` runs the same code on tiny shapes (with TRITON_INTERPRET=1) to test the script.
``--sweep-tiles`` instead times the split-KV kernel's candidate tiles at d = 128 (decode_launch.GPU_TILES,
CONTIGUOUS_TILES and HOPPER_SPLIT_TILES at 128, all set to each: keys per step, warps, pipeline stages) on the
bandwidth-bound decode cells, contiguous and paged, beside cuDNN. ``--sweep-splits`` times contiguous decoding at
d = 128 with the number of splits forced (SWEEP_SPLIT_CELLS) beside the rule's own choice and cuDNN, at one sequence
and at batches whose grid nearly fills the GPU unsplit.
``--dependent-launch`` times decoding (dense, contiguous and paged cache; bf16, d = 128, Nq = 1) with the combine as
a programmatic dependent launch of the split kernel and after it (decode_launch.DEPENDENT_LAUNCH), beside cuDNN.
``--padded-decode`` times batches of decoding steps (bf16, Hq = 32, Hkv = 8, d = 128, Nq = 1) with a left-padding key
mask (B, 1, 1, Nk), as a batch of prompts padded on the left decodes: on the split-KV kernels (which read one row of
the mask a key block), the same mask materialised per head (B, Hq, 1, Nk: the FlashAttention-2 forward, the path such
calls took before), SDPA's default with the mask, and the Triton step without a mask.
``--padded-prefill`` times the forward of a batch of prompts padded on the left (bf16, Hq = 32, Hkv = 8, d = 128,
causal, Nq = Nk, a (B, 1, 1, Nk) key-padding mask as the Hugging Face integration passes it): the Triton backend as
shipped (on Hopper the Gluon forward, taking the mask as each sequence's first key), the same with the Gluon kernels
off (MHATTN_TRITON_HOPPER=0: the FlashAttention-2 forward, which reads the mask), SDPA's default with the causal and
padding mask combined (B, 1, Nq, Nk), and the Triton forward without the padding; with ``--backward`` each call's
forward and backward (a training step on left-padded sequences; ``--deterministic``: under
torch.use_deterministic_algorithms(True)); with ``--dropout P`` each call drops with P.
``--kept-partials`` compares host loops of short decoding steps (dense and contiguous cache; bf16, d = 128, Nq = 1)
with the split kernel's partials kept per stream (decode_launch.split_partials) and allocated at every step, in
turns, beside SDPA's. ``--append`` compares host loops of decoding steps through attention_with_kvcache that append
a token (contiguous and paged cache) four ways, in turns, beside the dense step and SDPA's: the step the Triton backend
prepared for the call signature (kvcache_call, appending inside the split kernel: as shipped), the same step worked
out at every call (forward_kvcache_appending), the backend's append kernel (append_kvcache) and torch's indexing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time

import torch

from mhattn.benchmark import decode_bench, timing

VARLEN_LENGTHS = (8192, 4096, 2048, 1024, 512, 256, 156, 100)  # 16384 tokens
# --sweep-tiles: (keys per step, warps, stages) of the split-KV kernel at d = 128, and (B, Nk) cells at Nq = 1.
SWEEP_TILES = ((64, 4, 3), (64, 4, 2), (64, 4, 1), (64, 4, 4), (64, 8, 3), (32, 4, 3), (32, 4, 4), (128, 4, 2),
               (128, 8, 2), (128, 8, 3))
SWEEP_CELLS = ((1, 131072), (8, 32768), (8, 131072), (64, 8192), (64, 32768))
# --sweep-splits: (B, Nk) cells at Nq = 1, each with the split counts to force: few at batches whose grid nearly
# fills the GPU unsplit, and at B = 1 (8 programs unsplit) counts around the rule's 2 programs per SM.
FEW_SPLITS = (1, 2, 3, 4, 6)
SINGLE_SEQUENCE_SPLITS = (17, 33, 50, 66, 99, 128)
SWEEP_SPLIT_CELLS = ((1, 32768, SINGLE_SEQUENCE_SPLITS), (1, 131072, SINGLE_SEQUENCE_SPLITS), (8, 32768, FEW_SPLITS),
                     (8, 131072, FEW_SPLITS), (64, 8192, FEW_SPLITS), (64, 32768, FEW_SPLITS),
                     (64, 131072, FEW_SPLITS))
# --kept-partials: (B, Nk) cells at Nq = 1, short caches (host-bound steps).
KEPT_PARTIALS_CELLS = ((1, 1024), (1, 8192), (8, 1024))
# --append: (B, Nk) cells at Nq = 1 (Nk keys after the append): short caches (host-bound steps), and two long ones
# (GPU-bound: the appends' cost on the GPU); the paged cache's blocks.
APPEND_CELLS = ((1, 1024), (1, 8192), (8, 1024), (8, 32768), (1, 131072))
APPEND_BLOCK = 256
# --dependent-launch: (B, Nk) cells at Nq = 1.
DEPENDENT_CELLS = ((1, 1024), (1, 8192), (1, 32768), (1, 131072), (8, 1024), (8, 8192), (8, 32768), (64, 8192))
VARLEN_HEADS = 16
# --padded-decode: (B, Nk) cells at Nq = 1; each batch entry's first keys are padding (up to half of them).
PADDED_DECODE_CELLS = ((8, 1024), (8, 8192), (8, 32768), (64, 8192), (64, 32768))
# --padded-prefill: (B, N) cells, Nq = Nk = N; each batch entry's first keys are padding (up to half of them).
PADDED_PREFILL_CELLS = ((8, 1024), (4, 4096), (2, 16384))


def log(out_dir, text):
    print(text, flush=True)
    if out_dir:
        with open(os.path.join(out_dir, "check_inference.log"), "a") as f:
            f.write(text + "\n")


def check_outputs(device, dtype, tiny):
    """Max |mhattn - SDPA| of a decode step (dense, contiguous cache, paged cache) and of a varlen forward."""
    import mhattn
    import torch.nn.functional as F

    gen = torch.Generator(device=device).manual_seed(1)
    b, hq, hkv, nk, d = (2, 4, 2, 100, 16) if tiny else (4, 32, 8, 5000, 128)
    lines = []
    for nq in (1, 4):
        q = torch.randn(b, hq, nq, d, device=device, dtype=dtype, generator=gen)
        k = torch.randn(b, hkv, nk, d, device=device, dtype=dtype, generator=gen)
        v = torch.randn(b, hkv, nk, d, device=device, dtype=dtype, generator=gen)
        mask = decode_bench._causal_mask(decode_bench.DecodeCell("fp16", b, nk, nq), device)
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
        bias = None if nq == 1 else torch.nn.attention.bias.causal_lower_right(nq, nk)
        dense = mhattn.attention(q, k, v, attn_mask=bias, enable_gqa=True, backend="triton")
        seqlens = torch.full((b,), nk, dtype=torch.int32, device=device)
        cached = mhattn.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, backend="triton")
        block = 16
        blocks = -(-nk // block)
        pad = blocks * block - nk
        pool_k = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(b, hkv, blocks, block, d).transpose(1, 2)
        pool_v = torch.nn.functional.pad(v, (0, 0, 0, pad)).view(b, hkv, blocks, block, d).transpose(1, 2)
        order = torch.randperm(b * blocks, device=device, generator=gen)
        pool = (torch.empty_like(pool_k.reshape(b * blocks, hkv, block, d)),
                torch.empty_like(pool_v.reshape(b * blocks, hkv, block, d)))
        pool[0][order] = pool_k.reshape(b * blocks, hkv, block, d)
        pool[1][order] = pool_v.reshape(b * blocks, hkv, block, d)
        table = order.view(b, blocks).to(torch.int32)
        paged = mhattn.attention_with_kvcache(q, pool[0], pool[1], cache_seqlens=seqlens, block_table=table,
                                              backend="triton")
        for name, got in (("attention", dense), ("kvcache", cached), ("paged", paged)):
            lines.append(f"  Nq={nq} {name:9s} max |mhattn - sdpa(fp32)| = {float((got.float() - want).abs().max()):.2e}")
    return lines


def varlen_section(device, dtype, settings, tiny):
    """(text lines, row) comparing varlen fwd+bwd with the padded batch through SDPA (cuDNN, and default)."""
    import mhattn
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lengths = (40, 25, 7, 1) if tiny else VARLEN_LENGTHS
    heads, d = (2, 16) if tiny else (VARLEN_HEADS, 128)
    gen = torch.Generator(device=device).manual_seed(2)
    total, longest = sum(lengths), max(lengths)
    q, k, v, grad = (torch.randn(total, heads, d, device=device, dtype=dtype, generator=gen) for _ in range(4))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def varlen_step():
        out = mhattn.varlen_attention(*leaves, cu, cu, longest, longest, is_causal=True, backend="triton")
        torch.autograd.grad(out, leaves, grad)

    padded = []
    for t in (q, k, v, grad):
        p = torch.zeros(len(lengths), longest, heads, d, device=device, dtype=dtype)
        for i, (start, n) in enumerate(zip(cu.tolist(), lengths)):
            p[i, :n] = t[start:start + n]
        padded.append(p.transpose(1, 2))  # (B, H, N, d)
    padded_leaves = [t.detach().requires_grad_() for t in padded[:3]]

    def padded_step(kernel):
        def step():
            with sdpa_kernel(kernel) if kernel is not None else _nothing():
                out = F.scaled_dot_product_attention(*padded_leaves, is_causal=True)
            torch.autograd.grad(out, padded_leaves, padded[3])
        return step

    def padded_triton():
        out = mhattn.attention(*padded_leaves, is_causal=True, backend="triton")
        torch.autograd.grad(out, padded_leaves, padded[3])

    # Correctness first: varlen's output against the padded SDPA rows.
    out = mhattn.varlen_attention(q, k, v, cu, cu, longest, longest, is_causal=True, backend="triton")
    ref = F.scaled_dot_product_attention(*(t.float() for t in padded[:3]), is_causal=True).transpose(1, 2)
    err = max(float((out[s:s + n].float() - ref[i, :n]).abs().max()) for i, (s, n) in enumerate(zip(cu.tolist(), lengths)))
    row = {"dtype": str(dtype).replace("torch.", ""), "lengths": list(lengths), "max_err": err, "ms": {}, "status": {}}
    candidates = (("varlen triton", varlen_step), ("padded sdpa-cudnn", padded_step(SDPBackend.CUDNN_ATTENTION)),
                  ("padded sdpa default", padded_step(None)), ("padded triton", padded_triton))
    if device.type != "cuda":
        candidates = candidates[:1] + candidates[3:]
    for name, fn in candidates:
        try:
            fn()
            row["ms"][name] = timing.bench_ms(fn, settings.warmup_ms, settings.rep_ms, device)
            row["status"][name] = "ok"
        except Exception as error:
            row["ms"][name] = None
            row["status"][name] = timing.describe_error(error)
    base = row["ms"].get("varlen triton")
    lines = [f"varlen fwd+bwd, {row['dtype']}, causal, d={d}, H={heads}, lengths {list(lengths)} ({total} tokens); "
             f"max |varlen - padded sdpa(fp32)| = {err:.2e}"]
    for name, ms in row["ms"].items():
        speed = "" if ms is None or base is None else f"  (varlen is {ms / base:.2f}x faster)" if name != "varlen triton" else ""
        lines.append(f"  {name:20s} {'-' if ms is None else f'{ms:8.3f} ms'}{speed}"
                     + ("" if row["status"][name] == "ok" else f"  {row['status'][name][:200]}"))
    return lines, row


def key_padding_section(device, dtype, settings, tiny):
    """Forward+backward with a right-padding key mask (B, 1, 1, Nk) (the kernels bound each batch entry's keys)
    against the same mask materialised per query row (B, 1, Nq, Nk) (no bound: every key block is read)."""
    import mhattn

    b, h, n, d = (2, 2, 64, 16) if tiny else (8, 16, 4096, 128)
    gen = torch.Generator(device=device).manual_seed(3)
    lengths = torch.tensor([n // 4, n // 2, n, 3 * n // 8] * (b // 4 or 1), device=device)[:b]
    keys = torch.arange(n, device=device)[None, :] < lengths[:, None]
    shared = keys.view(b, 1, 1, n)
    per_row = shared.expand(b, 1, n, n).contiguous()
    q, k, v, grad = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=gen) for _ in range(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    lines = [f"key padding, {str(dtype).replace('torch.', '')}, B={b} H={h} N={n} d={d}, "
             f"key lengths {lengths.tolist()}: fwd+bwd ms"]
    times = {}
    outs = {}
    for name, mask in (("bounded (B,1,1,Nk)", shared), ("per row (B,1,Nq,Nk)", per_row)):
        def step(mask=mask):
            out = mhattn.attention(*leaves, attn_mask=mask, backend="triton")
            torch.autograd.grad(out, leaves, grad)
            return out
        outs[name] = step().detach()
        times[name] = timing.bench_ms(step, settings.warmup_ms, settings.rep_ms, device)
    first, second = list(times)
    same = float((outs[first].float() - outs[second].float()).abs().max())
    lines.append(f"  {first}: {times[first]:.3f}   {second}: {times[second]:.3f}   "
                 f"speed-up {times[second] / times[first]:.2f}x   max |difference| {same:.1e}")
    return lines


def _times_us(calls: dict, settings, device) -> dict:
    """name -> GPU time in us of each call (timing.bench_ms)."""
    return {name: 1000.0 * timing.bench_ms(call, settings.warmup_ms, settings.rep_ms, device)
            for name, call in calls.items()}


def _padded_shape(tiny: bool) -> tuple:
    """(Hq, Hkv, d, dtype) of the padded-batch checks (tiny: for the interpreter, which computes bfloat16 wrongly)."""
    return (4, 2, 16, torch.float16) if tiny else (32, 8, 128, torch.bfloat16)


def _left_padded_batch(device, batch: int, seqlen_q: int, seqlen_k: int, tiny: bool) -> tuple:
    """(q, k, v, mask) of a batch padded on the left: random q (B, Hq, Nq, d), k and v (B, Hkv, Nk, d) of
    _padded_shape, and the (B, 1, 1, Nk) bool key-padding mask (True = attend) whose entries' first keys are padding,
    up to half of them."""
    heads_q, heads_kv, head_dim, dtype = _padded_shape(tiny)
    gen = torch.Generator(device=device).manual_seed(batch + seqlen_k)
    q = torch.randn(batch, heads_q, seqlen_q, head_dim, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, heads_kv, seqlen_k, head_dim, device=device, dtype=dtype, generator=gen)
            for _ in range(2))
    padding = torch.randint(0, seqlen_k // 2 + 1, (batch, 1), device=device, generator=gen)
    return q, k, v, (torch.arange(seqlen_k, device=device)[None, :] >= padding).view(batch, 1, 1, seqlen_k)


def padded_decode(device, settings, out_dir, cells=PADDED_DECODE_CELLS, tiny=False):
    """Decoding steps with a left-padding key mask (see the module docstring), GPU time in us, each output checked
    against SDPA's."""
    import mhattn

    heads_q, heads_kv, head_dim, dtype = _padded_shape(tiny)
    name = str(dtype).replace('torch.', '')
    lines = [f"decoding with a left-padding mask ({name}, Hq={heads_q}, Hkv={heads_kv}, d={head_dim}, Nq=1; GPU us; "
             "x = that time over the split-KV step's)",
             f"{'B':>3} {'Nk':>6} {'split-KV':>9} {'per-head mask':>14} {'sdpa':>8} {'no mask':>8} "
             f"{'x per-head':>10} {'x sdpa':>7} {'max |diff|':>10}"]
    for batch, keys in cells:
        q, k, v, shared = _left_padded_batch(device, batch, 1, keys, tiny)
        per_head = shared.expand(batch, heads_q, 1, keys).contiguous()
        calls = {
            "split-KV": lambda: mhattn.attention(q, k, v, attn_mask=shared, enable_gqa=True, backend="triton"),
            "per-head mask": lambda: mhattn.attention(q, k, v, attn_mask=per_head, enable_gqa=True, backend="triton"),
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=shared,
                                                                             enable_gqa=True),
            "no mask": lambda: mhattn.attention(q, k, v, enable_gqa=True, backend="triton"),
        }
        want = calls["sdpa"]().float()
        diff = max(float((calls[name]().float() - want).abs().max()) for name in ("split-KV", "per-head mask"))
        us = _times_us(calls, settings, device)
        lines.append(f"{batch:>3} {keys:>6} {us['split-KV']:>9.1f} {us['per-head mask']:>14.1f} {us['sdpa']:>8.1f} "
                     f"{us['no mask']:>8.1f} {us['per-head mask'] / us['split-KV']:>10.2f} "
                     f"{us['sdpa'] / us['split-KV']:>7.2f} {diff:>10.1e}")
    return lines


def padded_prefill(device, settings, out_dir, cells=PADDED_PREFILL_CELLS, tiny=False, backward=False, dropout=0.0):
    """Prefill of prompts padded on the left (see the module docstring), GPU time in us; the shipped output checked
    against SDPA's on the rows that see a key. backward: each call's forward and backward (q, k, v's gradients).
    dropout: each call's dropout_p; the shipped output is then checked against the FlashAttention-2 kernels' under the
    same seed (every backend drops the same elements; SDPA drops others)."""
    import mhattn

    heads_q, heads_kv, head_dim, dtype = _padded_shape(tiny)
    name = str(dtype).replace('torch.', '')
    what = (("forward+backward" if backward else "forward") + (f", dropout {dropout}" if dropout else "")
            + (", deterministic" if torch.are_deterministic_algorithms_enabled() else ""))
    lines = [f"prefill with a left-padding mask ({name}, Hq={heads_q}, Hkv={heads_kv}, d={head_dim}, causal, "
             f"Nq = Nk; {what}, GPU us; x = that time over the shipped call's)",
             f"{'B':>3} {'N':>6} {'shipped':>8} {'no Gluon':>9} {'sdpa':>8} {'no padding':>10} "
             f"{'x no Gluon':>10} {'x sdpa':>7} {'max |diff|':>10}"]
    for batch, seqlen in cells:
        q, k, v, shared = _left_padded_batch(device, batch, seqlen, seqlen, tiny)
        if backward:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
        causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=device).tril()
        combined = shared & causal  # (B, 1, N, N), what SDPA takes
        sees = combined.any(-1, keepdim=True)  # (B, 1, N, 1): rows that see a key (SDPA's others are undefined)

        def shipped():
            return mhattn.attention(q, k, v, attn_mask=shared, dropout_p=dropout, window=(-1, 0), enable_gqa=True,
                                    backend="triton")

        calls = {
            "shipped": shipped,
            "no Gluon": lambda: _with_environment("MHATTN_TRITON_HOPPER", "0", shipped, backward, q, k, v),
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=combined,
                                                                             dropout_p=dropout, enable_gqa=True),
            "no padding": lambda: mhattn.attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=True,
                                                   backend="triton"),
        }
        if backward:  # (the environment call runs its own backward inside the setting)
            calls = {name: (call if name == "no Gluon" else functools.partial(_with_backward, call, q, k, v))
                     for name, call in calls.items()}
        if dropout:  # the same seed for both: the same elements dropped
            want = _seeded(calls["no Gluon"]).float()
            diff = float(((_seeded(calls["shipped"]).float() - want) * sees).abs().nan_to_num(0.0).max())
        else:
            want = calls["sdpa"]().float()
            diff = max(float(((calls[name]().float() - want) * sees).abs().nan_to_num(0.0).max())
                       for name in ("shipped", "no Gluon"))
        us = _times_us(calls, settings, device)
        lines.append(f"{batch:>3} {seqlen:>6} {us['shipped']:>8.1f} {us['no Gluon']:>9.1f} {us['sdpa']:>8.1f} "
                     f"{us['no padding']:>10.1f} {us['no Gluon'] / us['shipped']:>10.2f} "
                     f"{us['sdpa'] / us['shipped']:>7.2f} {diff:>10.1e}")
    return lines


def _seeded(call):
    """call() after seeding torch's generators with one fixed seed (mhattn draws its dropout seed from them)."""
    torch.manual_seed(20261129)
    return call()


def _with_backward(call, q, k, v):
    """call()'s output, after its backward into q, k, v (a fixed output gradient); detached."""
    out = call()
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out) / out.shape[-1])
    return out.detach()


def _with_environment(name: str, value: str, call, backward: bool, *inputs):
    """call()'s output with environment variable ``name`` at ``value`` (with ``backward``, through _with_backward on
    ``inputs``, the backward inside the setting too)."""
    with _environment(name, value):
        return _with_backward(call, *inputs) if backward else call()


@contextlib.contextmanager
def _environment(name: str, value: str):
    """Environment variable ``name`` set to ``value`` inside the block (the Triton backend reads its switches at each
    call)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def _forget_decode_plans():
    """Drop the Triton backend's split plans and prepared launches, and the front ends' prepared calls (a KV-cache
    step prepared per call signature keeps its launches), which hold the tile and the split count a sweep changes,
    so the next call works them out again."""
    from mhattn import dispatch
    from mhattn.backends.triton import backend as triton_backend
    from mhattn.backends.triton import decode_launch

    decode_launch._split_plans.clear()
    triton_backend._signatures.clear()
    dispatch.clear_cache()


def sweep_tiles(device, settings, out_dir):
    """Contiguous and paged decoding (bf16, Nq = 1) with each of SWEEP_TILES as the d = 128 tile, beside cuDNN."""
    from mhattn.backends.triton import decode_launch

    # the paged cache's, the contiguous one's, split grids' on Hopper (both caches)
    tables = (decode_launch.GPU_TILES, decode_launch.CONTIGUOUS_TILES, decode_launch.HOPPER_SPLIT_TILES)
    kept = [table[128] for table in tables]
    header = f"{'B':>3} {'Nk':>6} {'cuDNN us':>9}  " + "  ".join(f"{'x'.join(map(str, t)):>13}" for t in SWEEP_TILES)
    lines = ["== split-KV tile sweep, d = 128, bf16, Nq = 1: contiguous / paged us per tile (keys x warps x stages); "
             f"kept: paged {kept[0]}, contiguous {kept[1]}, split grids on Hopper {kept[2]} ==", header]
    try:
        for batch, seqlen_k in SWEEP_CELLS:
            cell = decode_bench.DecodeCell("bf16", batch, seqlen_k, 1)
            cudnn = decode_bench.time_cell(cell, ("sdpa-cudnn",), settings, device)["us"]["sdpa-cudnn"]
            times = []
            for tile in SWEEP_TILES:
                for table in tables:
                    table[128] = decode_launch.DecodeTile(*tile)
                _forget_decode_plans()
                us = decode_bench.time_cell(cell, ("kvcache", "paged"), settings, device)["us"]
                times.append(f"{_us(us.get('kvcache'))}/{_us(us.get('paged'))}")
                log(out_dir, f"B={batch} Nk={seqlen_k} tile {tile}: {times[-1]} (cuDNN {_us(cudnn)})")
            lines.append(f"{batch:>3} {seqlen_k:>6} {_us(cudnn):>9}  " + "  ".join(f"{t:>13}" for t in times))
    finally:
        for table, tile in zip(tables, kept):
            table[128] = tile
        _forget_decode_plans()
    return lines


def sweep_splits(device, settings, out_dir):
    """Contiguous decoding (bf16, Nq = 1, d = 128) with each cell's split counts forced (SWEEP_SPLIT_CELLS), beside
    the split rule's own count (decode_launch.num_splits) and cuDNN."""
    from mhattn.backends.triton import decode_launch

    rule = decode_launch.num_splits
    lines = ["== split-count sweep, d = 128, bf16, Nq = 1, contiguous cache: us per forced count (count:us); rule = "
             "decode_launch.num_splits (its count in brackets) ==",
             f"{'B':>3} {'Nk':>6} {'cuDNN us':>9} {'rule':>11}  forced"]

    def timed(cell, count):
        decode_launch.num_splits = rule if count is None else (lambda *args, **kwargs: count)
        _forget_decode_plans()
        return decode_bench.time_cell(cell, ("kvcache",), settings, device)["us"].get("kvcache")

    try:
        for batch, seqlen_k, counts in SWEEP_SPLIT_CELLS:
            cell = decode_bench.DecodeCell("bf16", batch, seqlen_k, 1)
            cudnn = decode_bench.time_cell(cell, ("sdpa-cudnn",), settings, device)["us"]["sdpa-cudnn"]
            own = timed(cell, None)
            own_count = max(plan[1] for plan in decode_launch._split_plans.values())
            times = [f"{count}:{_us(timed(cell, count))}" for count in counts]
            lines.append(f"{batch:>3} {seqlen_k:>6} {_us(cudnn):>9} {_us(own) + f' [{own_count}]':>11}  "
                         + "  ".join(times))
            log(out_dir, lines[-1])
    finally:
        decode_launch.num_splits = rule
        _forget_decode_plans()
    return lines


def sweep_dependent_launch(device, settings, out_dir):
    """Decoding (bf16, Nq = 1, d = 128) with the combine launched as a programmatic dependent of the split kernel
    and after it (decode_launch.DEPENDENT_LAUNCH on / off), beside cuDNN, for DEPENDENT_CELLS."""
    from mhattn.backends.triton import decode_launch

    impls = ("triton", "kvcache", "paged")
    header = f"{'B':>3} {'Nk':>6} {'cuDNN':>7}  " + "  ".join(f"{name + ' dep / after':>22}" for name in impls)
    lines = ["== the combine as a dependent launch: us per step (on / off), d = 128, bf16, Nq = 1 ==", header]
    before = decode_launch.DEPENDENT_LAUNCH
    try:
        for batch, seqlen_k in DEPENDENT_CELLS:
            cell = decode_bench.DecodeCell("bf16", batch, seqlen_k, 1)
            cudnn = decode_bench.time_cell(cell, ("sdpa-cudnn",), settings, device)["us"]["sdpa-cudnn"]
            times = {}
            for on in (True, False):
                decode_launch.DEPENDENT_LAUNCH = on
                times[on] = decode_bench.time_cell(cell, impls, settings, device)["us"]
            lines.append(f"{batch:>3} {seqlen_k:>6} {_us(cudnn):>7}  " + "  ".join(
                f"{_us(times[True].get(name)) + ' / ' + _us(times[False].get(name)):>22}" for name in impls))
            log(out_dir, lines[-1])
    finally:
        decode_launch.DEPENDENT_LAUNCH = before
    return lines


def kept_partials(device, out_dir, cells=KEPT_PARTIALS_CELLS):
    """Host loops (300 steps, one synchronize; seven rounds in turns, the best of each) of dense decoding through
    mhattn.attention and of attention_with_kvcache over a contiguous cache on the Triton backend, with the split
    partials kept (decode_launch.split_partials) and made at each step (two allocations, as before they were kept),
    beside SDPA's default path (bf16, Hq 32, Hkv 8, d 128, Nq 1). Outputs checked against SDPA first."""
    import mhattn
    import torch.nn.functional as F
    from mhattn.backends.base import KVCache
    from mhattn.backends.triton import decode_launch
    from mhattn.benchmark import latency

    kept = decode_launch.split_partials

    def allocated(device, device_index, rows, splits, head_dim_v):
        return (torch.empty(rows, splits, head_dim_v, dtype=torch.float32, device=device),
                torch.empty(rows, splits, dtype=torch.float32, device=device))

    switched = functools.partial(_replaced, decode_launch, "split_partials")

    lines = ["== split partials kept per stream / allocated per step: host loop us per step, bf16 (the CPU: fp16), "
             "d = 128, Nq = 1 ==",
             f"{'B':>3} {'Nk':>6} {'sdpa':>7} {'dense kept':>11} {'dense alloc':>12} {'cache kept':>11} "
             f"{'cache alloc':>12}"]
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16  # (Triton's interpreter: no bfloat16)
    for batch, seqlen_k in cells:
        q = torch.randn(batch, 32, 1, 128, device=device, dtype=dtype)
        k, v = (torch.randn(batch, 8, seqlen_k, 128, device=device, dtype=dtype) for _ in range(2))
        seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)
        cache = KVCache(k, v, seqlens)
        dense = lambda: mhattn.attention(q, k, v, enable_gqa=True, backend="triton")  # noqa: E731
        cached = lambda: mhattn.attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=cache.seqlens,  # noqa: E731
                                                       backend="triton")
        expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).float()
        for fn in (dense, cached):
            for partials in (kept, allocated):
                with switched(partials):
                    error = (fn().float() - expected).abs().max().item()
                if error > 2e-2:
                    raise AssertionError(f"B={batch} Nk={seqlen_k}: max error {error} against SDPA")
        calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                 "dense kept": dense, "dense alloc": dense, "cache kept": cached, "cache alloc": cached}
        contexts = {name: functools.partial(switched, allocated if name.endswith("alloc") else kept) for name in calls}
        best, errors = latency.host_loops_in_turn(calls, 300, device, 7, contexts)
        if errors:
            raise next(iter(errors.values()))
        lines.append(f"{batch:>3} {seqlen_k:>6} " + " ".join(
            f"{best[name]:{width}.1f}" for name, width in (("sdpa", 7), ("dense kept", 11), ("dense alloc", 12),
                                                            ("cache kept", 11), ("cache alloc", 12))))
        log(out_dir, lines[-1])
    return lines


def append_steps(device, out_dir, cells=APPEND_CELLS, block_size=APPEND_BLOCK, steps=300, rounds=7):
    """Host loops (``steps`` steps, one synchronize; ``rounds`` rounds in turns, the best of each) of decoding steps
    through attention_with_kvcache that append one token at position Nk - 1, over a contiguous cache and a paged one (a
    shuffled pool of ``block_size``-key blocks holding the same keys), on the Triton backend four ways: the step it
    prepared for the call signature (TritonBackend.kvcache_call, appending inside the split kernel: as shipped), the
    same step worked out at every call (forward_kvcache_appending), its append kernel (append_kvcache; the step then
    attends through forward_kvcache) and torch's indexing (the front end's, what a backend with none of these gets);
    beside the dense step over the same Nk keys through mhattn.attention and SDPA's default path (bf16, Hq 32, Hkv 8,
    d 128, Nq 1). First checked: the four leave the same caches, and the steps give SDPA's output over the appended
    keys."""
    import mhattn
    import mhattn.decode as decode_module
    import torch.nn.functional as F
    from mhattn.backends.triton.backend import TritonBackend
    from mhattn.benchmark import latency

    ways = ("prepared", "split", "kernel", "indexing")
    declining = {"split": ("kvcache_call",), "kernel": ("kvcache_call", "forward_kvcache_appending"),
                 "indexing": ("kvcache_call", "forward_kvcache_appending", "append_kvcache")}

    @contextlib.contextmanager
    def appending(way: str):
        declined = lambda self, *args: None  # noqa: E731
        decode_module._known_calls.clear()  # (it keeps each signature's prepared step)
        with contextlib.ExitStack() as stack:
            for method in declining.get(way, ()):
                stack.enter_context(_replaced(TritonBackend, method, declined))
            yield
        decode_module._known_calls.clear()

    columns = [("sdpa", 7), ("dense", 7)] + [(f"{cache} {way}", 14) for cache in ("cache", "paged") for way in ways]
    lines = ["== the KV cache's append: a prepared step / the same step worked out per call (both append inside the "
             "split kernel) / the append kernel / torch's indexing: host loop us per step, bf16 (the CPU: fp16), "
             "d = 128, Nq = 1 ==",
             f"{'B':>3} {'Nk':>6} " + " ".join(f"{name:>{width}}" for name, width in columns)]
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16  # (Triton's interpreter: no bfloat16)
    generator = torch.Generator(device=device).manual_seed(0)
    for batch, seqlen_k in cells:
        def randn(*shape):
            return torch.randn(*shape, device=device, dtype=dtype, generator=generator)

        capacity = -(-seqlen_k // block_size) * block_size
        q, new_k, new_v = randn(batch, 32, 1, 128), randn(batch, 8, 1, 128), randn(batch, 8, 1, 128)
        k_cache, v_cache = randn(batch, 8, capacity, 128), randn(batch, 8, capacity, 128)
        blocks = capacity // block_size
        table = torch.randperm(batch * blocks, device=device, generator=generator).to(torch.int32).view(batch, blocks)
        pool_k, pool_v = (torch.empty(batch * blocks, 8, block_size, 128, device=device, dtype=dtype) for _ in range(2))
        for b in range(batch):
            for j in range(blocks):
                rows = slice(j * block_size, (j + 1) * block_size)
                pool_k[int(table[b, j])], pool_v[int(table[b, j])] = k_cache[b, :, rows], v_cache[b, :, rows]
        seqlens = torch.full((batch,), seqlen_k - 1, dtype=torch.int32, device=device)
        k_view, v_view = k_cache[:, :, :seqlen_k], v_cache[:, :, :seqlen_k]
        contiguous = lambda: mhattn.attention_with_kvcache(q, k_cache, v_cache, new_k, new_v, seqlens,  # noqa: E731
                                                           backend="triton")
        paged = lambda: mhattn.attention_with_kvcache(q, pool_k, pool_v, new_k, new_v, seqlens, table,  # noqa: E731
                                                      backend="triton")
        dense = lambda: mhattn.attention(q, k_view, v_view, enable_gqa=True, backend="triton")  # noqa: E731
        sdpa = lambda: F.scaled_dot_product_attention(q, k_view, v_view, enable_gqa=True)  # noqa: E731

        caches, tensors = {}, (k_cache, v_cache, pool_k, pool_v)
        originals = [t.clone() for t in tensors]
        for way in ways:
            for tensor, original in zip(tensors, originals):  # each append starts from the same caches
                tensor.copy_(original)
            with appending(way):
                outs = [step().float() for step in (contiguous, paged)]
            caches[way] = [t.clone() for t in tensors]
            expected = sdpa().float()
            for out in outs:
                error = (out - expected).abs().max().item()
                if error > 2e-2:
                    raise AssertionError(f"B={batch} Nk={seqlen_k} ({way}): max error {error} against SDPA")
        for way in ways[1:]:
            if not all(torch.equal(a, b) for a, b in zip(caches[ways[0]], caches[way])):
                raise AssertionError(f"B={batch} Nk={seqlen_k}: appending by {way} left other caches")
        if any(torch.equal(a, b) for a, b in zip(caches[ways[0]], originals)):
            raise AssertionError(f"B={batch} Nk={seqlen_k}: a step left a cache as it was")
        calls = {"sdpa": sdpa, "dense": dense}
        contexts = {}
        for way in ways:
            for cache, step in (("cache", contiguous), ("paged", paged)):
                calls[f"{cache} {way}"] = step
                contexts[f"{cache} {way}"] = functools.partial(appending, way)
        best, errors = latency.host_loops_in_turn(calls, steps, device, rounds, contexts)
        if errors:
            raise next(iter(errors.values()))
        lines.append(f"{batch:>3} {seqlen_k:>6} " + " ".join(f"{best[name]:{width}.1f}" for name, width in columns))
        log(out_dir, lines[-1])
    return lines


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    """``owner.name`` (a module's function, a class's method) set to ``value`` inside the block: one side of an A/B
    timed in turns."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _us(value) -> str:
    return "-" if value is None else f"{value:.0f}"


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (to test the script on the CPU)")
    parser.add_argument("--dtype", default="bf16,fp16")
    parser.add_argument("--sweep-tiles", action="store_true", help="only the split-KV tile sweep at d = 128")
    parser.add_argument("--sweep-splits", action="store_true", help="only the split-count sweep at d = 128")
    parser.add_argument("--dependent-launch", action="store_true",
                        help="only decoding with the combine as a dependent launch and after the splits")
    parser.add_argument("--kept-partials", action="store_true",
                        help="only host loops of short decoding steps with the split partials kept and allocated")
    parser.add_argument("--padded-decode", action="store_true",
                        help="only decoding steps with a left-padding key mask, on the split-KV kernels and others")
    parser.add_argument("--padded-prefill", action="store_true",
                        help="only the forward of prompts padded on the left, with and without the Gluon kernels")
    parser.add_argument("--backward", action="store_true",
                        help="with --padded-prefill: forward+backward (a training step's attention) instead")
    parser.add_argument("--deterministic", action="store_true",
                        help="with --padded-prefill --backward: under torch.use_deterministic_algorithms(True) (the "
                             "backwards' deterministic builds; warn_only, for SDPA's)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="with --padded-prefill: each call's dropout_p (checked against the FlashAttention-2 "
                             "kernels under the same seed)")
    parser.add_argument("--append", action="store_true",
                        help="only host loops of KV-cache steps appending by the Triton kernel and by torch's indexing")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    if args.sweep_tiles:
        for line in sweep_tiles(device, timing.TimingSettings(10.0, 40.0), out_dir):
            log(out_dir, line)
        return 0
    if args.kept_partials:
        for line in kept_partials(device, out_dir, ((1, 64), (2, 100)) if args.tiny else KEPT_PARTIALS_CELLS):
            log(out_dir, line)
        return 0
    if args.append:
        cells = ((1, 64), (2, 100)) if args.tiny else APPEND_CELLS
        shape = dict(block_size=16, steps=2, rounds=1) if args.tiny else {}
        for line in append_steps(device, out_dir, cells, **shape):
            log(out_dir, line)
        return 0
    if args.padded_decode:
        cells = ((2, 64), (3, 100)) if args.tiny else PADDED_DECODE_CELLS
        settings = timing.TimingSettings(1.0, 2.0) if args.tiny else timing.TimingSettings(10.0, 40.0)
        for line in padded_decode(device, settings, out_dir, cells, args.tiny):
            log(out_dir, line)
        return 0
    if args.padded_prefill:
        cells = ((2, 64), (3, 100)) if args.tiny else PADDED_PREFILL_CELLS
        settings = timing.TimingSettings(1.0, 2.0) if args.tiny else timing.TimingSettings(10.0, 40.0)
        if args.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        for line in padded_prefill(device, settings, out_dir, cells, args.tiny, args.backward, args.dropout):
            log(out_dir, line)
        return 0
    if args.dependent_launch:
        for line in sweep_dependent_launch(device, timing.TimingSettings(10.0, 40.0), out_dir):
            log(out_dir, line)
        return 0
    if args.sweep_splits:
        for line in sweep_splits(device, timing.TimingSettings(10.0, 40.0), out_dir):
            log(out_dir, line)
        return 0
    started = time.monotonic()
    dtypes = [d for d in args.dtype.split(",") if d]
    if args.tiny:
        cells = decode_bench.decode_cells(dtypes=dtypes, batches=(1, 2), seqlens_k=(64, 100), query_rows=(1, 4),
                                          head_dim=16, block_size=16)
        settings = timing.TimingSettings(1.0, 2.0)
    else:
        cells = decode_bench.decode_cells(dtypes=dtypes)
        settings = timing.TimingSettings(10.0, 40.0)
    if device.type == "cuda":
        log(out_dir, f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")

    summary = []
    for name in dtypes:
        dtype = decode_bench.DTYPES[name]
        lines = check_outputs(device, dtype, args.tiny)
        log(out_dir, f"outputs, {name}:\n" + "\n".join(lines))

    rows = []
    for i, cell in enumerate(cells):
        row = decode_bench.time_cell(cell, decode_bench.IMPLS, settings, device)
        rows.append(row)
        us = row["us"]
        log(out_dir, f"[{i + 1}/{len(cells)}] {cell.label()}: " + ", ".join(
            f"{k} {'-' if t is None else f'{t:.1f} us'}" for k, t in us.items()))
    decode_text = decode_bench.decode_table(rows)

    varlen_rows = []
    for name in dtypes:
        lines, row = varlen_section(device, decode_bench.DTYPES[name], settings, args.tiny)
        varlen_rows.append(row)
        summary += lines
    summary += key_padding_section(device, decode_bench.DTYPES[dtypes[0]], settings, args.tiny)
    if out_dir:
        with open(os.path.join(out_dir, "check_inference.json"), "w") as f:
            json.dump({"decode": rows, "varlen": varlen_rows}, f, indent=1)

    worst = [r for r in rows if r["us"].get("triton") and r["us"].get("sdpa")]
    log(out_dir, "")
    log(out_dir, f"== decode (Hq=32, Hkv=8, d=128; paged block {cells[0].block_size}; us, x = sdpa time / triton "
                 f"time; GB/s = KV bytes / time of the faster triton column) ==")
    log(out_dir, decode_text.rstrip())
    if worst:
        ratio = min(r["us"]["sdpa"] / r["us"]["triton"] for r in worst)
        log(out_dir, f"lowest x sdpa (default): {ratio:.2f}")
    log(out_dir, "")
    log(out_dir, "== varlen, key padding ==")
    for line in summary:
        log(out_dir, line)
    log(out_dir, f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
