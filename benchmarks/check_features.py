"""The Triton backend with a feature (softcap, a sliding window, dropout, a key-padding mask or bias) at training
shapes, beside the same call without it, torch's SDPA as a user calls it, and FlexAttention, in one process.

On sm_90 the Gluon kernels run plain calls, sliding windows, right-padding key masks (as key counts), dropout and
softcap (at the head dims hopper_launch's FORWARD_DROPOUT_HEAD_DIMS and *_SOFTCAP_HEAD_DIMS name); a call with another
feature runs the FlashAttention-2 kernels on configs.py's sm_90 table tiles (hopper_launch.why_not);
``MHATTN_TRITON_HOPPER=0`` runs every call on the FlashAttention-2 kernels, for an A/B. This says what a feature costs a
user against the plain call and the peers,
and ``--tiles`` times those tiles against candidates (configs.pin), since many of them spill with a feature
(backends/triton/NOTES.md, "The FlashAttention-2 table tiles on sm_90 with a mask, dropout or a window").

bf16 (or --dtype fp16), B * N = 16k tokens, H * d = 2048 (PERFORMANCE.md's protocol shape); do_bench median
(timing.bench_ms, settled), forward and forward+backward, in ms, and each peer's time over the Triton backend's. SDPA
computes the same where it can: a window and a key-padding mask as a boolean mask, the bias as a float one, dropout
with its own random mask; not softcap. FlexAttention (torch.compile'd flex_attention; only at the head dims in
FLEX_HEAD_DIMS, for its compile time): a causal, window or key-length block mask (the bias as the same key lengths),
softcap as a score_mod; not dropout.

    source benchmarks/device_env.sh && cd /tmp && python3 <repo>/benchmarks/check_features.py [--tiles]
    ... check_features.py --features "plain,key padding,key bias" --head-dims 128

Prints a line per case as it goes and the table last.
"""

import argparse
import math

import torch

import mhattn
from mhattn.backends.triton import configs
from mhattn.benchmark import timing

TOKENS, WIDTH = 16384, 2048
DTYPE = torch.bfloat16  # --dtype
SEQLEN = 4096
HEAD_DIMS = (64, 128, 256)
FLEX_HEAD_DIMS = (128,)
SOFTCAP = 30.0
WINDOW = 1024  # keys to the left of the diagonal (causal)
DROPOUT = 0.1
# (name, causal, mhattn.attention keywords); key padding: each sequence's keys a prefix of at least half of them, as a
# boolean mask (B, 1, 1, N); key bias: the same padding as an additive float mask (0 on the prefix, -inf past it)
FEATURES = [("plain", True, {}), ("softcap", True, {"softcap": SOFTCAP}), ("window", True, {"window": (WINDOW, 0)}),
            ("dropout", True, {"dropout_p": DROPOUT}), ("plain", False, {}), ("key padding", False, {}),
            ("key bias", False, {})]
# Candidate table tiles per head dim (configs.parse strings), timed with --tiles beside the table's own.
TILE_CANDIDATES = {
    128: {"fwd 128x64 8w": "fwd=128,64,8,3;dkdv=64,64,4,2,tma;dq=128,64,8,3",
          "fwd 64x64 4w": "fwd=64,64,4,3;dkdv=64,64,4,2,tma;dq=128,64,8,3",
          "dkdv 64x128 8w": "fwd=128,128,8,3;dkdv=64,128,8,2,tma;dq=128,64,8,3",
          "dkdv 64x32 4w": "fwd=128,128,8,3;dkdv=64,32,4,2,tma;dq=128,64,8,3"},
    256: {"fwd 64x64 4w": "fwd=64,64,4,2,tma;dkdv=64,32,4,2,tma;dq=128,32,8,3",
          "fwd 128x32 8w": "fwd=128,32,8,2,tma;dkdv=64,32,4,2,tma;dq=128,32,8,3",
          "dkdv 64x32 8w": "fwd=128,64,8,2,tma;dkdv=64,32,8,2,tma;dq=128,32,8,3",
          "dkdv 64x64 8w": "fwd=128,64,8,2,tma;dkdv=64,64,8,2,tma;dq=128,32,8,3"},
}
# Features whose calls --tiles times under each candidate (those whose table tiles spill the most)
TILE_FEATURES = ("window", "key padding", "key bias")
WARMUP_MS, REP_MS, SETTLE_MS = 10, 40, 100


