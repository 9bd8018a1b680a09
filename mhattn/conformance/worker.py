"""The worker process of an isolated conformance run (see mhattn.conformance.suite and .pool).

Reads cases (JSON lines ``{"backend", "case", "factory"}``, factory optional: 'module:Class' of a backend
registered by a call in the parent), runs them in order and appends to the results file
``{"start": i}`` before and ``{"index": i, "result": {...}}`` after each one (``{"deadline": i}`` instead
when the run's time limit passed before case i), flushed at once so the parent
sees how far it got even if this process dies. ``i`` counts the cases this worker was given, from 0.

The cases come from a file written before the worker starts, or, when the cases path is ``-``, from
stdin one line at a time as the parent hands them out (``--jobs N``: several workers share one queue);
the worker ends when stdin closes.
"""

from __future__ import annotations

import importlib
import json
import sys
import time


def _backend(registry, name: str, factory: str):
    """The registered backend ``name``; else one made from ``factory`` ('module:Class') and registered
    here; None when neither works."""
    from mhattn.errors import UnknownBackendError

    try:
        registered = registry.get_backend(name)
    except UnknownBackendError:
        registered = None
    if registered is not None:
        cls = type(registered)
        if not factory or factory == f"{cls.__module__}:{cls.__qualname__}":
            return registered
    if not factory:
        return None
    module_name, _, qualname = factory.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        backend = obj()
    except Exception:
        return None
    if getattr(backend, "name", None) != name:
        return None
    return registry.register_backend(backend, replace=True)


def _one_cpu_thread() -> None:
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)  # small CPU cases: threads only spin


def _streamed_entries(stream):
    """The cases on ``stream``, each as soon as its line is complete, until the stream closes."""
    for line in iter(stream.readline, ""):
        if line.strip():
            yield json.loads(line)


def main(cases_path: str, results_path: str, deadline=None) -> int:
    from mhattn import registry
    from mhattn.conformance.cases import parse_spec
    from mhattn.conformance.runner import FAIL, run_case
    from mhattn.conformance.suite import WORKER_CONTEXT_LOST, WORKER_UNKNOWN_BACKEND
    from mhattn.cuda_health import cuda_context_ok

    if cases_path == "-":
        entries = _streamed_entries(sys.stdin)
    else:
        with open(cases_path, "r", encoding="utf-8") as f:
            entries = [json.loads(line) for line in f if line.strip()]
        if entries and all(parse_spec(e["case"], e["backend"]).device == "cpu" for e in entries):
            _one_cpu_thread()
    with open(results_path, "a", encoding="utf-8") as out:
        def write(message):
            out.write(json.dumps(message, allow_nan=False) + "\n")
            out.flush()

        for index, entry in enumerate(entries):
            case = parse_spec(entry["case"], entry["backend"])
            if cases_path == "-" and case.device == "cpu":
                _one_cpu_thread()  # streamed cases are not known ahead: set at the first CPU case
            backend = _backend(registry, case.backend, entry.get("factory", ""))
            if backend is None:
                # registered only inside the parent process, from a class this process cannot import
                write({"unknown_backend": case.backend})
                return WORKER_UNKNOWN_BACKEND
            if deadline is not None and time.time() > deadline:
                write({"deadline": index})  # the parent marks this case and the rest as not run
                return 0
            write({"start": index})
            result = run_case(backend, case)
            write({"index": index, "result": result.to_dict()})
            if result.status == FAIL and case.device == "cuda" and not cuda_context_ok():
                return WORKER_CONTEXT_LOST
    return 0


if __name__ == "__main__":  # pragma: no cover - started through suite._WORKER_BOOT
    sys.exit(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else None))
