"""The score tile shared by the forward and the two backward kernels.

For a tile of raw dot products ``qk = q . k`` (fp32) the kernels need the score in base-2 units,

    s2 = log2(e) * (softcap * tanh(scale * qk / softcap)  or  scale * qk)  [+ log2(e) * float mask]

with -inf wherever the key is not visible (outside the causal/window band, past the sequence ends, or
False in a boolean mask), so that ``exp2(s2 - m2)`` equals ``exp(s - m)``. Working in base 2 lets the
kernels use the hardware's exp2 and fold the scale into one multiply.

Indices come pre-broadcast (``q_idx`` (BM, 1) and ``k_idx`` (1, BN) for query-major tiles, or
``q_idx`` (1, BM) and ``k_idx`` (BN, 1) for the key-major backward tiles), so one helper serves both
orientations.
"""

import os

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# MASK_KIND values (constexpr): no mask, boolean mask (True = attend), additive float mask, and a boolean or a float mask
# that is the same for every query row and head (a key-padding mask or bias: key_padding.shared_by_heads_and_rows), of
# which a tile reads one row of keys instead of a (rows, keys) tile of the same values over and over.
MASK_NONE = 0
MASK_BOOL = 1
MASK_FLOAT = 2
MASK_KEYS = 3
MASK_KEYS_FLOAT = 4


# With 16-bit inputs the softcap's tanh on a GPU is the hardware's (tanh.approx.f32: one multi-function-unit operation,
# relative error below 2^-10.98, as FlashAttention's softcap takes it; P itself is then rounded to 16 bits). Through
# exp2 it costs an exp2 and a division, so that a softcapped score took three multi-function-unit operations with the
# softmax's exp2 instead of two, and those bound the forward (NOTES, version 29). Float32 inputs keep the formula, and
# so does Triton's interpreter (TRITON_INTERPRET=1, read once here, at import: INTERPRET, which backend.py takes),
# which runs no PTX.
INTERPRET = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")
HARDWARE_TANH = tl.constexpr(not INTERPRET)
HALF_LN2 = tl.constexpr(0.34657359027997264)


@triton.jit
def softcap_tanh(x2, APPROX: tl.constexpr):
    """tanh(x) given x2 = 2 * log2(e) * x: with APPROX (16-bit inputs) on a GPU the hardware's approximation
    (HARDWARE_TANH), else 1 - 2 / (2^x2 + 1), exact at the saturated ends and within ~1e-7 near 0."""
    if APPROX and HARDWARE_TANH:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x2 * HALF_LN2], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 - 2.0 / (tl.exp2(x2) + 1.0)


