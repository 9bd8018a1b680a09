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
    ... python3 <repo>/benchmarks/check_short_forward.py --tiles   # forward.py's tiles for masked and other calls

Prints a line per shape as it goes and the table last. ``--tiles`` (tile_sweep) instead times forward.py's forward
under each of TILE_CANDIDATES, put in configs.SHORT_FORWARD and SHORT_FORWARD_MASKED for the case's head dim without a
causal mask, beside the tiles as shipped, at TILE_CASES: key counts the Gluon forward leaves to forward.py without a mask, and the calls it
leaves to it at any key count (a key-padding mask, dropout, a window, softcap).
"""

import argparse
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


TILE_CANDIDATES = {"128x64 8w3s": configs.KernelConfig(128, 64, 8, 3), "64x32 4w3s": configs.KernelConfig(64, 32, 4, 3),
                   "128x32 4w3s": configs.KernelConfig(128, 32, 4, 3), "64x64 4w3s": configs.KernelConfig(64, 64, 4, 3)}
# (label, head dim, N (= Nq = Nk), mask, dropout_p, other arguments of mhattn.attention); B=32 H=12 at d = 64, B=16
# H=16 at d = 128
TILE_CASES = ([(f"d64 N={n}", 64, n, None, 0.0, {}) for n in (288, 320, 352, 383)]
              + [(f"d{d} N={n} key padding", d, n, "key_padding", 0.0, {}) for d in (64, 128) for n in (197, 512)]
              + [("d64 N=1024 key padding", 64, 1024, "key_padding", 0.0, {})]
              + [(f"d64 N={n} dropout", 64, n, None, 0.1, {}) for n in (197, 512, 1024)]
              + [("d64 N=700 window", 64, 700, None, 0.0, {"window": (100, 30)}),
                 ("d64 N=768 softcap", 64, 768, None, 0.0, {"softcap": 20.0})])


def tile_sweep():
    """GPU us per forward (CUDA-graph replay, L2 flushed) of the Triton backend at TILE_CASES, as shipped and with
    each of TILE_CANDIDATES as forward.py's short tile; the largest difference to SDPA's output where SDPA computes
    the same (no dropout, window or softcap)."""
    shipped = dict(configs.SHORT_FORWARD), dict(configs.SHORT_FORWARD_MASKED)
    rows = []
    for label, head_dim, seqlen, mask_kind, dropout_p, extra in TILE_CASES:
        batch, heads = (32, 12) if head_dim == 64 else (16, 16)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        mask = None
        if mask_kind == "key_padding":  # each sequence's keys a prefix of at least half of them
            lengths = torch.randint(seqlen // 2, seqlen + 1, (batch,), device="cuda", generator=gen)
            mask = (torch.arange(seqlen, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
        run = lambda: mhattn.attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, backend="triton",  # noqa: E731
                                       **extra)
        want = (torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                if dropout_p == 0 and not extra else None)
        times, worst = {}, 0.0
        for name, tile in [("as shipped", None)] + list(TILE_CANDIDATES.items()):
            configs.SHORT_FORWARD, configs.SHORT_FORWARD_MASKED = dict(shipped[0]), dict(shipped[1])
            if tile is not None:
                for table in (configs.SHORT_FORWARD, configs.SHORT_FORWARD_MASKED):
                    table[("sm90", "half", head_dim, False)] = ((None, tile),)
            fresh()
            try:
                out = run()
                if want is not None:
                    worst = max(worst, (out.float() - want.float()).abs().max().item())
                times[name] = timing.graph_replay_ms(run, "cuda", flush_l2=True) * 1e3
            finally:
                configs.SHORT_FORWARD, configs.SHORT_FORWARD_MASKED = dict(shipped[0]), dict(shipped[1])
                fresh()
        rows.append((label, times, worst))
        print(label, {name: round(us, 1) for name, us in times.items()}, f"max diff {worst:.4f}", flush=True)
    names = ["as shipped"] + list(TILE_CANDIDATES)
    print()
    print("forward GPU us per call (CUDA-graph replay, L2 flushed), bf16; max |diff| to SDPA where it computes the same")
    print(f"{'case':26s} " + " ".join(f"{name:>12s}" for name in names) + f" {'max diff':>9s}")
    for label, times, worst in rows:
        print(f"{label:26s} " + " ".join(f"{times[name]:12.1f}" for name in names) + f" {worst:9.4f}")


@contextlib.contextmanager
def fresh_context():
    fresh()
    yield


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", action="store_true", help="only forward.py's short tiles for masked and other calls "
                                                             "(tile_sweep)")
    if parser.parse_args().tiles:
        tile_sweep()
    else:
        main()
