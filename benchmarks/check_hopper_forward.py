"""GPU check of the Triton backend's Gluon Hopper forward (backends/triton/hopper_forward.py), on an sm_90 GPU:

    source benchmarks/device_env.sh && cd /tmp && python3 $OLDPWD/benchmarks/check_hopper_forward.py [--dtype fp16|bf16]

1. the kernel launched directly on ragged shapes (fp16 and bf16; d 64, 128, 256; GQA; Nq > Nk; one key; one
   query; causal top-left and bottom-right, rows that see no key) against a float64 reference, outputs
   poisoned with NaN before the launch: prints the failures and their count;
2. the protocol's shapes (B * N = 16384, H = 2048 / d; d 64, 128, 256; N 1k, 4k, 16k; causal and not), forward
   TFLOP/s from do_bench medians beside sdpa-cudnn in the same run: the kernel alone, the Triton backend as
   it chooses (``mhattn.attention(backend="triton")``), and the FlashAttention-2 kernel
   (``MHATTN_TRITON_HOPPER=0``). The table is printed last.
"""

import argparse
import math
import os

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import mhattn
from mhattn.backends.triton import hopper_forward, hopper_launch
from mhattn.backends.triton.backend import _ensure_descriptor_allocator

LOG2E = 1.4426950408889634
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (B, Hq, Hkv, Nq, Nk) of the correctness pass.
RAGGED_SHAPES = ((2, 4, 4, 300, 517), (1, 8, 2, 1000, 1000), (2, 2, 1, 129, 64), (1, 2, 2, 64, 1), (1, 2, 2, 1, 300),
                 (1, 3, 3, 1500, 700))


def launch(q, k, v, causal, diag_offset, poison=True):
    """The kernel alone, with the launch constants of hopper_launch: (out, lse)."""
    _ensure_descriptor_allocator()
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    make = torch.full_like if poison else (lambda t, _: torch.empty_like(t))
    out = make(q, float("nan"))
    lse = make(q[..., 0].float(), float("nan"))
    num_m_blocks = triton.cdiv(seqlen_q, 2 * hopper_launch.QUERY_ROWS_PER_CONSUMER)
    hopper_forward.hopper_forward_kernel[(batch * heads_q * num_m_blocks,)](
        q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        lse.stride(0), lse.stride(1), heads_q, heads_q // heads_kv, seqlen_q, seqlen_k, num_m_blocks,
        LOG2E / math.sqrt(head_dim), diag_offset,
        **hopper_launch.compile_time_args(head_dim, causal), num_warps=4)
    return out, lse


def reference(q, k, v, causal, diag_offset):
    """(out, lse) in float64; rows that see no key give out 0 and lse -inf."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        rows = torch.arange(q.shape[2], device=q.device)[:, None]
        cols = torch.arange(k.shape[2], device=q.device)[None]
        scores = scores.masked_fill(cols > rows + diag_offset, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ vd, torch.logsumexp(scores, -1)


def correctness() -> int:
    torch.manual_seed(0)
    failures = 0
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in sorted(hopper_launch.KEY_BLOCK):
            for batch, heads_q, heads_kv, seqlen_q, seqlen_k in RAGGED_SHAPES:
                for causal, diag_offset in ((False, 0), (True, 0), (True, seqlen_k - seqlen_q)):
                    q = torch.randn(batch, heads_q, seqlen_q, head_dim, device="cuda", dtype=dtype)
                    k = torch.randn(batch, heads_kv, seqlen_k, head_dim, device="cuda", dtype=dtype)
                    v = torch.randn(batch, heads_kv, seqlen_k, head_dim, device="cuda", dtype=dtype)
                    out, lse = launch(q, k, v, causal, diag_offset)
                    ref_out, ref_lse = reference(q, k, v, causal, diag_offset)
                    out_err = (out.double() - ref_out).abs().max().item()
                    seen = torch.isfinite(ref_lse)
                    lse_err = (lse.double()[seen] - ref_lse[seen]).abs().max().item() if seen.any() else 0.0
                    empty_rows_ok = bool((lse[~seen] == float("-inf")).all())
                    bound = 2e-2 if dtype == torch.bfloat16 else 4e-3  # a few units in the last place of |out| <~ 1
                    if not (out_err < bound and lse_err < 1e-3 and empty_rows_ok and not torch.isnan(out).any()):
                        failures += 1
                        print(f"FAIL {dtype} d={head_dim} (B,Hq,Hkv,Nq,Nk)={(batch, heads_q, heads_kv, seqlen_q, seqlen_k)} "
                              f"causal={causal} diag={diag_offset}: out err {out_err:.3g}, lse err {lse_err:.3g}, "
                              f"empty rows ok {empty_rows_ok}", flush=True)
    print(f"correctness: {failures} failures", flush=True)
    return failures


def timing(dtype):
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100)  # noqa: E731
    rows = []
    for head_dim in sorted(hopper_launch.KEY_BLOCK):
        for seqlen in (1024, 4096, 16384):
            for causal in (False, True):
                batch, heads = 16384 // seqlen, 2048 // head_dim
                q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype) for _ in range(3))
                flops = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                kernel = bench(lambda: launch(q, k, v, causal, 0, poison=False))
                backend = bench(lambda: mhattn.attention(q, k, v, is_causal=causal, backend="triton"))
                os.environ[hopper_launch.ENV_SWITCH] = "0"
                try:
                    flash2 = bench(lambda: mhattn.attention(q, k, v, is_causal=causal, backend="triton"))
                finally:
                    del os.environ[hopper_launch.ENV_SWITCH]
                rows.append((head_dim, seqlen, causal, *(flops / ms / 1e9 for ms in (cudnn, kernel, backend, flash2)),
                             cudnn / kernel))
                print(rows[-1], flush=True)
    name = str(dtype).replace("torch.", "")
    print(f"\n{name} forward, TFLOP/s (same run)\n")
    print("| d | N | causal | sdpa-cudnn | Gluon kernel | triton backend | FlashAttention-2 kernel | Gluon/cuDNN |")
    print("|---|---|---|---|---|---|---|---|")
    for d, n, causal, cudnn, kernel, backend, flash2, ratio in rows:
        print(f"| {d} | {n} | {'yes' if causal else 'no'} | {cudnn:.0f} | {kernel:.0f} | {backend:.0f} | {flash2:.0f} | "
              f"{ratio:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="of the timing table")
    parser.add_argument("--timing-only", action="store_true")
    args = parser.parse_args()
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    if not args.timing_only:
        correctness()
    timing(DTYPES[args.dtype])


if __name__ == "__main__":
    main()
