"""Development harness for the Triton backend on a GPU: tile sweeps, the PERFORMANCE.md table against
sdpa-flash in the same run, and peak memory.

    source benchmarks/device_env.sh
    python3 benchmarks/dev_triton.py sweep table memory --out $OUT

Sections (run in the order given, each skipped once the time budget --budget is spent):

- ``sweep``: for d in 64, 128 and causal off/on at N = 4k, coordinate descent from the configs.py entry:
  the forward over candidate forward tiles, then the backward over the tiles of each backward kernel
  (--kinds, in order) with the others at their best so far; the winners are used by the later
  sections of the same run and printed as table entries for configs.py.
- ``table``: bf16, B * N = 16384, H = 2048 / d, N in 512..16k, d in 64, 128: forward and backward
  TFLOP/s of the backend and of SDPA with FLASH_ATTENTION, timed with triton.testing.do_bench
  (median) on the same inputs, and their ratios.
- ``d256``: the same at d = 256 for a few N (it must work; no target).
- ``memory``: peak extra memory of forward+backward, causal, B = 1, H = 16, d = 128, N = 8k and 32k.
- ``resources`` (no GPU needed): compile kernels for sm_90 ahead of time and print shared memory,
  registers and stack (spills) per tile, e.g. ``resources --specs dkdv:128:0:32,128,8,2``; ``--specs table`` takes
  every forward and backward tile of configs.py's sm_90 table at d = 64, 128 and 256, and ``--features`` builds each
  spec for calls with those features too (a key-padding mask, a float mask, dropout, a window: RESOURCE_FEATURES).

Before timing, every kernel variant a section needs is compiled in parallel worker processes, which
fill Triton's on-disk cache for the timing process. Logs go to --out; the short table prints last.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import sys
import time
import traceback

import torch

TOKENS, HIDDEN = 16384, 2048

# Candidate tiles (BLOCK_M, BLOCK_N, num_warps, num_stages), pre-screened by compiling for sm_90 on a
# machine without a GPU and dropping those that spill registers (backends/triton/NOTES.md).
FWD_CANDIDATES = {
    64: ["128,64,4,3", "128,128,8,3", "128,64,8,3", "64,64,4,3", "128,64,4,4", "128,128,8,2"],
    128: ["128,64,8,3", "128,128,8,3", "128,64,8,2", "64,64,4,3", "128,128,8,2", "128,32,8,3"],
    256: ["64,64,8,2", "128,32,8,2", "64,64,8,3", "64,32,8,2", "128,64,8,2", "64,32,4,2"],
}
DKDV_CANDIDATES = {
    64: ["32,64,4,3", "64,128,8,2", "32,64,4,2", "16,64,4,3", "16,128,8,3", "32,128,8,3"],
    128: ["32,128,8,2", "32,128,8,3", "16,128,8,2", "64,64,8,2"],
    256: ["32,32,8,2", "32,32,8,3", "16,32,8,2", "64,32,8,2", "16,32,4,2"],
}
# sm_90 candidates: copy-engine loads (tma), warp-specialised loops (ws); run with --hopper.
HOPPER_FWD_CANDIDATES = {
    64: ["128,64,4,3", "128,64,4,3,tma", "128,64,8,3,tma", "128,64,4,4,tma", "128,128,8,3,tma"],
    128: ["128,128,8,3", "128,128,8,3,tma", "128,128,8,4,tma", "128,64,4,3,tma", "128,64,8,4,tma"],
    256: ["128,64,8,2,tma", "128,64,8,2", "128,32,8,2,tma", "64,64,4,2,tma"],
}
HOPPER_DQ_MODES = ["separate", "atomic", "tma"]
HOPPER_DKDV_CANDIDATES = {
    64: ["32,64,4,3", "64,64,4,3,tma", "64,64,4,2,tma", "64,128,8,2,tma", "64,64,8,3,tma"],
    128: ["64,64,4,2,tma", "64,64,4,3,tma", "64,128,8,2,tma", "64,64,8,2,tma", "64,32,4,2,tma"],
    256: ["32,32,4,2,tma", "64,32,8,2,tma", "32,64,8,2,tma", "64,32,4,2,tma"],
}

DQ_CANDIDATES = {
    64: ["64,64,4,3", "64,64,4,2", "64,32,4,3", "128,64,8,3", "128,32,4,3", "64,64,4,4"],
    128: ["128,64,8,3", "128,64,8,2", "128,64,8,4", "64,64,4,3", "128,32,8,3", "64,32,4,3"],
    256: ["128,32,8,2", "64,32,8,2", "128,32,8,3", "64,32,4,2", "64,64,8,2"],
}


def log(out_dir, text):
    print(text, flush=True)
    if out_dir:
        with open(os.path.join(out_dir, "dev_triton.log"), "a") as f:
            f.write(text + "\n")


# ---- problems ----------------------------------------------------------------------------------------


def protocol_inputs(seqlen, head_dim, dtype=torch.bfloat16, batch=None, heads=None, grad=False):
    batch = batch or max(1, TOKENS // seqlen)
    heads = heads or HIDDEN // head_dim
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype) for _ in range(3))
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def params_for(head_dim, causal):
    from mhattn.backends.base import AttentionParams

    return AttentionParams(scale=head_dim ** -0.5, window_right=0 if causal else None)


def fwd_flops(batch, heads, seqlen, head_dim, causal):
    return 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)


# ---- compiling in parallel ----------------------------------------------------------------------------


def _warm(job):
    """Run forward+backward once on a small problem with the same compile-time signature."""
    head_dim, causal, config, dtype_name, which = job
    try:
        from mhattn.backends.triton import TritonBackend, configs

        dtype = getattr(torch, dtype_name)
        backend = TritonBackend()
        # Without a pinned config the table may pick by sequence length: warm a short and a long one.
        for seqlen in (256,) if config else (256, 2048):
            q, k, v = protocol_inputs(seqlen, head_dim, dtype, batch=1)
            params = params_for(head_dim, causal)
            with configs.pin(config) if config else _null():
                out, lse = backend.forward(q, k, v, params)
                if which != "fwd":
                    backend.backward(torch.randn_like(out), q, k, v, out, lse, params)
        torch.cuda.synchronize()
        return job, None
    except Exception:
        return job, traceback.format_exc(limit=3)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def precompile(jobs, out_dir, workers=12):
    jobs = list(dict.fromkeys(jobs))
    start = time.time()
    failures = {}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
        for job, error in pool.map(_warm, jobs):
            if error:
                failures[job] = error
                log(out_dir, f"  compile FAILED {job}: {error.strip().splitlines()[-1]}")
    log(out_dir, f"precompiled {len(jobs)} variants in {time.time() - start:.0f}s ({len(failures)} failed)")
    return failures


# ---- timing --------------------------------------------------------------------------------------------


def bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def time_triton(q, k, v, params, config=None, which=("fwd", "bwd")):
    """(forward ms, backward ms) of the backend called directly (None for a pass not in ``which``)."""
    from mhattn.backends.triton import TritonBackend, backend as backend_module, configs

    backend = TritonBackend()
    with configs.pin(config) if config else _null():
        backend_module._shrunk.clear()
        out, lse = backend.forward(q, k, v, params)
        grad_out = torch.randn_like(out)
        fwd = bench(lambda: backend.forward(q, k, v, params)) if "fwd" in which else None
        bwd = bench(lambda: backend.backward(grad_out, q, k, v, out, lse, params)) if "bwd" in which else None
        if backend_module._shrunk:
            raise RuntimeError(f"tile shrunk: {backend_module._shrunk}")
    return fwd, bwd


def time_sdpa_flash(q, k, v, causal, kernel="FLASH_ATTENTION"):
    """(forward ms, backward ms) of SDPA pinned to one of its kernels (FLASH_ATTENTION, CUDNN_ATTENTION)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    with sdpa_kernel(getattr(SDPBackend, kernel)):
        fwd = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        grad_out = torch.randn_like(out)
        bwd = bench(lambda: torch.autograd.grad(out, (qg, kg, vg), grad_out, retain_graph=True))
    return fwd, bwd


