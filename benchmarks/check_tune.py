"""GPU check of dispatch by measured speed: the sdpa backend, ``mhattn tune --quick``, and auto against the best.

On an H100, from the repository root:

    source benchmarks/device_env.sh && python benchmarks/check_tune.py            # all three steps
    python benchmarks/check_tune.py --steps tests,tune    # then --steps compare (same warm machine)

Steps:
  tests    the sdpa backend's GPU tests and the quick conformance cases of the sdpa backend (~1 min)
  tune     ``mhattn tune --quick`` into a fresh cache directory, timed (the target: under 5 minutes)
  compare  in a new process (which reads that table): every backend and automatic selection, forward and
           forward+backward, at the training shapes of ``mhattn bench`` (bf16, d 64/128/256, N 512..16k,
           causal and not), two short-sequence shapes, decoding and a chunked prefill; prints
           best / auto per cell (the target: >= 0.95 everywhere)

Logs and a copy of the table go to $OUT (else /tmp/mhattn_check_tune); the cache directory the table is
written to and read from is $CHECK_CACHE (else /tmp/mhattn_check_tune_cache). Prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

OUT = os.environ.get("OUT") or "/tmp/mhattn_check_tune"
# Outside $OUT, so a later call on the same (warm) machine can run `compare` on the table `tune` wrote.
CACHE = os.environ.get("CHECK_CACHE") or "/tmp/mhattn_check_tune_cache"
DEVICE = os.environ.get("CHECK_DEVICE", "cuda")   # cpu only to try the script itself on small shapes


def _run(command, log_name, env=None):
    started = time.time()
    with open(os.path.join(OUT, log_name), "w") as log:
        status = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    seconds = time.time() - started
    with open(os.path.join(OUT, log_name)) as log:
        tail = log.read().strip().splitlines()[-3:]
    return status, seconds, tail


def step_tests():
    lines = []
    status, seconds, tail = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_sdpa_backend.py",
                                  "tests/test_tuning.py"], "tests.log")
    lines.append(f"gpu tests (sdpa, tuning): exit {status}, {seconds:.0f} s: {tail[-1] if tail else ''}")
    status, seconds, tail = _run([sys.executable, "-m", "mhattn.cli", "conformance", "--quick", "--backend", "sdpa",
                                  "--no-progress", "--report", os.path.join(OUT, "conformance_sdpa.md")],
                                 "conformance_sdpa.log")
    lines.append(f"conformance --quick --backend sdpa: exit {status}, {seconds:.0f} s: {tail[-1] if tail else ''}")
    return lines


def step_tune():
    shutil.rmtree(CACHE, ignore_errors=True)
    env = dict(os.environ, MHATTN_CACHE_DIR=CACHE)
    status, seconds, tail = _run([sys.executable, "-m", "mhattn.cli", "tune", "--quick", "--no-progress"], "tune.log",
                                 env=env)
    tables = sorted(os.listdir(os.path.join(CACHE, "tables"))) if os.path.isdir(os.path.join(CACHE, "tables")) else []
    for name in tables:
        shutil.copy(os.path.join(CACHE, "tables", name), os.path.join(OUT, name))
    verdict = "meets < 5 min" if seconds < 300 else "MISSES < 5 min"
    return [f"mhattn tune --quick: exit {status}, {seconds:.0f} s wall ({verdict}); table {', '.join(tables) or 'none'}"]


def compare_cells():
    from mhattn.tuning.grid import Cell, decode, training

    cells = [training("bf16", d, n, causal) for d in (64, 128, 256) for n in (512, 1024, 2048, 4096, 8192, 16384)
             for causal in ("none", "top_left")]
    cells += [Cell("bf16", 32, 12, 12, 197, 197, 64), Cell("bf16", 1, 16, 16, 128, 128, 64)]
    cells += [decode("bf16", 8, 8192), decode("bf16", 1, 131072)]
    cells.append(Cell("bf16", 1, 32, 8, 512, 32768, 128, "bottom_right"))
    return cells


def step_compare_in_child():
    """Runs in a fresh process with MHATTN_CACHE_DIR set: it reads the table ``tune`` wrote."""
    import torch

    import mhattn
    from mhattn.benchmark.timing import bench_ms
    from mhattn.tuning.grid import Cell
    from mhattn.tuning.measure import backends_to_time, make_inputs

    rows = []
    names = backends_to_time(DEVICE)
    cells = compare_cells() if DEVICE == "cuda" else [Cell("fp32", 1, 8, 8, 256, 256, 64, c) for c in ("none", "top_left")]
    for cell in cells:
        q, k, v, dout, kwargs = make_inputs(cell, DEVICE)
        chosen = mhattn.explain(q, k, v, **kwargs).chosen
        modes = ("fwd", "fwd_bwd") if cell.grad else ("fwd",)
        for mode in modes:
            times = {}
            for name in names + ["auto"]:
                def fn(name=name):
                    out = mhattn.attention(q, k, v, backend=name, **kwargs)
                    return torch.autograd.grad(out, (q, k, v), dout) if mode == "fwd_bwd" else out
                try:
                    times[name] = bench_ms(fn, 10.0, 40.0, DEVICE)
                except Exception:
                    continue
            best = min((n for n in times if n != "auto"), key=times.get)
            rows.append({"cell": cell.label(), "mode": mode, "auto_chose": chosen, "best": best,
                         "times_ms": times, "best_over_auto": times[best] / times["auto"]})
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    print(json.dumps(rows))


def step_compare():
    env = dict(os.environ, MHATTN_CACHE_DIR=CACHE)
    env.pop("MHATTN_BACKEND", None)
    done = subprocess.run([sys.executable, __file__, "--child-compare"], capture_output=True, text=True, env=env)
    with open(os.path.join(OUT, "compare.log"), "w") as log:
        log.write(done.stdout + done.stderr)
    if done.returncode != 0:
        return [f"compare: exit {done.returncode}; see {OUT}/compare.log"]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    with open(os.path.join(OUT, "auto_vs_best.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = [f"{'shape':44s} {'mode':8s} {'auto chose':10s} {'best':8s} {'best/auto':>9s}  times ms"]
    for r in rows:
        times = ", ".join(f"{n} {ms:.3g}" for n, ms in r["times_ms"].items())
        flag = "" if r["best_over_auto"] >= 0.95 else "  <0.95"
        lines.append(f"{r['cell']:44s} {r['mode']:8s} {r['auto_chose']:10s} {r['best']:8s} "
                     f"{r['best_over_auto']:9.2f}{flag}  {times}")
    worst = min(rows, key=lambda r: r["best_over_auto"])
    below = sum(r["best_over_auto"] < 0.95 for r in rows)
    lines.append(f"auto >= 0.95x the best in {len(rows) - below}/{len(rows)} cells; worst "
                 f"{worst['best_over_auto']:.2f} at {worst['cell']} {worst['mode']}")
    # Where auto chose the fastest backend, auto and that backend run the same code: their ratio is the run's
    # timing noise. The choice itself is judged by the chosen backend's own time against the best's.
    chosen = [r["times_ms"][r["best"]] / r["times_ms"][r["auto_chose"]] for r in rows if r["auto_chose"] in r["times_ms"]]
    fastest = sum(r["auto_chose"] == r["best"] for r in rows)
    lines.append(f"auto chose the fastest backend in {fastest}/{len(rows)} cells; the chosen backend's time against "
                 f"the best: worst {min(chosen):.2f}x, geomean {_geomean(chosen):.3f}x")
    return lines


def _geomean(values) -> float:
    import math

    return math.exp(sum(math.log(v) for v in values) / len(values))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="tests,tune,compare")
    parser.add_argument("--child-compare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_compare:
        step_compare_in_child()
        return
    os.makedirs(OUT, exist_ok=True)
    steps = {"tests": step_tests, "tune": step_tune, "compare": step_compare}
    summary = []
    for name in args.steps.split(","):
        summary += steps[name.strip()]()
    print("\n".join(summary))


if __name__ == "__main__":
    main()
