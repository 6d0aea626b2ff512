#!/usr/bin/env python
"""`megatron-entropy convert hf-to-mcore` as a script (same flags, same behaviour; see
megatron_entropy/launch/convert.py).

    python tools/convert_hf_to_mcore.py --help
"""

import sys

from megatron_entropy.cli import main

if __name__ == "__main__":  # dist_checkpointing starts a spawn Manager: keep this guard
    sys.exit(main(["convert", "hf-to-mcore", *sys.argv[1:]]))
