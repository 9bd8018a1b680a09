"""The tolerance rule of CONFORMANCE.md, FlashAttention-2's own:

    err_backend = max |X_backend - X_gold|,  err_lowp = max |X_ref_in_input_dtype - X_gold|
    pass  <=>  err_backend <= factor * err_lowp + floor

X_gold is the reference on upcast inputs (float64 on the CPU, float32 on a GPU). NaN or Inf where the
gold is finite always fails. For float32/float64 inputs the bound is relative to the gold's magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# factor per compared tensor
FACTORS = {"out": 2.0, "lse": 2.0, "dq": 4.0, "dk": 3.0, "dv": 3.0, "dmask": 4.0}

# floor: a few ulps of the input dtype, relative to the gold's magnitude
FLOOR_ULPS = 4
EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23, torch.float64: 2.0**-52}

# relative bounds for full-precision inputs: |err| / max|gold|
FP32_RELATIVE = 1e-4
TF32_RELATIVE = 5e-3
FP64_RELATIVE = 1e-10


@dataclass
class Comparison:
    name: str
    ok: bool
    err: float       # max |X - gold|
    bound: float     # what err had to stay under
    ratio: float     # err / bound (<= 1 passes)
    note: str = ""

    def __str__(self):
        verdict = "ok" if self.ok else "FAIL"
        return f"{self.name}: {verdict} err={self.err:.3e} bound={self.bound:.3e} ratio={self.ratio:.2f}{self.note}"


def _finite_mismatch(x: torch.Tensor, gold: torch.Tensor) -> bool:
    # x must be finite wherever gold is finite, and equal (same infinity) where gold is infinite
    gold_finite = torch.isfinite(gold)
    if not bool(torch.isfinite(x[gold_finite]).all()):
        return True
    if bool((~gold_finite).any()):
        return not bool((x[~gold_finite] == gold[~gold_finite]).all())
    return False


def _max_abs_diff(x: torch.Tensor, gold: torch.Tensor) -> float:
    finite = torch.isfinite(gold)
    if not bool(finite.any()):
        return 0.0
    return float((x.double()[finite] - gold.double()[finite]).abs().max())


def compare(name: str, x: torch.Tensor, gold: torch.Tensor, lowp: torch.Tensor = None, *, dtype=None,
            factor: float = None, relative: float = None, floor_scale: float = None) -> Comparison:
    """Judge ``x`` (a backend's result) against ``gold``.

    Half precision: bound = factor * max|lowp - gold| + floor, ``lowp`` being the reference run in the
    input dtype. Full precision (``relative`` given, or dtype float32/float64 with no ``lowp``): bound =
    relative * max|gold|.

    ``floor_scale``: a magnitude the floor (and the relative bound) use when it exceeds max|gold|. A gold
    that cancels to exactly 0 (dq and dk of rows that see a single key) otherwise leaves a bound of 0
    that any rounding residue breaks; the caller passes the size of the terms that cancel.
    """
    dtype = dtype or x.dtype
    if x.shape != gold.shape:
        return Comparison(name, False, float("inf"), 0.0, float("inf"), f" shape {tuple(x.shape)} != {tuple(gold.shape)}")
    x = x.detach().to(gold.device)
    gold = gold.detach()
    if _finite_mismatch(x, gold):
        return Comparison(name, False, float("nan"), 0.0, float("inf"), " (NaN/Inf where the gold is finite, or unwritten)")
    err = _max_abs_diff(x, gold)
    scale = float(gold[torch.isfinite(gold)].abs().max()) if bool(torch.isfinite(gold).any()) else 0.0
    if floor_scale is not None:
        scale = max(scale, float(floor_scale))
    if relative is None and lowp is None:
        relative = {torch.float64: FP64_RELATIVE}.get(dtype, FP32_RELATIVE)
    if relative is not None:
        bound = relative * max(scale, 1e-30)
    else:
        factor = FACTORS.get(name.split("[")[0], 2.0) if factor is None else factor
        err_lowp = _max_abs_diff(lowp.detach().to(gold.device), gold)
        floor = FLOOR_ULPS * EPS.get(dtype, 2.0**-10) * max(scale, 1e-6)
        bound = factor * err_lowp + floor
    ratio = err / bound if bound > 0 else (0.0 if err == 0 else float("inf"))
    return Comparison(name, ratio <= 1.0, err, bound, ratio)
