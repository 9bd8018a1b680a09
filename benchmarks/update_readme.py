#!/usr/bin/env python3
"""Put a saved `mhattn bench` run into the README: the date, the command, the plots and the tables.

    python3 benchmarks/update_readme.py /path/to/gpu_check_out        # a folder with bench.json and PNGs
    python3 benchmarks/update_readme.py bench.json --readme README.md --assets benchmarks/results

The JSON, the Markdown and the PNGs are copied into --assets (default benchmarks/results/), and the
README's section between the markers below is replaced (appended under a "Performance" heading the
first time). Nothing is measured here; no GPU needed.
"""

import argparse
import glob
import os
import shutil
import sys

from mhattn.benchmark import report

START = "<!-- mhattn-bench:start -->"
END = "<!-- mhattn-bench:end -->"
HEADING = "## Performance"


def replace_section(text: str, section: str) -> str:
    """``text`` with the part between START and END replaced by ``section`` (appended when absent)."""
    block = f"{START}\n{section.rstrip()}\n{END}"
    if START in text and END in text and text.index(START) < text.index(END):
        before, rest = text.split(START, 1)
        _, after = rest.split(END, 1)
        return before + block + after
    return text.rstrip() + f"\n\n{HEADING}\n\n{block}\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="bench.json, or the folder gpu_check.sh wrote (bench.json and the PNGs)")
    parser.add_argument("--readme", default=os.path.join(os.path.dirname(__file__), "..", "README.md"))
    parser.add_argument("--assets", default=os.path.join(os.path.dirname(__file__), "results"),
                        help="folder the JSON, Markdown and plots are copied to (default benchmarks/results)")
    args = parser.parse_args(argv)

    source = args.results
    folder = source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source))
    json_path = os.path.join(source, "bench.json") if os.path.isdir(source) else source
    try:
        document = report.read_json(json_path)
    except (OSError, ValueError) as error:
        print(f"update_readme: {error}", file=sys.stderr)
        return 2
    if document.get("meta", {}).get("partial"):
        print("update_readme: warning: this is a partial run (it was still going when saved)", file=sys.stderr)

    os.makedirs(args.assets, exist_ok=True)
    plots = []
    found = glob.glob(os.path.join(folder, "attention_*.png")) + glob.glob(os.path.join(folder, "memory_module.png"))
    for png in sorted(found):
        target = os.path.join(args.assets, os.path.basename(png))
        if os.path.abspath(png) != os.path.abspath(target):
            shutil.copyfile(png, target)
        plots.append(target)
    kept_json = os.path.join(args.assets, "bench.json")
    if os.path.abspath(json_path) != os.path.abspath(kept_json):
        shutil.copyfile(json_path, kept_json)

    readme_dir = os.path.dirname(os.path.abspath(args.readme))
    relative = [os.path.relpath(os.path.abspath(p), readme_dir) for p in plots]
    section = report.markdown_report(document, relative)
    with open(os.path.join(args.assets, "bench.md"), "w") as f:
        f.write(report.markdown_report(document, [os.path.basename(p) for p in plots]))
    with open(args.readme) as f:
        text = f.read()
    with open(args.readme, "w") as f:
        f.write(replace_section(text, section))
    print(f"updated {args.readme}; copied {len(plots)} plot(s) and bench.json to {args.assets}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
