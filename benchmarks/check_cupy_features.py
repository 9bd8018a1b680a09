"""GPU check of the CuPy backend's feature variants (softcap, float mask and its gradient, Dv != D, any head dim).

Run on an H100 from the repo root (about 3 minutes):

    source benchmarks/device_env.sh && python3 benchmarks/check_cupy_features.py

1. compiles the sm_XX variants into the kernel cache in parallel (``mhattn build``), so nothing below waits
   for NVRTC;
2. runs the feature cases of the GPU tests (tests/test_cupy_backend.py, both backward modes, fp16 and bf16,
   the deterministic backward with every feature);
3. times forward and forward + backward of each feature against the same problem without it (bf16, d = 128,
   N = 4096, B*N = 16384, 16 heads; do_bench median) and prints the table last: TFLOP/s and the ratio to the
   plain problem. The plain rows run the variants without feature flags, whose code the features left alone.

Logs go to $OUT (default /tmp/mhattn_cupy_features): build.log, tests.log, timings.txt.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("OUT", "/tmp/mhattn_cupy_features"))
TESTS = ("softcap or float_mask or value_dim or odd_dim or dim_1 or everything or deterministic")
SEQLEN, TOKENS, HIDDEN, HEAD_DIM = 4096, 16384, 2048, 128


def run_logged(cmd, log_name, timeout):
    start = time.perf_counter()
    with open(OUT / log_name, "w") as log:
        try:
            code = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    tail = (OUT / log_name).read_text().strip().splitlines()[-1:] or [""]
    print(f"{' '.join(cmd[:6])} ...: exit {code} in {time.perf_counter() - start:.0f} s; {tail[0]}", flush=True)
    return code


def problems():
    """(name, head_dim_v, head_dim, feature kwargs for AttentionParams, mask kind (None; "float": (B, 1, N, N); "bool":
    key padding (B, 1, 1, N) hiding about a quarter of the keys; "float_pad": the same as an additive bias, 0 or the
    dtype's minimum, as Hugging Face models pass it), mask requires grad?)"""
    return [
        ("plain", HEAD_DIM, HEAD_DIM, {}, None, False),
        ("softcap 30", HEAD_DIM, HEAD_DIM, {"softcap": 30.0}, None, False),
        ("key padding (B,1,1,N) bool", HEAD_DIM, HEAD_DIM, {}, "bool", False),
        ("key padding (B,1,1,N) float", HEAD_DIM, HEAD_DIM, {}, "float_pad", False),
        ("float mask (B,1,N,N)", HEAD_DIM, HEAD_DIM, {}, "float", False),
        ("float mask + grad", HEAD_DIM, HEAD_DIM, {}, "float", True),
        ("Dv 64 (ANY_DIMS, cp.async)", 64, HEAD_DIM, {}, None, False),
        ("d 100 (ANY_DIMS, element)", 100, 100, {}, None, False),
    ]


def timings(lines, backend=None, device="cuda", bench=None, seqlen=SEQLEN, tokens=TOKENS, hidden=HIDDEN):
    """Appends the table's rows to ``lines``. The arguments other than ``lines`` let a CPU dry run (kernel
    emulator, tiny sizes, one call instead of do_bench) check the script without a GPU."""
    from mhattn.backends.base import AttentionParams
    from mhattn.backends.cupy import CupyBackend

    if bench is None:
        from triton.testing import do_bench

        def bench(fn):
            return do_bench(fn, warmup=25, rep=100, return_mode="median")

    # the default (atomic dQ) backward; with a mask gradient it runs the dQ kernel
    backend = backend or CupyBackend()
    batch, heads = max(1, tokens // seqlen), max(1, hidden // HEAD_DIM)
    base = {}
    header = f"{'problem':28} {'causal':6} {'fwd TF/s':>9} {'ratio':>6} {'f+b TF/s':>9} {'ratio':>6}"
    lines.append(header)
    for causal in (False, True):
        for name, d_v, d, extra, mask_kind, mask_grad in problems():
            gen = torch.Generator(device=device).manual_seed(0)
            q, k = (torch.randn(batch, heads, seqlen, d, device=device, dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))
            v, do = (torch.randn(batch, heads, seqlen, d_v, device=device, dtype=torch.bfloat16, generator=gen)
                     for _ in range(2))
            mask = None
            if mask_kind == "float":
                mask = torch.randn(batch, 1, seqlen, seqlen, device=device, dtype=torch.bfloat16,
                                   generator=gen).expand(batch, heads, seqlen, seqlen)
            if mask_kind in ("bool", "float_pad"):
                mask = (torch.rand(batch, 1, 1, seqlen, device=device, generator=gen) > 0.25).expand(
                    batch, heads, seqlen, seqlen)
            if mask_kind == "float_pad":
                mask = torch.zeros(mask.shape, device=device, dtype=torch.bfloat16).masked_fill(
                    ~mask, torch.finfo(torch.bfloat16).min)[:, :1, :1].expand(batch, heads, seqlen, seqlen)
            params = AttentionParams(scale=d ** -0.5, window_right=0 if causal else None, mask=mask,
                                     mask_requires_grad=mask_grad, **extra)

            def fwd():
                return backend.forward(q, k, v, params)

            def fwd_bwd():
                out, lse = backend.forward(q, k, v, params)
                backend.backward(do, q, k, v, out, lse, params)

            flops = 2.0 * batch * heads * seqlen * seqlen * (d + d_v) * (0.5 if causal else 1.0)
            ms_f, ms_fb = bench(fwd), bench(fwd_bwd)
            tf_f, tf_fb = flops / ms_f * 1e-9, 3.5 * flops / ms_fb * 1e-9
            if name == "plain":
                base[causal] = (tf_f, tf_fb)
            lines.append(f"{name:28} {str(causal):6} {tf_f:9.1f} {tf_f / base[causal][0]:6.2f} {tf_fb:9.1f} "
                         f"{tf_fb / base[causal][1]:6.2f}")
            print(lines[-1], flush=True)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    jobs = str(os.cpu_count() or 1)
    build = run_logged([sys.executable, "-m", "mhattn.cli", "build", "--arch", arch, "-j", jobs], "build.log", 150)
    tests = run_logged([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_cupy_backend.py", "-k", TESTS,
                        "-p", "no:cacheprovider"], "tests.log", 120)
    lines = [f"{torch.cuda.get_device_name()}, bf16, d={HEAD_DIM}, N={SEQLEN}, B*N={TOKENS}, "
             f"{HIDDEN // HEAD_DIM} heads; f+b counts 3.5x the forward FLOPs; ratio to 'plain'"]
    timings(lines)
    lines.append(f"build exit {build}, feature GPU tests exit {tests} (logs in {OUT})")
    (OUT / "timings.txt").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    return 0 if build == 0 and tests == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