# ---- sections ------------------------------------------------------------------------------------------


def default_config(head_dim, causal, seqlen):
    from mhattn.backends.triton import configs

    return configs.config_for(tuple(torch.cuda.get_device_capability()), torch.bfloat16, head_dim, causal, seqlen,
                             seqlen_k=seqlen)


def section_sweep(args, state):
    """Coordinate descent over the three kernels' tiles, starting from the table entry: each kind in
    --kinds is swept with the others at their best so far."""
    from mhattn.backends.triton import configs

    kinds = args.kinds.split(",")
    candidates = {"fwd": FWD_CANDIDATES, "dkdv": DKDV_CANDIDATES, "dq": DQ_CANDIDATES}
    if args.hopper:
        candidates = {"fwd": HOPPER_FWD_CANDIDATES, "dkdv": HOPPER_DKDV_CANDIDATES, "dq": DQ_CANDIDATES,
                      "dqmode": {d: HOPPER_DQ_MODES for d in (64, 128, 256)}}
    dims = [int(d) for d in args.dims.split(",")]
    jobs = []
    for d in dims:
        for causal in (False, True):
            base = default_config(d, causal, args.sweep_n)
            for kind in kinds:
                for tile in candidates[kind][d]:
                    cfg = _with_tile(base, kind, tile)
                    jobs.append((d, causal, str(cfg), "bfloat16", "fwd" if kind == "fwd" else "both"))
    precompile(jobs, args.out)
    winners = {}
    for d in dims:
        for causal in (False, True):
            if time.time() > args.deadline:
                log(args.out, f"  sweep: time budget spent, stopping before d={d} causal={causal}")
                break
            q, k, v = protocol_inputs(args.sweep_n, d)
            params = params_for(d, causal)
            flops = fwd_flops(q.shape[0], q.shape[1], args.sweep_n, d, causal)
            sdpa = time_sdpa_flash(q, k, v, causal)
            cudnn = time_sdpa_flash(q, k, v, causal, "CUDNN_ATTENTION")
            log(args.out, f"\n== sweep d={d} causal={causal} N={args.sweep_n}: sdpa-flash "
                          f"fwd {flops / sdpa[0] * 1e-9:.0f} bwd {2.5 * flops / sdpa[1] * 1e-9:.0f} TFLOP/s; "
                          f"sdpa-cudnn fwd {flops / cudnn[0] * 1e-9:.0f} bwd {2.5 * flops / cudnn[1] * 1e-9:.0f}")
            best = default_config(d, causal, args.sweep_n)
            for kind in kinds:
                best_ms = None
                for tile_text in candidates[kind][d]:
                    cfg = _with_tile(best, kind, tile_text)
                    try:
                        f_ms, b_ms = time_triton(q, k, v, params, cfg, which=("fwd",) if kind == "fwd" else ("bwd",))
                    except Exception as error:
                        log(args.out, f"  {kind} {tile_text}: FAILED {type(error).__name__}: {str(error)[:200]}")
                        continue
                    ms = f_ms if kind == "fwd" else b_ms
                    factor = 1.0 if kind == "fwd" else 2.5
                    tflops = factor * flops / ms * 1e-9
                    log(args.out, f"  {kind:4s} {tile_text:14s} {ms:7.3f} ms  {tflops:6.0f} TFLOP/s")
                    if best_ms is None or ms < best_ms:
                        best_ms, best_cfg = ms, cfg
                if best_ms is not None:
                    best = best_cfg
            winners[(d, causal)] = best
            log(args.out, f"  winner d={d} causal={causal}: {best}")
            del q, k, v
            torch.cuda.empty_cache()
    state["winners"] = winners
    log(args.out, "\nconfigs.py entries (sm90, half):")
    for (d, causal), win in winners.items():
        log(args.out, f"  ('sm90', 'half', {d}, {causal}): {win}")