@triton.jit
def visible(q_idx, k_idx, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """True where key k_idx is visible to query q_idx: both in range and
    -window_left <= k - q - diag_offset <= window_right (a bound only where its flag is set)."""
    ok = (q_idx < seqlen_q) & (k_idx < seqlen_k)
    rel = k_idx - q_idx - diag_offset
    if HAS_LEFT:
        ok = ok & (rel >= -window_left)
    if HAS_RIGHT:
        ok = ok & (rel <= window_right)
    return ok


@triton.jit
def load_mask_tile(mask_base, q_idx, k_idx, seqlen_q, seqlen_k, stride_mq, stride_mk):
    """The attn_mask values of a tile. Indices are clamped into range instead of predicated, so the
    load is always legal; the clamped entries belong to rows/keys that are masked or never stored."""
    q_safe = tl.minimum(q_idx, seqlen_q - 1).to(tl.int64)
    k_safe = tl.minimum(k_idx, seqlen_k - 1).to(tl.int64)
    return tl.load(mask_base + q_safe * stride_mq + k_safe * stride_mk)


@triton.jit
def load_key_mask(mask_base, k_idx, seqlen_k, stride_mk):
    """MASK_KEYS, MASK_KEYS_FLOAT: the mask's values for keys k_idx (shaped as k_idx, so they broadcast over the tile's rows), clamped
    into range as load_mask_tile does."""
    return tl.load(mask_base + tl.minimum(k_idx, seqlen_k - 1).to(tl.int64) * stride_mk)


@triton.jit
def with_key_mask(s2, values, MASK_KIND: tl.constexpr):
    """Base-2 scores s2 under a key mask's values for their keys (load_key_mask): MASK_KEYS, -inf where False;
    MASK_KEYS_FLOAT, the bias added."""
    if MASK_KIND == 3:
        return tl.where(values != 0, s2, float("-inf"))
    else:
        return s2 + values.to(tl.float32) * LOG2E


@triton.jit
def attention_scores(qk, q_idx, k_idx, seqlen_q, seqlen_k,
                     qk_scale2, softcap_in2, softcap_out2,
                     diag_offset, window_left, window_right,
                     mask_base, stride_mq, stride_mk,
                     MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                     HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, APPROX_TANH: tl.constexpr):
    """Base-2 scores of a tile and the softcap's tanh (for the backward's chain rule).

    qk: raw fp32 dot products. qk_scale2 = scale * log2(e); with softcap, softcap_in2 =
    2 * log2(e) * scale / softcap and softcap_out2 = softcap * log2(e). MASKED: apply the causal/window
    band and the sequence ends (blocks known to be fully visible skip this).
    APPROX_TANH: the inputs are 16-bit (softcap_tanh). Returns (s2, tanh): tanh is qk itself when there is no softcap
    (unused then).
    """
    if HAS_SOFTCAP:
        t = softcap_tanh(qk * softcap_in2, APPROX_TANH)
        s2 = t * softcap_out2
    else:
        t = qk
        s2 = qk * qk_scale2
    if MASK_KIND == 2:
        values = load_mask_tile(mask_base, q_idx, k_idx, seqlen_q, seqlen_k, stride_mq, stride_mk)
        s2 = s2 + values.to(tl.float32) * LOG2E
    if MASK_KIND == 1:
        values = load_mask_tile(mask_base, q_idx, k_idx, seqlen_q, seqlen_k, stride_mq, stride_mk)
        s2 = tl.where(values != 0, s2, float("-inf"))
    if MASK_KIND == 3 or MASK_KIND == 4:
        s2 = with_key_mask(s2, load_key_mask(mask_base, k_idx, seqlen_k, stride_mk), MASK_KIND)
    if MASKED:
        ok = visible(q_idx, k_idx, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
                     HAS_LEFT, HAS_RIGHT)
        s2 = tl.where(ok, s2, float("-inf"))
    return s2, t


@triton.jit
def query_major_ranges(start_m, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key ranges for the query block [start_m, start_m + BLOCK_M), for the forward and dQ loops.

    Returns (lo, full_lo, full_hi, hi): keys [lo, hi) may be visible; blocks in [full_lo, full_hi) are
    fully visible (no masking needed); [lo, full_lo) and [full_hi, hi) are the band's edges and the
    ragged end, which pay for masking. lo, full_lo and full_hi are multiples of BLOCK_N (or equal hi).
    All divisions see non-negative operands (Triton and the interpreter round negatives differently).
    """
    last_m = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    lo = 0
    hi = seqlen_k
    if HAS_LEFT:
        lo = tl.maximum(start_m + diag_offset - window_left, 0) // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(seqlen_k, tl.maximum(last_m + diag_offset + window_right + 1, 0))
    hi = tl.maximum(hi, lo)
    full_lo = lo
    if HAS_LEFT:
        first_full = tl.maximum(last_m + diag_offset - window_left, lo)
        full_lo = (first_full + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    full_hi = seqlen_k // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        full_hi = tl.minimum(full_hi, tl.maximum(start_m + diag_offset + window_right + 1, 0) // BLOCK_N * BLOCK_N)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def key_major_ranges(start_n, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query ranges for the key block [start_n, start_n + BLOCK_N), for the dK/dV loop: the mirror of
    :func:`query_major_ranges` (query i sees key j iff j - off - right <= i <= j - off + left).

    Returns (lo, full_lo, full_hi, hi) over query rows, multiples of BLOCK_M (or equal hi). A ragged
    last key block is masked throughout.
    """
    last_n = tl.minimum(start_n + BLOCK_N, seqlen_k) - 1
    lo = 0
    hi = seqlen_q
    if HAS_RIGHT:
        lo = tl.maximum(start_n - diag_offset - window_right, 0) // BLOCK_M * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(seqlen_q, tl.maximum(last_n - diag_offset + window_left + 1, 0))
    hi = tl.maximum(hi, lo)
    full_lo = lo
    if HAS_RIGHT:
        first_full = tl.maximum(last_n - diag_offset - window_right, lo)
        full_lo = (first_full + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    full_hi = seqlen_q // BLOCK_M * BLOCK_M
    if HAS_LEFT:
        full_hi = tl.minimum(full_hi, tl.maximum(start_n - diag_offset + window_left + 1, 0) // BLOCK_M * BLOCK_M)
    full_hi = tl.where(start_n + BLOCK_N > seqlen_k, 0, full_hi)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi
