"""A hash of the PTX of every sm_90a Gluon build of the Triton backend, compiled on the CPU (no GPU needed).

A change meant to leave the kernels as they are (a helper pulled out, a docstring, arguments rewrapped) is checked by
hashing before and after: line info, debug sections and the debug labels that inlined helpers add are left out, so
only code differences change a hash. NOTES.md cites such checks ("the PTX of the other builds is unchanged").

    python benchmarks/gluon_ptx_hashes.py before.txt                  # on the old tree
    python benchmarks/gluon_ptx_hashes.py after.txt --compare before.txt   # on the new one: prints the builds that differ

Run it from outside the checkout (e.g. /tmp) with the tree to hash importable as ``mhattn``; all head dims the Gluon
kernels take (64, 96, 128, 192, 256), every build ``mhattn build --arch sm_90a`` would make of them.
"""

import argparse
import hashlib
import re

HEAD_DIMS = (64, 96, 128, 192, 256)
# What differs between two compilations of the same code: source positions, the debug sections and the labels
# that mark inlined helpers' scopes.
NOT_CODE = re.compile(r"\s*\.(loc|file)\b|\$L__tmp\d+:$")


def code_of(ptx: str) -> str:
    """The PTX less its debug sections, line info and inlining labels."""
    body = ptx.split("\t.section\t.debug")[0]
    return "\n".join(line for line in body.splitlines() if not NOT_CODE.match(line))


def build_hashes() -> dict:
    """Build label -> sha1 of its code, for every sm_90a Gluon build at HEAD_DIMS."""
    from mhattn.backends.triton import ahead

    tasks = [task for task in ahead.table_tasks("sm_90a", head_dims=HEAD_DIMS) if task.kind in ahead.GLUON_KINDS]
    return {task.label: hashlib.sha1(code_of(ahead.compile_kernel(task).asm["ptx"]).encode()).hexdigest()
            for task in tasks}


def read_hashes(path: str) -> dict:
    with open(path) as file:
        return dict(line.rstrip("\n").rsplit(" ", 1) for line in file if line.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="file to write: one line per build, its label and hash")
    parser.add_argument("--compare", metavar="FILE", help="an earlier output: print the builds whose hash differs")
    args = parser.parse_args()
    hashes = build_hashes()
    with open(args.output, "w") as file:
        file.writelines(f"{label} {digest}\n" for label, digest in hashes.items())
    print(f"{len(hashes)} builds hashed into {args.output}")
    if args.compare:
        before = read_hashes(args.compare)
        changed = [label for label in hashes if before.get(label) != hashes[label]]
        gone = [label for label in before if label not in hashes]
        for label in changed:
            print(f"differs: {label}" if label in before else f"new: {label}")
        for label in gone:
            print(f"gone: {label}")
        print(f"{len(hashes) - len(changed)} of {len(hashes)} builds unchanged")


if __name__ == "__main__":
    main()
