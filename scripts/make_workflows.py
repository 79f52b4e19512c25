"""Regenerate workflows/ from the node definitions (tests/fixtures/workflow_specs.py holds the graphs,
tests/fixtures/workflow_gen.py builds them). Run with the project's Python after changing a node's inputs:

    .venv/bin/python scripts/make_workflows.py          # write; prints the files that changed
    .venv/bin/python scripts/make_workflows.py --check  # exit 1, naming them, when a file is not current
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fixtures.workflow_gen import WORKFLOWS, build, write  # noqa: E402


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        stale = [f for f, text in build().items()
                 if not (WORKFLOWS / f).exists() or (WORKFLOWS / f).read_text(encoding="utf-8") != text]
        for f in stale:
            print(f"workflows/{f} is not what the node definitions give; run scripts/make_workflows.py", file=sys.stderr)
        return 1 if stale else 0
    if argv:
        print("usage: make_workflows.py [--check]", file=sys.stderr)
        return 2
    for f in write():
        print(f"wrote workflows/{f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
