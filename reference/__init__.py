"""Naive PyTorch attention: the gold standard and the CPU path (installed as ``mhattn.reference``)."""

from mhattn.reference.naive import naive_attention, visible
from mhattn.reference.backend import ReferenceBackend

__all__ = ["naive_attention", "visible", "ReferenceBackend"]
