"""The ``mhattn`` command: info, conformance, bench, build, tune.

Each subcommand lives in its own module; this file only parses the first word and hands over.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with `add_arguments(parser)` and `run(args) -> int`, one-line help)
SUBCOMMANDS = {
    "info": ("mhattn.info", "versions, device, every backend with its availability, a sample choice"),
    "conformance": ("mhattn.conformance.cli", "check every backend against the reference on this machine"),
    "bench": ("mhattn.benchmark.cli", "time every backend beside PyTorch's SDPA backends"),
    "build": ("mhattn.backends.cupy.build", "compile the CUDA kernels with NVRTC (no GPU needed)"),
    "tune": ("mhattn.tuning.cli", "time every backend on a grid of shapes; automatic selection uses the table"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mhattn", description="multi-backend FlashAttention-2 for PyTorch")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # a subcommand that cannot load still shows up, and says why when run
            module = None
            p.set_defaults(_load_error=f"mhattn {name}: cannot load {module_name}: {error}")
        else:
            module.add_arguments(p)
        modules[name] = module
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as given, for reports
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_load_error", None):
        print(args._load_error, file=sys.stderr)
        return 2
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
