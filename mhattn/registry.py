"""The backend registry: built-ins, third-party backends registered by call or entry point.

Registering a backend makes it selectable by name (``backend=``, ``use_backend``, ``MHATTN_BACKEND``);
it takes part in automatic selection only where the priority table (``mhattn.dispatch``) names it, or names the
backend it is a variant of (``Backend.variant_of``) and a timing table measured it fastest. Two registered
backends joined by ``+`` name a pair: the forward of the first, the backward of the second
(:mod:`mhattn.backends.paired`).
"""

from __future__ import annotations

import importlib
import threading
import warnings

from mhattn.backends.base import Backend, Capabilities
from mhattn.backends.paired import PairedBackend, pair_name, split_pair_name
from mhattn.errors import UnknownBackendError

ENTRY_POINT_GROUP = "mhattn.backends"

# name -> module path and class of the built-in backends, in registration order.
_BUILTINS = (
    ("reference", "mhattn.reference.backend", "ReferenceBackend"),
    ("triton", "mhattn.backends.triton", "TritonBackend"),
    ("cupy", "mhattn.backends.cupy", "CupyBackend"),
    ("sdpa", "mhattn.backends.sdpa", "SdpaBackend"),
)
# Built-in backends made by a function of a built-in's module, registered after it: the sdpa backend pinned to each
# of torch's CUDA kernels ("sdpa.cudnn", ...; Backend.variant_of). None where the module failed to import (its
# backend then stands for it as a BrokenBackend).
_BUILTIN_VARIANTS = (
    ("mhattn.backends.sdpa", "pinned_backends"),
)

_lock = threading.RLock()
_backends: dict = {}
_loaded = False
_listeners: list = []  # callables run when the registry changes (the dispatcher clears its cache)
_pairs: dict = {}  # pair name -> PairedBackend, made on first use; emptied when the registry changes


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
        for module_name, function_name in _BUILTIN_VARIANTS:
            try:
                variants = getattr(importlib.import_module(module_name), function_name)()
            except Exception:  # the module's own backend says why, as a BrokenBackend
                variants = []
            for backend in variants:
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
    if not isinstance(name, str) or not name or name != name.lower() or name == "auto" or split_pair_name(name):
        raise ValueError("register_backend: backend.name must be a non-empty lowercase string other than 'auto' and "
                         f"without '+' (which joins a pair's names), got {name!r}")
    _load()
    with _lock:
        if name in _backends and not replace:
            raise ValueError(f"register_backend: a backend named {name!r} is already registered (pass replace=True)")
        _backends[name] = backend
        _pairs.clear()
        for listener in _listeners:
            listener()
    return backend


def unregister_backend(name: str) -> None:
    """Remove a backend registered under ``name`` (the built-ins can be removed too, e.g. in tests)."""
    _load()
    with _lock:
        _backends.pop(name, None)
        _pairs.clear()
        for listener in _listeners:
            listener()


def get_backend(name: str) -> Backend:
    """The backend registered under ``name`` (case-insensitive), or the pair ``"<forward>+<backward>"`` of two
    different registered backends."""
    _load()
    key = name.strip().lower() if isinstance(name, str) else name
    try:
        return _backends[key]
    except (KeyError, TypeError):
        pair = _pair(key) if isinstance(key, str) else None
        if pair is None:
            raise UnknownBackendError(f"unknown backend {name!r}; {valid_names()}") from None
        return pair


def valid_names() -> str:
    """What a backend request may name, for error messages."""
    return (f"valid names: {', '.join(['auto'] + names())}, or a forward and a backward backend joined by '+' "
            "(e.g. triton+sdpa)")


def _pair(key: str):
    """The PairedBackend that ``key`` names, or None when it names none (not two different registered backends)."""
    parts = split_pair_name(key)
    if parts is None or parts[0] == parts[1] or parts[0] not in _backends or parts[1] not in _backends:
        return None
    name = pair_name(*parts)
    with _lock:
        pair = _pairs.get(name)
        if pair is None:
            pair = _pairs[name] = PairedBackend(_backends[parts[0]], _backends[parts[1]])
    return pair


def is_backend_name(name: str) -> bool:
    """Whether ``name`` (lowercase, stripped) is a registered backend or a pair of two."""
    _load()
    return name in _backends or _pair(name) is not None


def variant_base(name: str):
    """The backend that the registered backend ``name`` is a variant of (Backend.variant_of), or None for a backend of
    its own, a pair, or a name that is not registered."""
    _load()
    backend = _backends.get(name)
    return None if backend is None else backend.variant_of


def variants_of(name: str) -> list:
    """The names of the registered variants of backend ``name`` (Backend.variant_of), in registration order."""
    _load()
    return [backend.name for backend in list(_backends.values()) if backend.variant_of == name]


def names() -> list:
    """Names of every registered backend, in registration order."""
    _load()
    return list(_backends)


def all_backends() -> list:
    _load()
    return list(_backends.values())


def on_change(listener) -> None:
    _listeners.append(listener)
