"""Peak extra memory of one forward+backward, against N: where O(N) and O(N^2) part ways.

PERFORMANCE.md's shape: causal, B = 1, H = 16, d = 128, bf16, N = 1k .. 32k. "Extra" is what one
forward+backward allocates on top of its inputs: ``torch.cuda.max_memory_allocated()`` during the call
minus ``torch.cuda.memory_allocated()`` before it, with q, k, v and the output gradient already
allocated. It includes the output, the saved log-sum-exp, the gradients dq, dk, dv and every scratch
buffer; ``beyond_outputs_bytes`` subtracts out, dq, dk and dv, which every implementation must allocate.
A warm-up call runs first so compilation, autotuning and library workspaces are not counted.
"""

from __future__ import annotations

import torch

from mhattn.benchmark import protocol
from mhattn.benchmark.timing import describe_error, free_memory, release_memory, result_row

SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768)
BATCH, HEADS, HEAD_DIM, CAUSAL = 1, 16, 128, True


def memory_shape(seqlen: int, dtype: str = "bf16", *, batch: int = BATCH, heads: int = HEADS,
                 head_dim: int = HEAD_DIM, causal: bool = CAUSAL) -> protocol.Shape:
    return protocol.Shape(protocol.canonical_dtype(dtype), batch, heads, seqlen, head_dim, causal)


def memory_row(impl: protocol.Implementation, shape: protocol.Shape) -> dict:
    row = result_row(impl, shape)
    row.update(kind="memory", peak_extra_bytes=None, beyond_outputs_bytes=None, status="skipped")
    return row


def measure_peak_memory(impl: protocol.Implementation, shape: protocol.Shape, device) -> dict:
    """Peak extra bytes of one forward+backward of ``impl`` on ``shape`` (see the module docstring).

    Never raises for a failure of the implementation: ``status`` is 'ok', 'n/a: ...', 'OOM' or 'error: ...'.
    """
    row = memory_row(impl, shape)
    device = torch.device(device)
    if device.type != "cuda":
        row["status"] = "n/a: peak memory needs CUDA memory statistics (a GPU)"
        return row
    inputs = None
    try:
        inputs = protocol.make_inputs(shape, device)
        q, k, v, dout = inputs
        reasons = impl.unsupported(q, k, v, shape.causal)
        if reasons:
            row["status"] = "n/a: " + "; ".join(reasons)
            return row
        free = free_memory(device)
        need = impl.scratch_bytes(shape, "fwd_bwd")
        if need > free:
            row["status"] = f"OOM: needs ~{need / 2**30:.1f} GiB of O(N^2) scratch, {free / 2**30:.1f} GiB free"
            return row

        def forward_backward():
            out = impl(q, k, v, shape.causal)
            return torch.autograd.grad(out, (q, k, v), dout)

        with impl.context():
            grads = forward_backward()  # warm-up
            del grads
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            baseline = torch.cuda.memory_allocated(device)
            grads = forward_backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(device) - baseline
            del grads
        outputs = 4 * q.numel() * q.element_size()  # out, dq, dk, dv
        row.update(peak_extra_bytes=int(peak), beyond_outputs_bytes=int(peak - outputs), status="ok")
    except Exception as error:  # report, never crash the sweep
        row["status"] = describe_error(error)
    finally:
        inputs = None
        release_memory(device)
    return row
