"""``megatron-entropy <command>``: one entry point for every user-facing task."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional


def _commands() -> dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                                   Callable[[argparse.Namespace], int]]]:
    """name -> (help, add_arguments, run). Each run imports its module lazily (fast --help)."""
    return {}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-entropy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = _commands()
    for name, (help_text, add_args, _) in commands.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    return commands[args.command][2](args) or 0


if __name__ == "__main__":
    sys.exit(main())
