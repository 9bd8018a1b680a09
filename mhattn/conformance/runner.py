"""Run one conformance case on one backend and judge every tensor it returns.

The backend is called directly through the contract of ``mhattn.backends.base`` (``forward``,
``backward``, ``dropout_keep_mask``), with NaN-poisoned allocations. Its results are compared with
the tolerance rule of ``mhattn.conformance.tolerance``:

- gold: the naive reference on float64 copies of the inputs, on the case's device, gradients by autograd;
- lowp: the same reference run in the input dtype (fp16/bf16 only; fp32/fp64 use a relative bound);
- dropout: both references apply the keep mask the backend says it draws (``dropout_keep_mask``).

Besides the tolerance checks: output dtypes and shapes, rows that see no key (output and dq exactly 0,
lse -inf), the dropout keep rate, inputs left unchanged, and for determinism cases every repeated
backward bitwise equal to the first.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field

import torch

from mhattn.backends import layouts
from mhattn.conformance import packed, tolerance
from mhattn.conformance.cases import Case, parse_spec
from mhattn.conformance.inputs import CaseInputs, make_inputs
from mhattn.conformance.poison import poisoned_allocations, prefill_cuda_cache
from mhattn.conformance.tolerance import Comparison
from mhattn.reference.naive import naive_attention

PASS, FAIL, UNSUPPORTED = "pass", "fail", "unsupported"
NOT_RUN = "not run"  # the run's time limit came first
HALF_DTYPES = (torch.float16, torch.bfloat16)

# Cases whose (B, H, Nq, Nk) score matrix has more elements than this release cached GPU memory after.
_BIG_CASE_ELEMENTS = 1 << 24


@dataclass
class CaseResult:
    """The verdict on one case: status, every check made, and why it was not run or what went wrong."""

    case: Case
    status: str                                   # PASS, FAIL, UNSUPPORTED or NOT_RUN
    checks: list = field(default_factory=list)    # tolerance.Comparison, in the order made
    reasons: list = field(default_factory=list)   # UNSUPPORTED: the backend's reasons; NOT_RUN: why not
    error: str = ""                               # FAIL by exception: the exception, with where it came from
    seconds: float = 0.0
    kernels: list = field(default_factory=list)   # the backend's kernel families for the case (kernel_families)

    @property
    def worst_ratio(self) -> float:
        """The largest err / bound of the tolerance checks (out, lse, dq, dk, dv, dmask), and of any failed
        check (inf for NaN, an exception or a broken contract); 0 with no checks."""
        ratios = [c.ratio for c in self.checks if c.name.split("[")[0] in tolerance.FACTORS or not c.ok]
        if self.error:
            ratios.append(math.inf)
        return max(ratios, default=0.0)

    @property
    def failed_checks(self) -> list:
        return [c for c in self.checks if not c.ok]

    def summary(self) -> str:
        """One line: what failed and by how much."""
        if self.status == UNSUPPORTED:
            return "unsupported: " + "; ".join(self.reasons)
        if self.status == NOT_RUN:
            return "not run: " + "; ".join(self.reasons)
        if self.status == PASS:
            return f"pass (worst ratio {self.worst_ratio:.2f})"
        parts = [str(c) for c in self.failed_checks]
        if self.error:
            parts.append(self.error.splitlines()[0] if self.error else "")
        return "FAIL: " + "; ".join(parts)

    def to_dict(self) -> dict:
        return {
            "backend": self.case.backend,
            "case": self.case.spec(),
            "feature": self.case.feature,
            "dtype": self.case.dtype,
            "status": self.status,
            "worst_ratio": _json_float(self.worst_ratio),
            "checks": [dict(asdict(c), err=_json_float(c.err), bound=_json_float(c.bound), ratio=_json_float(c.ratio))
                       for c in self.checks],
            "reasons": list(self.reasons),
            "error": self.error,
            "seconds": round(self.seconds, 4),
            "kernels": list(self.kernels),
            "command": self.case.command(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "CaseResult":
        case = parse_spec(data["case"], data["backend"])
        checks = [Comparison(c["name"], c["ok"], _float(c["err"]), _float(c["bound"]), _float(c["ratio"]), c.get("note", ""))
                  for c in data.get("checks", [])]
        return cls(case, data["status"], checks, list(data.get("reasons", [])), data.get("error", ""),
                   float(data.get("seconds", 0.0)), list(data.get("kernels", [])))


def _json_float(x: float):
    # JSON has no inf/nan: write them as strings
    return x if math.isfinite(x) else str(x)


def _float(x) -> float:
    return float(x)


# ---- the judged run ------------------------------------------------------------------------------


def not_run(case: Case, why: str) -> CaseResult:
    return CaseResult(case, NOT_RUN, reasons=[why])


def run_case(backend, case: Case) -> CaseResult:
    """Run ``case`` on ``backend`` and judge it. Never raises: an exception is a FAIL with its message."""
    start = time.perf_counter()
    inputs = None
    try:
        # KV-cache and varlen cases go through their own entry points (mhattn.conformance.packed).
        on_packed = case.feature in packed.FEATURES
        inputs = (packed.make_inputs if on_packed else make_inputs)(case, case.device)
        reasons = list(backend.unsupported(inputs.problem))
        if reasons:
            return CaseResult(case, UNSUPPORTED, reasons=reasons, seconds=time.perf_counter() - start)
        kernels = kernel_families(backend, inputs.problem)
        checks = (packed.judge if on_packed else _judge)(backend, case, inputs)
        status = PASS if all(c.ok for c in checks) else FAIL
        return CaseResult(case, status, checks=checks, seconds=time.perf_counter() - start, kernels=kernels)
    except Exception as error:  # a crashing kernel is a failure of this case, not of the suite
        return CaseResult(case, FAIL, error=_describe_error(error), seconds=time.perf_counter() - start)
    finally:
        big = inputs is not None and case.batch * case.heads_q * case.seqlen_q * case.seqlen_k > _BIG_CASE_ELEMENTS
        del inputs
        if big:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def kernel_families(backend, problem) -> list:
    """Which of the backend's kernel families run the case, as the backend names them from the problem
    (Backend.forward_path / backward_path; rows that turn out misaligned for a family may still take another),
    without the reasons: e.g. ["forward: the Gluon Hopper forward (hopper_forward.py)", ...]."""
    families = []
    for what in ("forward", "backward"):
        path = getattr(backend, f"{what}_path", lambda problem: None)(problem)
        if path:
            families.append(f"{what}: " + (path.split(")")[0] + ")" if ")" in path else path))
    return families


def _describe_error(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    text = f"{type(error).__name__}: {error}".strip()
    if len(text) > 2000:
        text = text[:2000] + " ..."
    return text + where


@contextlib.contextmanager
def _deterministic(on: bool):
    """torch.use_deterministic_algorithms(True) inside the block (backends may read it to pick their
    deterministic path), restored after."""
    if not on:
        yield
        return
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            # torch warns about its own non-deterministic ops (cuBLAS without a workspace config); the
            # bitwise comparison of the repeated backward is the judge here
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fp32_relative_bound(backend, device) -> float:
    """The relative bound for float32 inputs: TF32's where the backend says it uses TF32 on this device.

    A backend states it with an attribute ``fp32_matmul`` ("tf32" or "ieee", or a callable taking the
    device and returning one of them); without it, TF32 is assumed on CUDA when torch allows it.
    """
    if device.type != "cuda":
        return tolerance.FP32_RELATIVE
    declared = getattr(backend, "fp32_matmul", None)
    if callable(declared):
        declared = declared(device)
    if declared is None:
        tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
        declared = "tf32" if tf32 else "ieee"
    return tolerance.TF32_RELATIVE if str(declared).lower() == "tf32" else tolerance.FP32_RELATIVE


def reference_results(inputs: CaseInputs, keep, dtype) -> dict:
    """The naive reference on ``inputs`` cast to ``dtype``: out, lse and (by autograd) dq, dk, dv, dmask.

    The float mask gradient is taken on a full (B, H, Nq, Nk) copy, so it is dS in the shape the backend
    returns. A grad_lse entry on a row that sees no key is dropped (the row's lse is -inf, its gradient 0).
    """
    params = inputs.params
    q = inputs.q.detach().to(dtype).requires_grad_()
    k = inputs.k.detach().to(dtype).requires_grad_()
    v = inputs.v.detach().to(dtype).requires_grad_()
    mask = inputs.mask
    leaves = [q, k, v]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.detach().to(dtype)
        if params.mask_requires_grad:
            mask = mask.contiguous().requires_grad_()
            leaves.append(mask)
    out, lse = naive_attention(q, k, v, params, mask=mask, keep=keep)
    outputs, grads = [out], [inputs.grad_out.to(dtype)]
    if inputs.grad_lse is not None:
        outputs.append(lse)
        grads.append(inputs.grad_lse.to(dtype).masked_fill(torch.isinf(lse.detach()), 0.0))
    grad = torch.autograd.grad(outputs, leaves, grads)
    results = {"out": out.detach(), "lse": lse.detach(), "dq": grad[0], "dk": grad[1], "dv": grad[2]}
    if params.mask_requires_grad:
        results["dmask"] = grad[3]
    return results


def _contract_check(name: str, ok: bool, note: str) -> Comparison:
    return Comparison(name, bool(ok), 0.0, 0.0, 0.0 if ok else math.inf, "" if ok else f" ({note})")


def _judge(backend, case: Case, inputs: CaseInputs) -> list:
    q, k, v, params = inputs.q, inputs.k, inputs.v, inputs.params
    device = q.device
    dtype = case.torch_dtype
    b, hq, nq, nk = case.batch, case.heads_q, case.seqlen_q, case.seqlen_k
    checks = []

    keep = None
    if params.dropout_p > 0.0:
        keep = backend.dropout_keep_mask(b, hq, nq, nk, params, device)
        ok = isinstance(keep, torch.Tensor) and keep.dtype == torch.bool and tuple(keep.shape) == (b, hq, nq, nk)
        checks.append(_contract_check("keep mask", ok, f"dropout_keep_mask must return bool (B, H, Nq, Nk) = "
                                      f"{(b, hq, nq, nk)}, got {getattr(keep, 'dtype', type(keep))} "
                                      f"{tuple(getattr(keep, 'shape', ()))}"))
        if not ok:
            return checks
        checks.append(_keep_rate_check(keep, params.dropout_p))

    originals = [t.detach().clone() for t in (q, k, v, inputs.grad_out)]
    lse_dtype = layouts.lse_dtype(dtype)
    out_shape, lse_shape = (b, hq, nq, case.value_dim), (b, hq, nq)
    grad_shapes = [(tuple(q.shape), dtype), (tuple(k.shape), dtype), (tuple(v.shape), dtype)]
    if params.mask_requires_grad:
        grad_shapes.append(((b, hq, nq, nk), params.mask.dtype))

    with _deterministic(case.det_runs > 0):
        prefill_cuda_cache([(out_shape, dtype), (lse_shape, lse_dtype)], device)
        with poisoned_allocations():
            out, lse = backend.forward(q, k, v, params)
        _sync(device)
        prefill_cuda_cache(grad_shapes, device)
        with poisoned_allocations():
            dq, dk, dv, dmask = backend.backward(inputs.grad_out, q, k, v, out, lse, params, grad_lse=inputs.grad_lse)
        _sync(device)
        # compared as they come, so 50 runs never hold 50 sets of gradients
        repeat_checks = []
        for run in range(2, case.det_runs + 1):
            with poisoned_allocations():
                repeat = backend.backward(inputs.grad_out, q, k, v, out, lse, params, grad_lse=inputs.grad_lse)
            repeat_checks.append(_bitwise_check(f"backward run {run} == run 1", (dq, dk, dv, dmask), repeat))
            del repeat

    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    expected_dtypes = {"out": dtype, "lse": lse_dtype, "dq": dtype, "dk": dtype, "dv": dtype}
    if params.mask_requires_grad:
        got["dmask"] = dmask
        expected_dtypes["dmask"] = params.mask.dtype
    elif dmask is not None:
        checks.append(_contract_check("dmask", False, "backward returned a mask gradient though none was asked for"))
    for name, tensor in got.items():
        if not isinstance(tensor, torch.Tensor):
            checks.append(_contract_check(name, False, f"expected a tensor, got {type(tensor).__name__}"))
        elif tensor.dtype != expected_dtypes[name]:
            checks.append(_contract_check(f"{name} dtype", False, f"expected {expected_dtypes[name]}, got {tensor.dtype}"))
        elif tensor.device != device:
            checks.append(_contract_check(f"{name} device", False, f"expected {device}, got {tensor.device}"))

    gold = reference_results(inputs, keep, torch.float64)
    lowp = reference_results(inputs, keep, dtype) if dtype in HALF_DTYPES else None
    relative = None
    if dtype == torch.float32:
        relative = fp32_relative_bound(backend, device)
    elif dtype == torch.float64:
        relative = tolerance.FP64_RELATIVE
    # Gradients that cancel to exactly 0 (every row sees one key: P = 1, so dS = 0) are judged on the
    # scale of the largest gradient, the size of the terms that cancel.
    grad_scale = max(_max_abs(gold[name]) for name in ("dq", "dk", "dv"))
    for name, tensor in got.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        floor_scale = grad_scale if name in ("dq", "dk", "dmask") and _max_abs(gold[name]) == 0.0 else None
        checks.append(tolerance.compare(name, tensor, gold[name], None if lowp is None else lowp[name], dtype=dtype,
                                        relative=relative, floor_scale=floor_scale))

    checks += _masked_row_checks(got, gold, case)
    checks += repeat_checks
    changed = [name for name, before, now in zip(("q", "k", "v", "grad_out"), originals, (q, k, v, inputs.grad_out))
               if not torch.equal(before, now)]
    checks.append(_contract_check("inputs unchanged", not changed, f"the backend wrote into {', '.join(changed)}"))
    return checks


def _max_abs(t: torch.Tensor) -> float:
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def _keep_rate_check(keep: torch.Tensor, p: float) -> Comparison:
    # A keep mask that keeps everything (or too little) would make the dropout comparison pass trivially.
    n = keep.numel()
    kept = float(keep.float().mean())
    if n < 256:
        return Comparison("keep rate", True, 0.0, 0.0, 0.0, f" ({n} elements: too few to judge the rate)")
    sigma = math.sqrt(p * (1.0 - p) / n)
    bound = max(6.0 * sigma, 1e-3)
    err = abs(kept - (1.0 - p))
    note = "" if err <= bound else f" (kept {kept:.4f} of the elements, expected {1.0 - p:.4f})"
    return Comparison("keep rate", err <= bound, err, bound, err / bound, note)


def _masked_row_checks(got: dict, gold: dict, case: Case) -> list:
    """Rows where the gold lse is -inf (no visible key): output and dq exactly 0, dmask 0 on the row."""
    dead = torch.isinf(gold["lse"])
    if not bool(dead.any()):
        return []
    checks = []
    for name in ("out", "dq", "dmask"):
        tensor = got.get(name)
        if not isinstance(tensor, torch.Tensor) or tensor.shape[:3] != dead.shape:
            continue
        rows = tensor.detach().to(dead.device)[dead]
        ok = bool(torch.isfinite(rows).all()) and bool((rows == 0).all())
        worst = float(rows.double().abs().nan_to_num(math.inf).max()) if rows.numel() else 0.0
        checks.append(Comparison(f"{name}[rows without keys]", ok, worst, 0.0, 0.0 if ok else math.inf,
                                 "" if ok else f" (must be exactly 0 on the {int(dead.sum())} rows that see no key)"))
    return checks


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    # compared as integers, so NaNs in the same places with the same bits count as equal
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        as_int = _SAME_SIZE_INT[a.element_size()]
        return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
    return torch.equal(a, b)


def _bitwise_check(name: str, first, repeat) -> Comparison:
    differing = []
    for label, a, b in zip(("dq", "dk", "dv", "dmask"), first, repeat):
        if a is None and b is None:
            continue
        if a is None or b is None or not _bitwise_equal(a, b):
            differing.append(label)
    ok = not differing
    return Comparison(name, ok, 0.0, 0.0, 0.0 if ok else math.inf, "" if ok else f" ({', '.join(differing)} differ)")
