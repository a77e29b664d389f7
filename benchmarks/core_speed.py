"""Core speed benchmark (same as `mmspec bench`): plain generate vs transformers' assisted
generation vs mmspec, at batch 1 and 8, on a locally built ~50M/1-layer Llama pair.

    python benchmarks/core_speed.py --threads 2 --repeats 3 --json core_speed.json
"""

import sys

from mmspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
