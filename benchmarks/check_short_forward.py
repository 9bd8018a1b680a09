"""The Triton backend at short sequences (up to 1k keys): its kernel choice as shipped beside the previous rules, with
torch's SDPA and the CuPy backend, in one process. As shipped, the Gluon Hopper forward runs from
hopper_launch.MIN_KEYS keys (fewer, FULL_GRID_MIN_KEYS, where the query tiles fill the GPU) and the Gluon backward
from BACKWARD_MIN_KEYS; forward.py's short tiles come from configs.SHORT_FORWARD by key count. The previous rules:
both Gluon kernels from 1k keys at d = 64 and 128, and forward.py's table tile at d = 64 (64 x 64 at d = 128).

GPU time per call (CUDA-graph replay: timing.graph_replay_ms, no host work timed; median of 10 replays of 20 calls),
with the L2 cache warm and flushed before each call, forward and forward+backward, bf16; then host loops of
forward+backward at HOST_SHAPES (300 calls, one synchronize, best of 7 rounds taking turns:
latency.host_loops_in_turn), where the GPU time is short enough for the host path to decide.

    source benchmarks/device_env.sh && cd /tmp && python3 <repo>/benchmarks/check_short_forward.py

Prints a line per shape as it goes and the table last.
"""

import contextlib

import torch

import mhattn
from mhattn import dispatch
from mhattn.backends.triton import backend as triton_backend
from mhattn.backends.triton import configs, hopper_launch
from mhattn.benchmark import latency, timing

# (B, H, N, d): ViT-B/16 at batch 32, BERT-like lengths, d = 128 at two batch sizes (few programs and many)
SHAPES = [(32, 12, 197, 64), (32, 12, 256, 64), (32, 12, 384, 64), (32, 12, 512, 64), (32, 12, 768, 64),
          (2, 16, 197, 64), (2, 16, 512, 64), (16, 16, 128, 128), (16, 16, 197, 128), (16, 16, 512, 128),
          (2, 16, 197, 128), (2, 16, 512, 128)]
HOST_SHAPES = [(32, 12, 197, 64), (8, 16, 512, 64), (16, 16, 197, 128), (1, 16, 128, 64)]
LOOP_CALLS, ROUNDS = 300, 7


@contextlib.contextmanager
def previous_rules():
    """The kernel choice before the short-sequence rules: Gluon from 1k keys, forward.py's table tiles."""
    saved = (hopper_launch.MIN_KEYS, hopper_launch.BACKWARD_MIN_KEYS, hopper_launch.FULL_GRID_MIN_KEYS,
             configs.SHORT_FORWARD)
    hopper_launch.MIN_KEYS = {64: 1024, 128: 1024, 256: 1}
    hopper_launch.BACKWARD_MIN_KEYS = {64: 1024, 128: 1024, 256: 1}
    hopper_launch.FULL_GRID_MIN_KEYS = {}
    configs.SHORT_FORWARD = {("sm90", "half", 128, causal): ((None, configs.KernelConfig(64, 64, 4, 3)),)
                             for causal in (False, True)}
    fresh()
    try:
        yield
    finally:
        (hopper_launch.MIN_KEYS, hopper_launch.BACKWARD_MIN_KEYS, hopper_launch.FULL_GRID_MIN_KEYS,
         configs.SHORT_FORWARD) = saved
        fresh()


def fresh():
    """New plans and signatures (a plan keeps its tiles and its Hopper decision), and no remembered front-end calls
    (a repeated call keeps its backend's signature)."""
    dispatch.clear_cache()
    configs.table_config.cache_clear()
    triton_backend._signatures.clear()
    triton_backend._plans.clear()


def calls(shape, causal: bool, backward: bool):
    batch, heads, seqlen, head_dim = shape
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=backward) for _ in range(3))
    grad_out = torch.randn_like(q)

    def one(backend):
        if backend == "sdpa":
            run = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
        else:
            run = lambda: mhattn.attention(q, k, v, is_causal=causal, backend=backend)  # noqa: E731
        return (lambda: run().backward(grad_out)) if backward else run

    def error(backend):
        """Largest difference from SDPA's output (forward) or gradients (forward+backward)."""
        def result(fn):
            if not backward:
                return [fn()]
            q.grad = k.grad = v.grad = None
            fn()
            return [q.grad, k.grad, v.grad]
        with torch.no_grad() if not backward else contextlib.nullcontext():
            mine, theirs = result(one(backend)), result(one("sdpa"))
        q.grad = k.grad = v.grad = None
        return max((a.float() - b.float()).abs().max().item() for a, b in zip(mine, theirs))

    return one, error


