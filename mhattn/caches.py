"""The bounded caches of the call path (decisions, call signatures, plans, compiled handles): insertion with the
oldest entry making room, so a program with ever-new shapes keeps working at a bounded memory."""

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