def _with_tile(config, kind, tile_text):
    """``config`` with one kernel's tile (kind fwd, dkdv, dq) or the dQ mode (kind dqmode) replaced."""
    from dataclasses import replace

    from mhattn.backends.triton import configs

    if kind == "dqmode":
        return replace(config, dq_mode=tile_text)
    return replace(config, **{{"fwd": "forward"}.get(kind, kind): configs.parse(tile_text).forward})


def _config_for_run(state, d, causal):
    if not state.get("apply_winners", True):
        return None
    return state.get("winners", {}).get((d, causal))  # None: the table in configs.py


def section_table(args, state, dims=(64, 128), seqlens=(512, 1024, 2048, 4096, 8192, 16384), name="table"):
    jobs = [(d, c, str(_config_for_run(state, d, c) or ""), "bfloat16", "both") for d in dims for c in (False, True)]
    precompile(jobs, args.out)
    rows = state.setdefault("rows", [])
    for d in dims:
        for causal in (False, True):
            for n in seqlens:
                if time.time() > args.deadline:
                    log(args.out, f"  {name}: time budget spent, stopping before d={d} causal={causal} N={n}")
                    return
                q, k, v = protocol_inputs(n, d)
                params = params_for(d, causal)
                flops = fwd_flops(q.shape[0], q.shape[1], n, d, causal)
                try:
                    t_fwd, t_bwd = time_triton(q, k, v, params, _config_for_run(state, d, causal))
                except Exception as error:
                    log(args.out, f"  triton d={d} N={n} causal={causal} FAILED: {error}")
                    continue
                s_fwd, s_bwd = time_sdpa_flash(q, k, v, causal)
                c_fwd, c_bwd = time_sdpa_flash(q, k, v, causal, "CUDNN_ATTENTION")
                row = dict(d=d, n=n, causal=causal, fwd=flops / t_fwd * 1e-9, bwd=2.5 * flops / t_bwd * 1e-9,
                           sdpa_fwd=flops / s_fwd * 1e-9, sdpa_bwd=2.5 * flops / s_bwd * 1e-9,
                           cudnn_fwd=flops / c_fwd * 1e-9, cudnn_bwd=2.5 * flops / c_bwd * 1e-9)
                rows.append(row)
                log(args.out, f"  d={d:3d} N={n:5d} causal={int(causal)}"
                              f"  triton fwd {row['fwd']:5.0f} bwd {row['bwd']:5.0f}"
                              f"  sdpa-flash fwd {row['sdpa_fwd']:5.0f} bwd {row['sdpa_bwd']:5.0f}"
                              f"  cudnn fwd {row['cudnn_fwd']:5.0f} bwd {row['cudnn_bwd']:5.0f}"
                              f"  /flash {row['fwd'] / row['sdpa_fwd']:.2f} {row['bwd'] / row['sdpa_bwd']:.2f}"
                              f"  /cudnn {row['fwd'] / row['cudnn_fwd']:.2f} {row['bwd'] / row['cudnn_bwd']:.2f}")
                del q, k, v
                torch.cuda.empty_cache()


