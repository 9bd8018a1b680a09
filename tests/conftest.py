"""Shared pytest fixtures and markers: GPU tests skip cleanly on a machine without CUDA."""

import os
import tempfile

import pytest
import torch

import mhattn
from mhattn.reference import ReferenceBackend

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


class Recording(ReferenceBackend):
    """The reference backend, recording each call and the dropout seed it got (to see which backend ran)."""

    def __init__(self, name):
        self.name = name
        self.calls = []
        self.seeds = []

    def forward(self, q, k, v, params, **kwargs):
        self.calls.append("forward")
        self.seeds.append(params.seed)
        return super().forward(q, k, v, params, **kwargs)

    def backward(self, *args, **kwargs):
        self.calls.append("backward")
        return super().backward(*args, **kwargs)

    def forward_kvcache(self, q, cache, params):
        self.calls.append("kvcache")
        return super().forward_kvcache(q, cache, params)

    def forward_varlen(self, q, k, v, packing, params):
        self.calls.append("varlen_forward")
        return super().forward_varlen(q, k, v, packing, params)

    def backward_varlen(self, *args, **kwargs):
        self.calls.append("varlen_backward")
        return super().backward_varlen(*args, **kwargs)


@pytest.fixture
def recorders():
    """Two recording backends, "rec_a" and "rec_b", registered for the test."""
    made = [Recording("rec_a"), Recording("rec_b")]
    for backend in made:
        mhattn.register_backend(backend)
    yield made
    for backend in made:
        mhattn.unregister_backend(backend.name)


@pytest.fixture
def private_tables(tmp_path, monkeypatch):
    """Timing tables read and written in the test's own cache directory (none shipped, no MHATTN_TABLE), and no
    cached decision before or after the test."""
    from mhattn import dispatch
    from mhattn.tuning import table

    monkeypatch.setenv("MHATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(table.TABLE_ENV, raising=False)
    monkeypatch.setattr(table, "SHIPPED_DIR", tmp_path / "shipped")
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()
