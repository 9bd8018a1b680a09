"""Whether this process's CUDA context still works (long runs use it to restart after a kernel fault)."""

import torch


def cuda_context_ok() -> bool:
    """False when an earlier error (an illegal address, a device-side assert) broke the CUDA context:
    every later CUDA call in this process would fail too. True without a GPU."""
    if not torch.cuda.is_available():
        return True
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return True
    except Exception:
        return False
