"""Image generation: plain AR decoding vs speculative decoding with every drafter and rule, on
the bundled testbed generator (or `--model DIR`). Same as `mmspec bench imagegen`; writes the
JSON to benchmarks/results/imagegen_cpu.json unless `--json` says otherwise. Run it alone on
the machine (timings), e.g. `flock /work/.cpu-heavy.lock python benchmarks/imagegen.py`.

    python benchmarks/imagegen.py [--model DIR] [--judge-images 256] [other `mmspec bench` options]
"""

import sys
from pathlib import Path

from mmspec.cli import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    # `--json PATH`, `--json=PATH` or an abbreviation argparse takes for it (`--js`; `--j` would
    # also match --judge-images): only without one does the default path apply
    if not any(a.split("=", 1)[0] in ("--js", "--jso", "--json") for a in argv):
        argv += ["--json", str(Path(__file__).resolve().parent / "results" / "imagegen_cpu.json")]
    sys.exit(main(["bench", "imagegen", *argv]))
