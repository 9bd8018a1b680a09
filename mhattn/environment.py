"""Environment variables read at every call, cheaply.

``os.environ.get(name)`` encodes the key at every call (about 0.5 us on a CPU, more on a busy GPU host). CPython's
``os.environ`` keeps its values in a store keyed by the encoded name, and every change made through ``os.environ``
(``monkeypatch.setenv`` included) lands there, so reading that store with the key encoded once sees the same
values at a fraction of the cost.
"""

from __future__ import annotations

import os


def raw_store(name: str) -> tuple:
    """``(store, key)``: ``store.get(key)`` is environment variable ``name``'s value as os.environ stores it (bytes
    on POSIX, see :func:`decoded`), or None while it is unset."""
    try:
        return os.environ._data, os.environ.encodekey(name)
    except AttributeError:  # pragma: no cover - an os.environ without CPython's store
        return os.environ, name


def decoded(raw) -> str:
    """A value read through :func:`raw_store` as a str."""
    return os.fsdecode(raw)
