"""The bounded caches of the call path (decisions, call signatures, plans, compiled handles, answers about a mask's
values): insertion with the oldest entry making room, so a program with ever-new shapes keeps working at a bounded
memory."""

from __future__ import annotations


def put_bounded(cache: dict, key, value, limit: int):
    """``cache[key] = value``; when ``cache`` already holds ``limit`` entries the oldest (first inserted) goes.
    Another thread emptying or changing the dict meanwhile only skips the eviction. Returns ``value``."""
    if len(cache) >= limit:
        try:
            cache.pop(next(iter(cache)), None)
        except (StopIteration, RuntimeError):
            pass
    cache[key] = value
    return value


def kept_for(cache: dict, tensor, make, limit: int):
    """``make(tensor)``, made once while ``tensor``'s memory is unchanged: keyed by its address, layout, device and
    version (an in-place change through any view bumps it), so another view of the same values finds the answer. The
    entry holds the tensor, so no other tensor can take its address while the entry lives; at most ``limit``
    entries (put_bounded)."""
    key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.device, tensor._version)
    found = cache.get(key)
    if found is None:
        found = put_bounded(cache, key, (tensor, make(tensor)), limit)
    return found[1]
