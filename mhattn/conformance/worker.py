"""The worker process of an isolated conformance run (see mhattn.conformance.suite).

Reads cases (JSON lines ``{"backend", "case"}``), runs them in order and appends to the results file
``{"start": i}`` before and ``{"index": i, "result": {...}}`` after each one, flushed at once so the parent
sees how far it got even if this process dies.
"""

from __future__ import annotations

import json
import sys


def main(cases_path: str, results_path: str) -> int:
    from mhattn import registry
    from mhattn.conformance.cases import parse_spec
    from mhattn.conformance.runner import FAIL, run_case
    from mhattn.conformance.suite import WORKER_CONTEXT_LOST, WORKER_UNKNOWN_BACKEND, cuda_context_healthy
    from mhattn.errors import UnknownBackendError

    with open(cases_path, "r", encoding="utf-8") as f:
        entries = [json.loads(line) for line in f if line.strip()]
    with open(results_path, "a", encoding="utf-8") as out:
        def write(message):
            out.write(json.dumps(message, allow_nan=False) + "\n")
            out.flush()

        for index, entry in enumerate(entries):
            case = parse_spec(entry["case"], entry["backend"])
            try:
                backend = registry.get_backend(case.backend)
            except UnknownBackendError:
                # registered only inside the parent process (by a call, not an entry point)
                write({"unknown_backend": case.backend})
                return WORKER_UNKNOWN_BACKEND
            write({"start": index})
            result = run_case(backend, case)
            write({"index": index, "result": result.to_dict()})
            if result.status == FAIL and case.device == "cuda" and not cuda_context_healthy():
                return WORKER_CONTEXT_LOST
    return 0


if __name__ == "__main__":  # pragma: no cover - started through suite._WORKER_BOOT
    sys.exit(main(sys.argv[1], sys.argv[2]))
