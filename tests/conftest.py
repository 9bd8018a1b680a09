"""Shared pytest fixtures and markers: GPU tests skip cleanly on a machine without CUDA."""

import os
import tempfile

import pytest
import torch

# torch.compile caches compiled graphs on disk keyed without our ops' fake implementations: give each
# test session its own cache so a graph compiled by an older checkout is never reused.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="mhattn-inductor-"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
