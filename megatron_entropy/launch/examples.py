"""``megatron-entropy examples [FOLDER]``: the shipped examples (the configs, the small models
they train, the scripts that made the models) copied to FOLDER/examples, so that an installed
package runs the quickstart as a checkout does:

    megatron-entropy examples && megatron-entropy train examples/quickstart.yaml

The configs name their models relative to the folder they run from (``examples/...``). The
examples ship inside the package (``megatron_entropy/examples`` in the wheel); a checkout holds
them at its top (``examples/``)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import megatron_entropy

QUICKSTART = "quickstart.yaml"


def shipped_examples() -> Path:
    """The examples folder of this installation: in the package (a wheel) or beside it (a
    checkout, editable install)."""
    package = Path(megatron_entropy.__file__).resolve().parent
    for folder in (package / "examples", package.parent / "examples"):
        if (folder / QUICKSTART).is_file():
            return folder
    raise FileNotFoundError(f"no examples beside {package}: the installation is incomplete "
                            "(reinstall the package)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", nargs="?", default=".",
                   help="where to put examples/ (default: the current folder)")


def run(args: argparse.Namespace) -> int:
    source = shipped_examples()
    target = Path(args.folder) / "examples"
    if target.exists():
        print(f"megatron-entropy examples: error: {target} exists; name another folder",
              file=sys.stderr)
        return 2
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    where = "" if Path(args.folder) == Path(".") else f"cd {args.folder} && "
    print(f"the examples are in {target}; run the quickstart with:\n"
          f"  {where}megatron-entropy train examples/{QUICKSTART}")
    return 0


EXAMPLES = ("copy the shipped example configs and models to FOLDER/examples", add_arguments, run)