def section_d256(args, state):
    section_table(args, state, dims=(256,), seqlens=(512, 4096, 16384), name="d256")


def section_memory(args, state):
    import mhattn
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    results = state.setdefault("memory", [])
    for n in (8192, 32768):
        for impl in ("triton", "sdpa-flash"):
            q, k, v = protocol_inputs(n, 128, batch=1, heads=16, grad=True)
            grad_out = torch.randn_like(q)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            if impl == "triton":
                out = mhattn.attention(q, k, v, is_causal=True, backend="triton")
            else:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(grad_out)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            results.append(dict(n=n, impl=impl, peak_mib=peak))
            log(args.out, f"  memory N={n} {impl}: peak extra {peak:.0f} MiB")
            del q, k, v, out, grad_out
            torch.cuda.empty_cache()


# ---- compiler report without a GPU ---------------------------------------------------------------------


def compile_report(kind, head_dim, causal, tile, dtype="bf16", cc=90, dq_mode=0, flags=()):
    """Compile one kernel for sm_<cc> ahead of time (no GPU needed; backends/triton/ahead.py) and return its
    resource line: shared memory, registers, stack (spills), wgmma / mma.sync / cp.async counts in the PTX.
    ``kind``: fwd, dkdv, dq or splitkv (decode.py); ``flags``: (name, value) compile-time flag overrides."""
    from mhattn.backends.triton import ahead

    kernel = ahead.compile_kernel(ahead.KernelTask(kind, head_dim, causal, tile, dq_mode, dtype, tuple(flags)), cc)
    usage = ahead.resource_usage(kernel)
    ptx = kernel.asm["ptx"]
    return (f"smem={kernel.metadata.shared} regs={usage['regs']} stack={usage['stack']} "
            f"wgmma={ptx.count('wgmma.mma_async')} mma.sync={ptx.count('mma.sync')} "
            f"cp.async={ptx.count('cp.async.cg') + ptx.count('cp.async.ca')} "
            f"tma={ptx.count('cp.async.bulk.tensor')} setmaxnreg={ptx.count('setmaxnreg')}")


