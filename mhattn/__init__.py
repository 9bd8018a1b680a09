"""mhattn: multi-backend FlashAttention-2 for PyTorch.

Public entry points: :func:`attention` (SDPA drop-in), :class:`MultiheadAttention`
(``torch.nn.MultiheadAttention`` drop-in), :func:`attention_with_kvcache` (decoding over a KV cache,
contiguous or paged), :func:`varlen_attention` (packed sequences), :func:`explain`, :func:`use_backend`,
:func:`register_backend`, :func:`set_priority` and :func:`replace_multihead_attention`.
"""

__version__ = "0.1.0"

from mhattn.backends.base import FEATURES, OPERATIONS, AttentionParams, Backend, Capabilities, KVCache, Packing
from mhattn.errors import BackendUnavailableError, InputError, MhattnError, UnknownBackendError
from mhattn.registry import get_backend, register_backend, unregister_backend
from mhattn.registry import names as backend_names
from mhattn.dispatch import Decision, set_priority, use_backend
from mhattn.functional import attention, explain
from mhattn.decode import attention_with_kvcache
from mhattn.varlen import varlen_attention
from mhattn.modules import MultiheadAttention, replace_multihead_attention
from mhattn import distributed  # context parallelism: mhattn.distributed.ring_attention

__all__ = [
    "attention", "attention_with_kvcache", "varlen_attention", "explain", "use_backend", "register_backend", "unregister_backend", "get_backend",
    "backend_names", "set_priority", "Backend", "Capabilities", "AttentionParams", "FEATURES", "OPERATIONS",
    "KVCache", "Packing", "Decision",
    "MultiheadAttention", "replace_multihead_attention",
    "MhattnError", "InputError", "BackendUnavailableError", "UnknownBackendError",
]