def inputs(head_dim: int, seed: int = 0):
    batch, heads = TOKENS // SEQLEN, WIDTH // head_dim
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, SEQLEN, head_dim, device="cuda", dtype=DTYPE, generator=gen)
               .requires_grad_() for _ in range(3))
    lengths = torch.randint(SEQLEN // 2, SEQLEN + 1, (batch,), device="cuda", generator=gen)
    return q, k, v, lengths


def key_padding_mask(lengths):
    return (torch.arange(SEQLEN, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]


def feature_mask(feature, lengths):
    """The attn_mask of a feature: the key-padding mask, or the same padding as a bias in the inputs' dtype; else
    None."""
    if feature == "key padding":
        return key_padding_mask(lengths)
    if feature == "key bias":
        keep = key_padding_mask(lengths)
        return torch.zeros(keep.shape, device="cuda", dtype=DTYPE).masked_fill_(~keep, float("-inf"))
    return None


def mhattn_call(q, k, v, lengths, feature, causal, extra):
    mask = feature_mask(feature, lengths)
    return lambda: mhattn.attention(q, k, v, attn_mask=mask, is_causal=causal, backend="triton", **extra)


def sdpa_call(q, k, v, lengths, feature, causal, extra):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if feature == "softcap":
        return None
    if feature == "window":
        rows = torch.arange(SEQLEN, device="cuda")
        band = (rows[None, :] <= rows[:, None]) & (rows[None, :] >= rows[:, None] - WINDOW)
        return lambda: sdpa(q, k, v, attn_mask=band)
    if feature in ("key padding", "key bias"):
        mask = feature_mask(feature, lengths)
        return lambda: sdpa(q, k, v, attn_mask=mask)
    return lambda: sdpa(q, k, v, is_causal=causal, dropout_p=extra.get("dropout_p", 0.0))


_flex = {}


def flex_call(q, k, v, lengths, feature, causal, extra):
    if feature == "dropout" or q.shape[-1] not in FLEX_HEAD_DIMS:
        return None
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if "compiled" not in _flex:
        # One compilation per block mask, score_mod and grad mode: more than dynamo's default limit of 8, past which
        # flex_attention runs unfused.
        torch._dynamo.config.recompile_limit = 64
        _flex["compiled"] = torch.compile(flex_attention, dynamic=False)

    def causal_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def window_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= q_idx - WINDOW)

    def padding_mod(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    mask_mod = {"window": window_mod, "key padding": padding_mod, "key bias": padding_mod}.get(
        feature, causal_mod if causal else None)
    block_mask = None
    if mask_mod is not None:
        batch = q.shape[0] if feature in ("key padding", "key bias") else None
        block_mask = create_block_mask(mask_mod, batch, None, SEQLEN, SEQLEN, device="cuda")
    score_mod = softcap_mod if feature == "softcap" else None
    return lambda: _flex["compiled"](q, k, v, score_mod=score_mod, block_mask=block_mask)


def timed(call, q, k, v):
    """(forward ms, forward+backward ms) of ``call``, or a reason it did not run."""
    grad_out = torch.randn_like(q)

    def forward():
        with torch.no_grad():
            call()

    def both():
        call().backward(grad_out)
        q.grad = k.grad = v.grad = None

    try:
        fwd = timing.bench_ms(forward, WARMUP_MS, REP_MS, "cuda", SETTLE_MS)
        fwd_bwd = timing.bench_ms(both, WARMUP_MS, REP_MS, "cuda", SETTLE_MS)
        return fwd, fwd_bwd
    except Exception as exc:  # noqa: BLE001 (a row says what failed)
        return f"{type(exc).__name__}: {exc}"[:100]


def error_to(call, want):
    """Largest difference of ``call()``'s output from ``want``'s (both without dropout)."""
    with torch.no_grad():
        return (call().float() - want().float()).abs().max().item()


def main(with_tiles: bool):
    rows = []
    for head_dim in HEAD_DIMS:
        q, k, v, lengths = inputs(head_dim)
        for feature, causal, extra in FEATURES:
            label = f"d={head_dim} {feature}{' causal' if causal else ''}"
            calls = {"triton": mhattn_call(q, k, v, lengths, feature, causal, extra),
                     "sdpa-default": sdpa_call(q, k, v, lengths, feature, causal, extra),
                     "flex": flex_call(q, k, v, lengths, feature, causal, extra)}
            pins = {}
            if with_tiles and feature in TILE_FEATURES and head_dim in TILE_CANDIDATES:
                pins = {"table tile": "table"} | TILE_CANDIDATES[head_dim]
            times, errors = {}, {}
            for name, call in calls.items():
                if call is not None:
                    times[name] = timed(call, q, k, v)
            for name, pin in pins.items():
                config = configs.table_config((9, 0), DTYPE, head_dim, causal) if pin == "table" else pin
                with configs.pin(config):
                    times[name] = timed(calls["triton"], q, k, v)
                    if "dropout_p" not in extra:
                        errors[name] = error_to(calls["triton"], lambda: mhattn.attention(
                            q, k, v, attn_mask=feature_mask(feature, lengths), is_causal=causal, backend="reference",
                            **extra))
            rows.append((label, head_dim, causal, feature, times, errors))
            print(label, {n: (tuple(round(x, 3) for x in t) if isinstance(t, tuple) else t) for n, t in times.items()},
                  {n: round(e, 4) for n, e in errors.items()}, flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    report(rows)


def report(rows):
    names = []
    for *_, times, _ in rows:
        names += [n for n in times if n not in names]
    print()
    print(f"{str(DTYPE).replace('torch.', '')}, B*N = {TOKENS}, H*d = {WIDTH}, N = {SEQLEN}; ms forward / "
          f"forward+backward, do_bench median; "
          f"'vs X': X's time over triton's (above 1: triton is faster)")
    peers = [n for n in ("sdpa-default", "flex") if n in names]
    print(f"{'case':28s} " + " ".join(f"{n:>15s}" for n in names) + " " + " ".join(f"{'vs ' + p:>13s}" for p in peers))
    for label, head_dim, causal, feature, times, errors in rows:
        cells = [f"{t[0]:.3f}/{t[1]:.3f}" if isinstance(t, tuple) else ("-" if t is None else "failed")
                 for t in (times.get(name) for name in names)]
        mine = times.get("triton")
        for peer in peers:
            theirs = times.get(peer)
            if isinstance(mine, tuple) and isinstance(theirs, tuple):
                cells.append(f"{theirs[0] / mine[0]:.2f}/{theirs[1] / mine[1]:.2f}")
            else:
                cells.append("-")
        print(f"{label:28s} " + " ".join(f"{c:>15s}" for c in cells[:len(names)]) + " "
              + " ".join(f"{c:>13s}" for c in cells[len(names):]))
    failures = [(label, n, t) for label, *_, times, _ in rows for n, t in times.items() if isinstance(t, str)]
    for label, name, reason in failures:
        print(f"failed: {label} {name}: {reason}")
    worst = [(label, n, e) for label, *_, errors in rows for n, e in errors.items() if not math.isfinite(e) or e > 0.05]
    for label, name, error in worst:
        print(f"max |diff| to the reference above 0.05: {label} {name}: {error}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", action="store_true", help="also the table tiles against TILE_CANDIDATES")
    parser.add_argument("--features", default=None,
                        help="comma list of FEATURES names to run (default: all), e.g. 'plain,key padding'")
    parser.add_argument("--head-dims", default=None, help="comma list of head dims (default: 64,128,256)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="the inputs' dtype (default bf16)")
    args = parser.parse_args()
    if args.features:
        FEATURES[:] = [f for f in FEATURES if f[0] in args.features.split(",")]
    if args.head_dims:
        HEAD_DIMS = tuple(int(d) for d in args.head_dims.split(","))
    DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    main(args.tiles)
