"""A forward on one backend and its backward on another: the backend named ``"<forward>+<backward>"``.

Every backend's forward returns the output and the natural-log log-sum-exp in the contract's form
(:meth:`Backend.forward`), and every backend's backward takes exactly those (:meth:`Backend.backward`), so the
backward of one may follow the forward of another. Where one backend's forward is the fastest and another's
backward, the pair beats both (on the H100, for instance, the Triton forward with cuDNN's backward through the
sdpa backend at d = 128 from 1k keys). ``mhattn tune`` times a pair where its two halves were fastest apart and
its gradients equal the backward backend's own; automatic selection takes it where a timing table measured it
fastest. It can be asked for by name as well: ``backend="triton+sdpa"``.

A pair has no path of its own for calls that return no lse (its halves' autograd nodes cannot be joined), so its
calls always go through mhattn's autograd Function; it runs plain attention only (no KV cache or packed
sequences, whose entry points have no backward of their own to pair).
"""

from __future__ import annotations

from typing import Optional

from mhattn.backends.base import Backend, Capabilities

SEPARATOR = "+"


def pair_name(forward_name: str, backward_name: str) -> str:
    return f"{forward_name}{SEPARATOR}{backward_name}"


def split_pair_name(name: str) -> Optional[tuple]:
    """(forward backend name, backward backend name) of a pair's name, or None for any other name."""
    if SEPARATOR not in name:
        return None
    forward_name, _, backward_name = name.partition(SEPARATOR)
    return forward_name.strip(), backward_name.strip()


def joint_capabilities(first: Capabilities, second: Capabilities) -> Capabilities:
    """What both backends can run (plain attention only)."""
    highest = [cc for cc in (first.min_compute_capability, second.min_compute_capability) if cc is not None]
    return Capabilities(device_types=first.device_types & second.device_types, dtypes=first.dtypes & second.dtypes,
                        min_head_dim=max(first.min_head_dim, second.min_head_dim),
                        max_head_dim=min(first.max_head_dim, second.max_head_dim),
                        min_compute_capability=max(highest) if highest else None,
                        features=first.features & second.features, operations=frozenset({"attention"}))


class PairedBackend(Backend):
    """The forward of ``forward_backend`` and the backward of ``backward_backend`` (two different backends)."""

    def __init__(self, forward_backend: Backend, backward_backend: Backend):
        self.forward_backend, self.backward_backend = forward_backend, backward_backend
        self.name = pair_name(forward_backend.name, backward_backend.name)
        self.capabilities = joint_capabilities(forward_backend.capabilities, backward_backend.capabilities)
        self.description = f"the forward of {forward_backend.name}, the backward of {backward_backend.name}"

    def unavailable(self) -> list:
        return ([f"forward on {self.forward_backend.name}: {why}" for why in self.forward_backend.unavailable()]
                + [f"backward on {self.backward_backend.name}: {why}" for why in self.backward_backend.unavailable()])

    def unsupported(self, problem) -> list:
        """Both backends' reasons: a pair runs only what each of its halves can (a forward asked for without a
        gradient may still be differentiated later, e.g. by a caller that checks support once)."""
        reasons = [f"forward on {self.forward_backend.name}: {why}"
                   for why in self.forward_backend.unsupported(problem)]
        reasons += [f"backward on {self.backward_backend.name}: {why}"
                    for why in self.backward_backend.unsupported(problem)]
        if getattr(problem, "operation", "attention") != "attention":
            reasons.append("a forward+backward pair runs plain attention only (no KV cache or packed sequences)")
        if "dropout" in problem.features and (type(self.forward_backend).dropout_keep_mask
                                              is not type(self.backward_backend).dropout_keep_mask):
            reasons.append(f"dropout: {self.forward_backend.name} and {self.backward_backend.name} may draw different "
                           "masks for one seed")
        return reasons

    def forward(self, q, k, v, params):
        return self.forward_backend.forward(q, k, v, params)

    def backward(self, grad_out, q, k, v, out, lse, params, grad_lse=None):
        return self.backward_backend.backward(grad_out, q, k, v, out, lse, params, grad_lse=grad_lse)

    def forward_path(self, problem) -> Optional[str]:
        path = self.forward_backend.forward_path(problem)
        return f"{self.forward_backend.name}: {path}" if path else self.forward_backend.name

    def backward_path(self, problem) -> Optional[str]:
        path = self.backward_backend.backward_path(problem)
        return f"{self.backward_backend.name}: {path}" if path else self.backward_backend.name

    def dropout_keep_mask(self, batch, heads, seqlen_q, seqlen_k, params, device):
        return self.forward_backend.dropout_keep_mask(batch, heads, seqlen_q, seqlen_k, params, device)