# The compile-time flags of a call with each feature (the kernels' other flags as plain calls have them): a boolean
# key-padding mask runs with its mask read a row of keys at a time (scores.MASK_KEYS) and the per-batch key bounds
# (key_padding.py); a float key-padding bias (B, 1, 1, Nk) is read a row at a time too (scores.MASK_KEYS_FLOAT).
RESOURCE_FEATURES = {"plain": (), "key-padding": (("MASK_KIND", 3), ("KEY_LENGTHS", True)),
                     "float-mask": (("MASK_KIND", 2),), "key-bias": (("MASK_KIND", 4),),
                     "dropout": (("HAS_DROPOUT", True),),
                     "window": (("HAS_LEFT", True),)}


def table_specs(head_dims=(64, 128, 256)) -> list:
    """The resources specs of every forward and backward tile of configs.py's sm_90 table (bf16), with its dQ mode."""
    from mhattn.backends.triton import configs

    specs = []
    for head_dim in head_dims:
        for causal in (False, True):
            config = configs.table_config((9, 0), torch.bfloat16, head_dim, causal)
            for kind, tile in (("fwd", config.forward), ("dkdv", config.dkdv), ("dq", config.dq)):
                mode = f":{config.dq_mode}" if kind == "dkdv" else ""
                specs.append(f"{kind}:{head_dim}:{int(causal)}:{tile}{mode}")
    return specs


def section_resources(args, state):
    """--specs kind:d:causal:BM,BN,W,S[,tma][,ws][:dqmode] ... (or "table": table_specs) compiled for sm_90 (no GPU
    needed), for each of --features (RESOURCE_FEATURES)."""
    from mhattn.backends.triton import configs

    specs = [one for spec in args.specs for one in (table_specs() if spec == "table" else [spec])]
    features = args.features.split(",")
    unknown = [name for name in features if name not in RESOURCE_FEATURES]
    if unknown:
        raise SystemExit(f"--features: unknown {unknown}; known: {', '.join(RESOURCE_FEATURES)}")
    for spec in specs:
        kind, head_dim, causal, tile, *dq_mode = spec.split(":")
        mode = configs.DQ_MODES.index(dq_mode[0]) if dq_mode else 0
        for feature in features:
            try:
                line = compile_report(kind, int(head_dim), causal == "1", configs.parse(tile).forward, dq_mode=mode,
                                      flags=RESOURCE_FEATURES[feature])
            except Exception as error:
                line = f"FAILED {type(error).__name__}: {str(error)[:300]}"
            log(args.out, f"  {spec:32s} {feature:12s} {line}")


def section_table_dims(args, state):
    section_table(args, state, dims=tuple(int(d) for d in args.table_dims.split(",")))


SECTIONS = {"sweep": section_sweep, "table": section_table_dims, "d256": section_d256, "memory": section_memory,
            "resources": section_resources}


