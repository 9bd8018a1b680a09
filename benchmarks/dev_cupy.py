"""Development harness for the CUDA C++ (CuPy) backend on a GPU: compile, test, sweep tiles, and time
against sdpa-flash in the same run on PERFORMANCE.md's protocol.

    source benchmarks/device_env.sh
    python3 benchmarks/dev_cupy.py build tests sweep tests_tuned table memory --out $OUT --budget 380

Sections (in the order given; each is skipped once the time budget is spent):

- ``build``: every variant for this GPU compiled by NVRTC in parallel processes (fills the kernel cache).
- ``tests``: ``pytest tests/test_cupy_backend.py -m gpu`` in a child process (a crashed kernel cannot
  take the timing process down); its log goes to --out.
- ``sweep``: at N = 4k, d in 64, 128, causal off/on: forward tiles, then dK/dV tiles and dQ tiles of the
  deterministic backward, then the dK/dV tiles of the fast (atomic dQ) backward; the winners are used by
  the later sections and printed as entries for variants.py.
- ``tests_tuned``: the GPU tests again with the sweep's tiles (passed through MHATTN_CUPY_TILES).
- ``table``: bf16, B * N = 16384, H = 2048 / d, N in 512..16k, d in 64, 128 (and 256 for a few N):
  forward and backward TFLOP/s of the backend (deterministic and fast backward) and of SDPA with
  FLASH_ATTENTION on the same inputs, timed with triton.testing.do_bench (median); ratios.
- ``memory``: peak extra memory of forward + backward, causal, B = 1, H = 16, d = 128, N = 8k and 32k.

The short table prints last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import tempfile
import sys
import time
import traceback

import torch

TOKENS, HIDDEN = 16384, 2048
SWEEP_N = 4096
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Candidate tiles; the first of each list is the variants.py entry (for the forward at d=128, the plain
# level's; the masked levels use FWD_TILES_BOUNDED).
FWD_CANDIDATES = {  # block_m, block_n, num_warps, q_in_regs
    64: [(128, 64, 4, True), (128, 128, 4, False), (128, 32, 4, True), (128, 128, 8, True)],
    128: [(128, 32, 4, False), (128, 64, 4, False), (128, 64, 8, True), (64, 64, 4, True), (64, 32, 4, True),
          (64, 128, 4, True)],
    256: [(128, 64, 8, False), (128, 32, 8, False), (64, 32, 4, False), (64, 16, 4, False)],
}
# dK/dV: 5 fields = the one-dimensional kernel (block_n, block_m, num_warps, kv_in_regs, split; 32 keys per warp
# where block_n = 32 warps); 7 fields = the two-dimensional kernel (block_n, block_m, num_warps, s_warps_n,
# kv_warps_n, dq_warps_m, kv_in_regs). The first entry is the variants.py one of the deterministic table.
DKDV_CANDIDATES = {
    64: [(128, 32, 4, False, False), (128, 64, 8, 4, 4, 2, False), (128, 64, 8, 4, 4, 2, True),
         (128, 128, 8, 4, 4, 2, False), (64, 64, 4, 2, 2, 2, False), (128, 64, 8, 4, 8, 2, False)],
    128: [(128, 64, 8, 4, 4, 2, False), (128, 64, 8, False, False), (128, 64, 8, 4, 4, 4, False),
          (128, 64, 8, 2, 4, 2, False), (128, 32, 8, 8, 4, 2, False)],
    96: [(128, 64, 8, 4, 4, 4, False), (64, 32, 4, False, False)],
    192: [(64, 64, 8, 2, 4, 4, False), (64, 32, 4, False, True), (64, 32, 8, 4, 4, 2, False)],
    256: [(64, 64, 8, 2, 4, 2, False), (64, 32, 4, False, True), (64, 32, 8, 4, 4, 2, False),
          (64, 64, 8, 4, 4, 4, False)],
}
DQ_CANDIDATES = {  # block_m, block_n, num_warps, q_in_regs (32 query rows per warp where block_m = 32 warps)
    64: [(128, 32, 4, True), (64, 32, 4, True), (64, 64, 4, True), (128, 64, 4, False), (128, 64, 8, True)],
    128: [(128, 32, 4, False), (64, 64, 4, False), (128, 64, 8, False), (64, 32, 4, False), (128, 16, 4, False)],
}

LOG_PATH = None


def log(text=""):
    print(text, flush=True)
    if LOG_PATH:
        with open(LOG_PATH, "a") as f:
            f.write(text + "\n")


# ---- problems and timing -------------------------------------------------------------------------------


def protocol_inputs(seqlen, head_dim, dtype=torch.bfloat16):
    batch, heads = max(1, TOKENS // seqlen), HIDDEN // head_dim
    gen = torch.Generator(device="cuda").manual_seed(seqlen * 1000 + head_dim)
    q, k, v, do = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype, generator=gen)
                   for _ in range(4))
    return q, k, v, do


def fwd_flops(q, causal):
    batch, heads, seqlen, head_dim = q.shape
    flops = 4.0 * batch * heads * seqlen * seqlen * head_dim
    return flops / 2 if causal else flops


def bench(fn, grads=None):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")  # milliseconds


def params_for(head_dim, causal):
    from mhattn.backends.base import AttentionParams

    return AttentionParams(scale=head_dim ** -0.5, window_right=0 if causal else None)


class Ours:
    """Direct calls into the backend (no autograd): forward, and forward + backward."""

    def __init__(self, deterministic=True):
        from mhattn.backends.cupy import CupyBackend

        self.backend = CupyBackend(deterministic=deterministic)

    def fwd(self, q, k, v, params):
        return lambda: self.backend.forward(q, k, v, params)

    def fwd_bwd(self, q, k, v, do, params):
        def run():
            out, lse = self.backend.forward(q, k, v, params)
            self.backend.backward(do, q, k, v, out, lse, params)

        return run


def sdpa_fns(q, k, v, do, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

    def fwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd_bwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        out.backward(do)

    return fwd, fwd_bwd, leaves


# ---- sections ---------------------------------------------------------------------------------------------


def _compile_task(task):
    variant, cc = task
    from mhattn.backends.cupy import compiler

    try:
        compiler.cubin_path(variant, cc)
        return None
    except Exception as error:
        return f"{variant.label}: {error}"


def precompile(variant_list, cc, jobs=None):
    from concurrent.futures import ProcessPoolExecutor

    unique = list(dict.fromkeys(variant_list))
    start = time.time()
    with ProcessPoolExecutor(max_workers=jobs or os.cpu_count()) as pool:
        errors = [e for e in pool.map(_compile_task, [(v, cc) for v in unique]) if e]
    log(f"compiled {len(unique)} variants in {time.time() - start:.1f} s, {len(errors)} failed")
    for e in errors:
        log("  " + e[:2000])
    return not errors


def section_build(args, cc):
    from mhattn.backends.cupy import variants

    return precompile(variants.all_variants(cc), cc)


def section_tests_tuned(args, cc):
    """The GPU tests again, with the tiles the sweep chose (MHATTN_CUPY_TILES set by the sweep)."""
    from mhattn.backends.cupy import variants

    precompile(variants.all_variants(cc), cc)  # the tables now hold the sweep's tiles
    return section_tests(args, cc, log_name="pytest_gpu_tuned.log")


def section_tests(args, cc, log_name="pytest_gpu.log"):
    out = os.path.join(args.out, log_name) if args.out else None
    cmd = [sys.executable, "-m", "pytest", os.path.join(REPO, "tests", "test_cupy_backend.py"), "-m", "gpu", "-q",
           "-p", "no:cacheprovider", "-rf"] + (["-x"] if args.exitfirst else [])
    start = time.time()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.test_timeout,
                             cwd=tempfile.gettempdir())  # not the repo root: its mhattn/ would shadow the package
        text, code = run.stdout + run.stderr, run.returncode
    except subprocess.TimeoutExpired as error:
        partial = error.stdout or b""
        text = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
        code = "timeout"
    if out:
        with open(out, "w") as f:
            f.write(text)
    lines = text.strip().splitlines()
    log(f"pytest -m gpu ({log_name}): exit {code} in {time.time() - start:.0f} s")
    for line in [l for l in lines if l.startswith("FAILED") or "Error" in l][:40] + lines[-3:]:
        log("  " + line[:600])
    return code == 0


def _fit(kind, d, tiles, cc):
    from mhattn.backends.cupy import variants

    smem = {"fwd": variants.fwd_smem, "dkdv": lambda t, dd: variants.dkdv_smem(t, dd, True),
            "dq": variants.dq_smem}[kind](tiles, d)
    return smem <= variants.smem_limit(cc)


def kernel_report(kind, d, tiles, cc):
    """Registers and local (spill) bytes of the compiled variants of a candidate, from the loaded kernels."""
    from mhattn.backends.cupy import variants
    from mhattn.backends.cupy.launcher import CupyLauncher

    launcher = CupyLauncher()
    out = []
    for level in ("plain", "bounds"):
        if kind == "fwd":
            vs = [variants.fwd_variant(cc, "bfloat16", d, level, tiles=tiles)]
        elif kind == "dq":
            vs = [variants.dq_variant(cc, "bfloat16", d, level, tiles=tiles)]
        else:
            vs = variants.dkdv_variants(cc, "bfloat16", d, level, tiles=tiles, atomic_dq=kind == "dkdv-fast")
        for v in vs:
            try:
                k = launcher.kernel(v, torch.cuda.current_device(), cc)
                out.append(f"{level[0]}:{k.num_regs}r/{k.local_size_bytes}B")
            except Exception as error:
                out.append(f"{level[0]}:? ({type(error).__name__})")
    return "[" + " ".join(out) + "]"


def section_sweep(args, cc):
    """Per head dim, each kernel's candidates timed on the causal and the non-causal problem; the one with
    the smallest summed time wins (one table entry serves both)."""
    from mhattn.backends.cupy import variants

    tables = {"fwd": variants.FWD_TILES, "dkdv": variants.DKDV_TILES, "dq": variants.DQ_TILES,
              "dkdv-fast": variants.DKDV_ATOMIC_TILES}
    makers = {"fwd": variants.FwdTiles, "dkdv": variants.dkdv_tiles_from_fields, "dq": variants.DqTiles,
              "dkdv-fast": variants.dkdv_tiles_from_fields}
    cands = {"fwd": FWD_CANDIDATES, "dkdv": DKDV_CANDIDATES, "dq": DQ_CANDIDATES, "dkdv-fast": DKDV_CANDIDATES}

    def usable(kind, d, tiles):
        base = "dkdv" if kind == "dkdv-fast" else kind
        if not _fit(base, d, tiles, cc):
            return False
        return kind != "dkdv-fast" or variants.atomic_dq_possible(tiles, d)

    kinds = [k for k in cands if k in args.sweep_kinds]
    todo = []  # compile every candidate first, in parallel
    for d in args.sweep_dims:
        for level in ("plain", "bounds"):
            for kind in kinds:
                for c in cands[kind].get(d, []):
                    t = makers[kind](*c)
                    if not usable(kind, d, t):
                        continue
                    if kind == "fwd":
                        todo.append(variants.fwd_variant(cc, "bfloat16", d, level, tiles=t))
                    elif kind == "dq":
                        todo.append(variants.dq_variant(cc, "bfloat16", d, level, tiles=t))
                    else:
                        todo.extend(variants.dkdv_variants(cc, "bfloat16", d, level, tiles=t,
                                                           atomic_dq=kind == "dkdv-fast"))
    precompile(todo, cc)

    det, fast = Ours(True), Ours(False)
    for d in args.sweep_dims:
        q, k, v, do = protocol_inputs(SWEEP_N, d)
        problems = [(causal, params_for(d, causal), fwd_flops(q, causal)) for causal in (False, True)]
        fwd_ms = {causal: bench(det.fwd(q, k, v, params)) for causal, params, _ in problems}
        for kind in kinds:
            engine = fast if kind == "dkdv-fast" else det
            results, per_problem = [], {False: [], True: []}
            for c in cands[kind].get(d, []):
                t = makers[kind](*c)
                if not usable(kind, d, t):
                    continue
                saved = tables[kind][d]
                saved_bounded = variants.FWD_TILES_BOUNDED.get(d)
                tables[kind][d] = t
                if kind == "fwd":
                    variants.FWD_TILES_BOUNDED[d] = t
                try:
                    total, parts = 0.0, []
                    for causal, params, flops in problems:
                        if kind == "fwd":
                            ms = bench(det.fwd(q, k, v, params))
                            parts.append(f"{'causal' if causal else 'full'} {ms:.3f} ms {flops / ms / 1e9:.0f} TF")
                        else:
                            ms = bench(engine.fwd_bwd(q, k, v, do, params)) - fwd_ms[causal]
                            parts.append(f"{'causal' if causal else 'full'} bwd {ms:.3f} ms "
                                         f"{2.5 * flops / ms / 1e9:.0f} TF")
                        total += ms
                        per_problem[causal].append((ms, c))
                    results.append((total, c))
                    log(f"sweep d{d} {kind:9s} {c}: " + "; ".join(parts) + "  " + kernel_report(kind, d, t, cc))
                except Exception as error:
                    log(f"sweep d{d} {kind:9s} {c}: ERROR {type(error).__name__}: {error}")
                tables[kind][d] = saved
                if kind == "fwd":
                    if saved_bounded is None:
                        variants.FWD_TILES_BOUNDED.pop(d, None)
                    else:
                        variants.FWD_TILES_BOUNDED[d] = saved_bounded
            if kind == "fwd" and per_problem[False] and per_problem[True]:
                # the forward has a table per level: the unmasked and the causal problem choose separately
                tables["fwd"][d] = makers["fwd"](*min(per_problem[False])[1])
                variants.FWD_TILES_BOUNDED[d] = makers["fwd"](*min(per_problem[True])[1])
                log(f"sweep d{d} fwd       best {min(per_problem[False])[1]} (plain), "
                    f"{min(per_problem[True])[1]} (masked levels)")
            elif results:
                best = min(results)[1]
                tables[kind][d] = makers[kind](*best)
                log(f"sweep d{d} {kind:9s} best {best}")
            if kind == "fwd":
                for causal, params, _ in problems:
                    fwd_ms[causal] = bench(det.fwd(q, k, v, params))
        del q, k, v, do
    log("sweep result (variants.py entries):")
    winners = {}
    tables["fwd_bounded"] = variants.FWD_TILES_BOUNDED
    for kind, env_name in (("fwd", "fwd"), ("fwd_bounded", "fwd_bounded"), ("dkdv", "dkdv"), ("dq", "dq"),
                           ("dkdv-fast", "dkdv_atomic")):
        for d in args.sweep_dims:
            if d not in tables[kind]:
                continue
            log(f"  {kind:11s} d{d}: {tables[kind][d]}")
            winners.setdefault(env_name, {})[str(d)] = list(dataclasses.astuple(tables[kind][d]))
    os.environ[variants.TILES_ENV] = json.dumps(winners)  # the tuned tests run with these
    log(f"{variants.TILES_ENV}='{json.dumps(winners)}'")
    if args.out:
        with open(os.path.join(args.out, "tiles.json"), "w") as f:
            json.dump(winners, f, indent=1)
    return True


def section_table(args, cc, rows):
    det, fast = Ours(True), Ours(False)
    points = [(d, n, causal) for d in (64, 128) for n in (512, 1024, 2048, 4096, 8192, 16384) for causal in (False, True)]
    points += [(256, n, causal) for n in (1024, 4096, 16384) for causal in (False, True)]
    for d, n, causal in points:
        if time.time() > args.deadline:
            log(f"table: time budget spent, stopping before d={d} N={n}")
            break
        try:
            q, k, v, do = protocol_inputs(n, d)
            params = params_for(d, causal)
            flops = fwd_flops(q, causal)
            row = {"d": d, "n": n, "causal": causal}
            row["fwd_ms"] = bench(det.fwd(q, k, v, params))
            row["bwd_ms"] = bench(det.fwd_bwd(q, k, v, do, params)) - row["fwd_ms"]
            if d <= 128:
                row["bwd_fast_ms"] = bench(fast.fwd_bwd(q, k, v, do, params)) - row["fwd_ms"]
            s_fwd, s_fwd_bwd, leaves = sdpa_fns(q, k, v, do, causal)
            row["sdpa_fwd_ms"] = bench(s_fwd)
            row["sdpa_bwd_ms"] = bench(s_fwd_bwd, grads=leaves) - row["sdpa_fwd_ms"]
            for key in [k_ for k_ in list(row) if k_.endswith("_ms")]:
                mult = 2.5 if "bwd" in key else 1.0
                row[key.replace("_ms", "_tflops")] = mult * flops / row[key] / 1e9
            rows.append(row)
            log(json.dumps({k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in row.items()}))
            del q, k, v, do, leaves
        except Exception as error:
            log(f"table d={d} N={n} causal={causal}: ERROR {type(error).__name__}: {error}")
            traceback.print_exc()
    return True


def section_memory(args, cc):
    """Peak memory above the inputs (q, k, v, dO) of one forward + backward, causal, B=1, H=16, d=128."""
    import gc

    import mhattn
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def run(impl, n):
        q, k, v = (torch.randn(1, 16, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if impl == "cupy":
            out = mhattn.attention(q, k, v, is_causal=True, backend="cupy")
        else:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(do)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    for n in (8192, 32768):
        for impl in ("cupy", "sdpa-flash"):
            gc.collect()
            torch.cuda.empty_cache()
            try:
                log(f"memory N={n} {impl}: peak extra {run(impl, n):.0f} MiB (grads included)")
            except Exception as error:
                log(f"memory N={n} {impl}: ERROR {error}")
    return True


def print_table(rows):
    if not rows:
        return

    def num(x, digits=0):
        return "-" if x is None else f"{x:.{digits}f}"

    log("\nbf16, B*N=16384, H=2048/d; TFLOP/s (bwd = 2.5x fwd flops; bwd time = fwd+bwd - fwd); "
        "ratio = ours / sdpa-flash; bwd det = deterministic, fast = atomic dQ")
    log(f"{'d':>4} {'N':>6} {'causal':>6} | {'fwd':>5} {'flash':>5} {'ratio':>5} | {'bwd det':>7} {'fast':>5} "
        f"{'flash':>5} {'r det':>5} {'r fast':>6}")
    for r in rows:
        fast = r.get("bwd_fast_tflops")
        log(f"{r['d']:>4} {r['n']:>6} {str(r['causal']):>6} | {num(r['fwd_tflops']):>5} "
            f"{num(r['sdpa_fwd_tflops']):>5} {num(r['fwd_tflops'] / r['sdpa_fwd_tflops'], 2):>5} | "
            f"{num(r['bwd_tflops']):>7} {num(fast):>5} {num(r['sdpa_bwd_tflops']):>5} "
            f"{num(r['bwd_tflops'] / r['sdpa_bwd_tflops'], 2):>5} "
            f"{num(None if fast is None else fast / r['sdpa_bwd_tflops'], 2):>6}")


def main(argv=None):
    global LOG_PATH
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sections", nargs="*", default=["build", "tests", "sweep", "tests_tuned", "table", "memory"])
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    parser.add_argument("--budget", type=float, default=380.0, help="seconds for the whole run")
    parser.add_argument("--test-timeout", type=float, default=150.0)
    parser.add_argument("--exitfirst", action="store_true")
    parser.add_argument("--table-repeats", type=int, default=2, help="time the table this many times (noise)")
    parser.add_argument("--sweep-kinds", default="fwd,dkdv,dq,dkdv-fast",
                        help="which kernels the sweep tunes (comma-separated: fwd, dkdv, dq, dkdv-fast)")
    parser.add_argument("--sweep-dims", default="64,128", help="head dims the sweep tunes (comma-separated)")
    args = parser.parse_args(argv)
    args.sweep_kinds = [k.strip() for k in args.sweep_kinds.split(",") if k.strip()]
    args.sweep_dims = [int(d) for d in args.sweep_dims.split(",") if d.strip()]
    start = time.time()
    args.deadline = start + args.budget
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        LOG_PATH = os.path.join(args.out, "dev_cupy.log")
    cc = torch.cuda.get_device_capability()
    import cupy

    from mhattn.backends.cupy import compiler

    log(f"{torch.cuda.get_device_name()} sm_{cc[0]}{cc[1]}, torch {torch.__version__}, cupy {cupy.__version__}, "
        f"NVRTC {compiler.nvrtc_version()}, cache {compiler.cache_dir()}")
    rows = []
    for name in args.sections:
        if time.time() > args.deadline:
            log(f"section {name}: skipped, time budget spent")
            continue
        t0 = time.time()
        log(f"== {name}")
        try:
            if name == "table":
                for repeat in range(args.table_repeats):
                    pass_rows = []
                    section_table(args, cc, pass_rows)
                    rows.append(pass_rows)
            else:
                globals()[f"section_{name}"](args, cc)
        except Exception as error:
            log(f"section {name}: ERROR {type(error).__name__}: {error}")
            log(traceback.format_exc())
        log(f"== {name} done in {time.time() - t0:.0f} s")
    if args.out and rows:
        with open(os.path.join(args.out, "table.json"), "w") as f:
            json.dump(rows, f, indent=1)
    for index, pass_rows in enumerate(rows):
        log(f"\n-- table pass {index + 1} of {len(rows)}")
        print_table(pass_rows)
    log(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
