"""Attention backends (installed as ``mhattn.backends``): the contract and the built-in kernels."""

from mhattn.backends.base import FEATURES, AttentionParams, Backend, Capabilities

__all__ = ["FEATURES", "AttentionParams", "Backend", "Capabilities"]
