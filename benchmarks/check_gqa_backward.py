"""The Triton backend's backward under GQA and MQA at training shapes, beside torch's SDPA (enable_gqa=True, torch's
own kernel choice): the Gluon backward with one program per key block walking every query head of its key/value head,
or with the heads split over several programs that add float32 partial dK and dV: "rule" as
hopper_launch.backward_group_parts chooses, "group" one program walking all of them, a number that many query heads
per program (hopper_launch.BACKWARD_HEADS_PER_PROGRAM; 1: one program per query head).

    source benchmarks/device_env.sh && cd /tmp && python3 <repo>/benchmarks/check_gqa_backward.py
    ... check_gqa_backward.py --settings rule,group,1,2 --dtype fp16

Each setting runs in a process of its own (the backend keeps each call signature's prepared launches, so a setting
changed within a process would not reach a repeated call). bf16 by default; do_bench medians (timing.bench_ms,
settled) of the forward and the forward+backward, the backward their difference, in ms, and its TFLOP/s (2.5 x the
forward's 4 * B * Hq * Nq * Nk * d, halved when causal). Beside each time, the largest difference of dq, dk and dv from
SDPA's float32 gradients over their largest value (SDPA's own bf16 gradients as the yardstick). The table last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

# (B, Hq, Hkv, N, d, causal): Llama-shaped training steps (the HF model check's, 8B-like with 32/8 heads, longer and
# shorter sequences), non-causal, MQA, a group of 8 and one of 7 (Qwen2-7B's 28/4), 64 query heads on 8 (70B-like),
# and d = 64 (causal, and MQA without a mask).
SHAPES = [
    (2, 16, 4, 4096, 128, True),
    (1, 32, 8, 4096, 128, True),
    (4, 32, 8, 2048, 128, True),
    (1, 32, 8, 8192, 128, True),
    (8, 16, 4, 1024, 128, True),
    (16, 32, 8, 512, 128, True),
    (2, 16, 4, 4096, 128, False),
    (2, 16, 1, 4096, 128, True),
    (2, 32, 4, 4096, 128, True),
    (2, 28, 4, 4096, 128, True),
    (1, 64, 8, 4096, 128, True),
    (4, 16, 4, 2048, 64, True),
    (2, 16, 4, 4096, 64, True),
    (2, 16, 1, 4096, 64, False),
]
WARMUP_MS, REP_MS, SETTLE_MS = 10, 50, 100


def backward_flops(batch, heads_q, seqlen, head_dim, causal) -> float:
    return 2.5 * 4 * batch * heads_q * seqlen * seqlen * head_dim / (2 if causal else 1)


def run_setting(setting: str, dtype, shapes) -> list:
    """One process's rows: per shape, the setting's forward and backward ms and its gradients' error."""
    import torch.nn.functional as F

    import mhattn
    from mhattn.backends.triton import hopper_launch
    from mhattn.benchmark import timing

    if setting not in ("sdpa", "group", "rule"):
        hopper_launch.BACKWARD_HEADS_PER_PROGRAM = int(setting)
    rows = []
    for batch, heads_q, heads_kv, seqlen, head_dim, causal in shapes:
        gen = torch.Generator(device="cuda").manual_seed(seqlen + heads_q)
        q, k, v = (torch.randn(batch, h, seqlen, head_dim, device="cuda", dtype=dtype, generator=gen)
                   for h in (heads_q, heads_kv, heads_kv))
        grad = torch.randn(batch, heads_q, seqlen, head_dim, device="cuda", dtype=dtype, generator=gen)
        if setting == "sdpa":
            def call(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        else:
            if setting == "group":
                hopper_launch.BACKWARD_HEADS_PER_PROGRAM = heads_q // heads_kv

            def call(q, k, v):
                with mhattn.use_backend("triton"):
                    return mhattn.attention(q, k, v, is_causal=causal, enable_gqa=True)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        fwd = timing.bench_ms(lambda: call(*leaves), WARMUP_MS, REP_MS, "cuda", SETTLE_MS)

        def step():
            for t in leaves:
                t.grad = None
            call(*leaves).backward(grad)

        both = timing.bench_ms(step, WARMUP_MS, REP_MS, "cuda", SETTLE_MS)
        step()
        ours = [t.grad.float() for t in leaves]
        exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*exact, is_causal=causal, enable_gqa=True).backward(grad.float())
        error = max(float((a - e.grad).abs().max() / e.grad.abs().max()) for a, e in zip(ours, exact))
        rows.append(dict(shape=[batch, heads_q, heads_kv, seqlen, head_dim, causal], fwd=fwd, bwd=both - fwd,
                         error=error))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del q, k, v, grad, leaves, ours, exact
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="rule,group",
                        help="mhattn's columns, comma-separated: 'rule' (the backend's), 'group' (one program walks "
                             "all of a key/value head's query heads), or query heads per program (default rule,group)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (a child process: this setting only)
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if args.one is not None:
        print(json.dumps(run_setting(args.one, dtype, SHAPES)))
        return 0
    settings = ["sdpa"] + [s.strip() for s in args.settings.split(",") if s.strip()]
    results = {}
    for setting in settings:
        done = subprocess.run([sys.executable, __file__, "--one", setting, "--dtype", args.dtype],
                              stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            print(f"setting {setting}: exit {done.returncode}", flush=True)
            continue
        results[setting] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{torch.cuda.get_device_name()}, {args.dtype}: backward ms (TFLOP/s) and the gradients' largest error "
          "over SDPA's float32 ones; 'x sdpa': SDPA's backward time over each column's")
    names = [s for s in settings if s in results]
    head = f"{'B':>3} {'Hq':>3} {'Hkv':>3} {'N':>5} {'d':>4} {'causal':>6} "
    head += " ".join(f"{'bwd ' + name:>22}" for name in names)
    head += " " + " ".join(f"{'x sdpa ' + name:>14}" for name in names if name != "sdpa")
    print(head)
    for i, shape in enumerate(SHAPES):
        batch, heads_q, heads_kv, seqlen, head_dim, causal = shape
        flops = backward_flops(batch, heads_q, seqlen, head_dim, causal)
        cells, ratios = [], []
        for name in names:
            row = results[name][i]
            cells.append(f"{row['bwd']:>7.3f} ({flops / row['bwd'] / 1e9:>4.0f}) {row['error']:.1e}")
            if name != "sdpa" and "sdpa" in results:
                ratios.append(f"{results['sdpa'][i]['bwd'] / row['bwd']:>13.2f}x")
        print(f"{batch:>3} {heads_q:>3} {heads_kv:>3} {seqlen:>5} {head_dim:>4} {str(causal):>6} "
              + " ".join(f"{c:>22}" for c in cells) + " " + " ".join(ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
