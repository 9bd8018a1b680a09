"""FlashAttention-2 in Triton (placeholder until the kernels land)."""

from mhattn.backends.base import Backend, Capabilities


class TritonBackend(Backend):
    name = "triton"
    description = "FlashAttention-2 in Triton"
    capabilities = Capabilities()

    def unavailable(self):
        return ["the Triton kernels are not part of this build yet"]
