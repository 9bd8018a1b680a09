"""The backend registry: built-ins, third-party backends registered by call or entry point.

Registering a backend makes it selectable by name (``backend=``, ``use_backend``, ``MHATTN_BACKEND``);
it takes part in automatic selection only where the priority table (``mhattn.dispatch``) names it.
"""

from __future__ import annotations

import importlib
import threading
import warnings

from mhattn.backends.base import Backend, Capabilities
from mhattn.errors import UnknownBackendError

ENTRY_POINT_GROUP = "mhattn.backends"

# name -> module path and class of the built-in backends, in registration order.
_BUILTINS = (
    ("reference", "mhattn.reference.backend", "ReferenceBackend"),
    ("triton", "mhattn.backends.triton", "TritonBackend"),
    ("cupy", "mhattn.backends.cupy", "CupyBackend"),
    ("sdpa", "mhattn.backends.sdpa", "SdpaBackend"),
)

_lock = threading.RLock()
_backends: dict = {}
_loaded = False
_listeners: list = []  # callables run when the registry changes (the dispatcher clears its cache)


class BrokenBackend(Backend):
    """Stands in for a backend whose module failed to import, and says why."""

    def __init__(self, name: str, error: BaseException):
        self.name = name
        self.capabilities = Capabilities(device_types=frozenset(), dtypes=frozenset(), features=frozenset())
        self._reason = f"failed to load: {type(error).__name__}: {error}"
        self.description = self._reason

    def unavailable(self):
        return [self._reason]


def _load():
    global _loaded
    with _lock:
        if _loaded:
            return
        for name, module_name, class_name in _BUILTINS:
            try:
                backend = getattr(importlib.import_module(module_name), class_name)()
            except Exception as error:  # an import problem must not break the other backends
                backend = BrokenBackend(name, error)
            _backends[backend.name] = backend
        _loaded = True
        _load_entry_points()


def _load_entry_points():
    from importlib.metadata import entry_points

    try:
        found = entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # a broken distribution's metadata must not stop mhattn from importing
        return
    for entry in found:
        try:
            obj = entry.load()
            backend = obj() if isinstance(obj, type) else obj
            register_backend(backend, replace=False)
        except Exception as error:
            warnings.warn(f"mhattn: entry point {entry.name!r} in group {ENTRY_POINT_GROUP!r} failed: {error}")


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Register ``backend`` (an instance of :class:`mhattn.Backend`) under ``backend.name``.

    It becomes selectable by name; add it to automatic selection with :func:`mhattn.set_priority`.
    ``replace=True`` swaps out a backend already registered under that name.
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend: backend must be an instance of mhattn.Backend, got {type(backend).__name__}")
    name = backend.name
    if not isinstance(name, str) or not name or name != name.lower() or name == "auto":
        raise ValueError(f"register_backend: backend.name must be a non-empty lowercase string other than 'auto', got {name!r}")
    _load()
    with _lock:
        if name in _backends and not replace:
            raise ValueError(f"register_backend: a backend named {name!r} is already registered (pass replace=True)")
        _backends[name] = backend
        for listener in _listeners:
            listener()
    return backend


def unregister_backend(name: str) -> None:
    """Remove a backend registered under ``name`` (the built-ins can be removed too, e.g. in tests)."""
    _load()
    with _lock:
        _backends.pop(name, None)
        for listener in _listeners:
            listener()


def get_backend(name: str) -> Backend:
    """The backend registered under ``name`` (case-insensitive)."""
    _load()
    key = name.strip().lower() if isinstance(name, str) else name
    try:
        return _backends[key]
    except (KeyError, TypeError):
        raise UnknownBackendError(
            f"unknown backend {name!r}; valid names: {', '.join(['auto'] + names())}"
        ) from None


def names() -> list:
    """Names of every registered backend, in registration order."""
    _load()
    return list(_backends)


def all_backends() -> list:
    _load()
    return list(_backends.values())


def on_change(listener) -> None:
    _listeners.append(listener)
