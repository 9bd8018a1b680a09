"""GPU check: torch's cuDNN attention backward behind outputs of two memory layouts, and the pairs of backends.

    source benchmarks/device_env.sh && cd /tmp && python3 $OLDPWD/benchmarks/check_cudnn_graph_cache.py

torch caches a cuDNN backward graph by q, k and v's strides alone. This calls torch's cuDNN backward op directly
(no mhattn layout handling) twice per shape with one q layout: the output and its gradient first in one layout,
then in the other ((B, H, N, d)-contiguous, and the row-major heads layout the Triton and CuPy forwards write),
and prints each call's largest gradient error against the float64 reference. A second call that reuses the
first call's graph reads the output wrongly. Then it runs each pair of backends through ``mhattn.attention``
(whose sdpa backend hands cuDNN's backward the output in q's layout) and prints the same errors.
"""

import math

import torch

import mhattn
from mhattn.backends import layouts, sdpa
from mhattn.backends.base import AttentionParams

DTYPE = torch.bfloat16


def draw(shape, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen) for _ in range(4)]


def reference_grads(q, k, v, grad_out):
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*ref)
    return torch.autograd.grad(out, ref, grad_out.double())


def errors(got, want) -> str:
    return " ".join(f"{name}={float((a.double() - b).abs().max()):.3g}" for name, a, b in zip(("dq", "dk", "dv"), got, want))


def raw_cudnn_backward_in_two_layouts(shape, rows_major_first: bool):
    q, k, v, grad_out = draw(shape, 3)
    want = reference_grads(q, k, v, grad_out)
    scale = 1 / math.sqrt(shape[-1])
    plan = sdpa._Plan.make(q, k, AttentionParams(scale=scale))
    out, lse = sdpa._CudaCudnn.forward(q, k, v, scale, plan)
    rows_major = layouts.placed(out, layouts.rows_major_strides(*out.shape))
    for placed in ((rows_major, out.contiguous()) if rows_major_first else (out.contiguous(), rows_major)):
        got = sdpa._CudaCudnn.backward(torch.empty_like(placed).copy_(grad_out), q, k, v, placed, lse, scale, plan)
        torch.cuda.synchronize()
        print(f"torch's cuDNN backward op, {tuple(shape)}, out strides {placed.stride()}: {errors(got, want)}",
              flush=True)


def pairs_through_mhattn(shape, names):
    q, k, v, grad_out = draw(shape, 4)
    want = reference_grads(q, k, v, grad_out)
    for name in names:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        got = torch.autograd.grad(mhattn.attention(*leaves, backend=name), leaves, grad_out)
        print(f"mhattn.attention(backend={name!r}), {tuple(shape)}: {errors(got, want)}", flush=True)


if __name__ == "__main__":
    print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name())
    raw_cudnn_backward_in_two_layouts((2, 4, 2048, 128), rows_major_first=True)
    raw_cudnn_backward_in_two_layouts((2, 4, 1024, 128), rows_major_first=False)
    pairs_through_mhattn((2, 4, 2048, 64), ("triton+sdpa", "sdpa+triton", "cupy+sdpa", "sdpa"))