def summary(args, state):
    lines = ["", f"== summary ({torch.cuda.get_device_name()}, bf16, TFLOP/s; ratio = triton / sdpa-flash) =="]
    lines.append(" d     N  c | tri fwd  fa fwd  ratio | tri bwd  fa bwd  ratio")
    for r in state.get("rows", []):
        lines.append(f"{r['d']:3d} {r['n']:5d}  {int(r['causal'])} | {r['fwd']:7.0f} {r['sdpa_fwd']:7.0f} "
                     f"{r['fwd'] / r['sdpa_fwd']:6.2f} | {r['bwd']:7.0f} {r['sdpa_bwd']:7.0f} "
                     f"{r['bwd'] / r['sdpa_bwd']:6.2f}")
    rows = [r for r in state.get("rows", []) if r["d"] in (64, 128) and r["n"] >= 1024]
    if rows:
        lines.append(f"min ratio (d 64/128, N>=1k): fwd {min(r['fwd'] / r['sdpa_fwd'] for r in rows):.2f} "
                     f"bwd {min(r['bwd'] / r['sdpa_bwd'] for r in rows):.2f}")
    for m in state.get("memory", []):
        lines.append(f"memory N={m['n']} {m['impl']}: {m['peak_mib']:.0f} MiB")
    for (d, causal), win in state.get("winners", {}).items():
        lines.append(f"winner d={d} causal={causal}: {win}")
    for line in lines:
        log(args.out, line)
    if args.out:
        serial = dict(rows=state.get("rows", []), memory=state.get("memory", []),
                      winners={f"{d},{c}": str(w) for (d, c), w in state.get("winners", {}).items()})
        with open(os.path.join(args.out, "dev_triton.json"), "w") as f:
            json.dump(serial, f, indent=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sections", nargs="*", default=["table"], choices=sorted(SECTIONS))
    parser.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for logs (default $OUT)")
    parser.add_argument("--budget", type=float, default=360.0, help="seconds after which sections stop")
    parser.add_argument("--kinds", default="fwd,dkdv,dq", help="kernels the sweep tunes, in order (fwd,dkdv,dq)")
    parser.add_argument("--dims", default="64,128", help="head dims the sweep tunes")
    parser.add_argument("--hopper", action="store_true",
                        help="sweep the sm_90 candidates (tma / ws tiles, kind dqmode: the dQ summation)")
    parser.add_argument("--table-dims", default="64,128", help="head dims of the table section")
    parser.add_argument("--sweep-n", type=int, default=4096, help="sequence length of the sweep")
    parser.add_argument("--specs", nargs="*", default=["fwd:128:0:128,128,8,3", "dkdv:128:0:32,128,8,2",
                                                       "dq:128:0:128,64,8,3"],
                        help="resources section: kind:head_dim:causal:BM,BN,W,S (kind fwd, dkdv or dq), or table")
    parser.add_argument("--features", default="plain",
                        help="resources section: comma-separated " + ", ".join(RESOURCE_FEATURES))
    parser.add_argument("--no-apply-winners", action="store_true",
                        help="later sections use configs.py's table, not the sweep's winners")
    args = parser.parse_args(argv)
    args.deadline = time.time() + args.budget
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    gpu = torch.cuda.is_available()
    if not gpu and set(args.sections) - {"resources"}:
        parser.error("only the resources section runs without a CUDA GPU")
    device = f"{torch.cuda.get_device_name()} cc {torch.cuda.get_device_capability()}" if gpu else "no GPU"
    log(args.out, f"device {device} torch {torch.__version__}")
    import triton

    log(args.out, f"triton {triton.__version__}")
    state = {"apply_winners": not args.no_apply_winners}
    try:
        for name in args.sections:
            if time.time() > args.deadline:
                log(args.out, f"skipping {name}: time budget spent")
                continue
            log(args.out, f"\n### {name}")
            try:
                SECTIONS[name](args, state)
            except Exception:
                log(args.out, f"section {name} FAILED:\n{traceback.format_exc()}")
    finally:
        if gpu:
            summary(args, state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
