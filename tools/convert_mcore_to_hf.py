#!/usr/bin/env python
"""`megatron-entropy convert mcore-to-hf` as a script (same flags, same behaviour; see
megatron_entropy/launch/convert.py).

    python tools/convert_mcore_to_hf.py --help
"""

import sys

from megatron_entropy.cli import main

if __name__ == "__main__":  # dist_checkpointing starts a spawn Manager: keep this guard
    sys.exit(main(["convert", "mcore-to-hf", *sys.argv[1:]]))
