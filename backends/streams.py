"""torch's current CUDA stream as a raw handle, for the launchers that hand it to a driver-level launch."""

from __future__ import annotations

import torch

_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device_index: int) -> int:
    """The raw handle of torch's current CUDA stream of a device (what ``torch.cuda.current_stream(i)
    .cuda_stream`` gives, without making a Stream object)."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream
