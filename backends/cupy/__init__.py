"""FlashAttention-2 in CUDA C++ compiled through CuPy (placeholder until the kernels land)."""

from mhattn.backends.base import Backend, Capabilities


class CupyBackend(Backend):
    name = "cupy"
    description = "FlashAttention-2 in CUDA C++, compiled at run time through CuPy (NVRTC)"
    capabilities = Capabilities()

    def unavailable(self):
        return ["the CUDA kernels are not part of this build yet"]