def main():
    impls = {"sdpa": ("sdpa", contextlib.nullcontext), "triton": ("triton", fresh_context),
             "triton previous": ("triton", previous_rules), "cupy": ("cupy", contextlib.nullcontext)}
    rows = []
    for backward in (False, True):
        mode = "fwd+bwd" if backward else "fwd"
        for shape in SHAPES:
            for causal in (False, True):
                one, error = calls(shape, causal, backward)
                label = f"B={shape[0]} H={shape[1]} N={shape[2]} d={shape[3]}{' causal' if causal else ''}"
                times = {}
                for name, (backend, context) in impls.items():
                    with context():
                        try:
                            fn = one(backend)
                            fn()
                            warm = timing.graph_replay_ms(fn, "cuda") * 1e3
                            cold = timing.graph_replay_ms(fn, "cuda", flush_l2=True) * 1e3
                            err = error(backend) if backend != "sdpa" else 0.0
                            times[name] = (warm, cold, err)
                        except Exception as exc:  # noqa: BLE001 (a row says what failed)
                            times[name] = (float("nan"), float("nan"), f"{type(exc).__name__}: {exc}"[:120])
                rows.append((mode, label, times))
                print(mode, label, {n: tuple(round(x, 1) if isinstance(x, float) else x for x in t)
                                    for n, t in times.items()}, flush=True)
    host_rows = []
    for shape in HOST_SHAPES:
        one, _ = calls(shape, False, True)
        loops = {name: one(backend) for name, (backend, _) in impls.items()}
        contexts = {name: context for name, (_, context) in impls.items()}
        for name, fn in loops.items():
            with contexts[name]():
                fn()
        best, errors = latency.host_loops_in_turn(loops, LOOP_CALLS, "cuda", ROUNDS, contexts)
        host_rows.append((shape, best, errors))
        print("host loop", shape, {name: round(us, 1) for name, us in best.items()}, errors or "", flush=True)
    print()
    print("GPU us per call (CUDA-graph replay; L2 warm / flushed), ratios to SDPA's flushed time; max |diff| to SDPA")
    print(f"{'mode':8s} {'shape':30s} {'sdpa':>13s} {'triton':>20s} {'triton previous':>20s} {'cupy':>20s}"
          f" {'max diff':>9s}")
    for mode, label, times in rows:
        base = times["sdpa"][1]
        cells = [f"{times['sdpa'][0]:6.1f}/{times['sdpa'][1]:6.1f}"]
        for name in ("triton", "triton previous", "cupy"):
            warm, cold, _ = times[name]
            cells.append(f"{warm:6.1f}/{cold:6.1f} {cold / base:5.2f}x")
        errors = [times[name][2] for name in ("triton", "triton previous", "cupy")]
        worst = max((e for e in errors if isinstance(e, float)), default=float("nan"))
        failed = [e for e in errors if isinstance(e, str)]
        print(f"{mode:8s} {label:30s} {cells[0]:>13s} {cells[1]:>20s} {cells[2]:>20s} {cells[3]:>20s} {worst:9.4f}"
              + (f"  {failed}" if failed else ""))
    print()
    print("host loop of forward+backward, us per call (best of the rounds taking turns), ratio to SDPA's")
    print(f"{'shape':30s} " + " ".join(f"{name:>22s}" for name in impls))
    for (batch, heads, seqlen, head_dim), best, errors in host_rows:
        base = best.get("sdpa", float("nan"))
        cells = [f"{best[name]:8.1f} {best[name] / base:5.2f}x" if name in best else str(errors.get(name))[:22]
                 for name in impls]
        print(f"{f'B={batch} H={heads} N={seqlen} d={head_dim}':30s} " + " ".join(f"{c:>22s}" for c in cells))


@contextlib.contextmanager
def fresh_context():
    fresh()
    yield


if __name__ == "__main__":
    main()
