"""Rank draft lengths again from the controller state an `mmspec bench gpu` row recorded.

The `auto` row of `mmspec bench gpu --json` carries its controller's estimates at the end of
the run (per-position acceptance, verify / draft milliseconds per (rows, tokens) key with their
observation counts). This script loads them into a fresh `DraftLengthController` (of this
checkout, or of another version's `mmspec/adaptive.py` given with `--adaptive`) and prints the
projected batch throughput per K and the K it would choose for a few remaining-token budgets.
It tells apart a choice that follows from the measured costs (any projection picks it) from one
that follows from the projection itself; it says nothing about whether the costs were right.

    python benchmarks/rerank_gpu_state.py benchmarks/results/gpu_h100_s44_text4.json
    git show 604023c:mmspec/adaptive.py > /tmp/adaptive_s42.py
    python benchmarks/rerank_gpu_state.py benchmarks/results/gpu_h100_s44_text4.json --adaptive /tmp/adaptive_s42.py
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json


def load_controller(module, state: dict, k_max: int, weight: float = 32.0):
    """A controller of `module` holding `state`'s estimates (acceptance as `weight` outcomes a
    position; each cost key's mean and count as recorded)."""
    ctl = module.DraftLengthController(k_max)
    acc = state["acceptance"][:k_max]
    ctl.acc = [a * weight for a in acc]
    ctl.tried = [weight] * len(acc)
    for name, table in (("verify", ctl.verify), ("draft", ctl.draft)):
        for key, ms in state[f"{name}_ms"].items():
            rows, tokens = map(int, key.split("x"))
            count = state[f"{name}_observations"][key]
            for _ in range(min(count, 3)):  # the fitted lines (keys never seen) get a few points
                table.observe((rows, tokens), rows * tokens, ms / 1000)
            table.means[(rows, tokens)] = ms / 1000
            table.counts[(rows, tokens)] = count
    ctl.steps = len(ctl.warmup) + 1  # past the warm-up
    return ctl


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="an `mmspec bench gpu --json` file")
    p.add_argument("--adaptive", help="path to another version's mmspec/adaptive.py (default: this checkout's)")
    p.add_argument("--remaining", default="128,64,20", help="tokens left per row, comma-separated")
    a = p.parse_args(argv)
    if a.adaptive:
        spec = importlib.util.spec_from_file_location("mmspec._adaptive_other", a.adaptive)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        from mmspec import adaptive as module
    report = json.load(open(a.json))
    rows = [r for r in report["rows"] if r["method"] == "mmspec auto" and "controller" in r]
    if not rows:
        raise SystemExit(f"{a.json}: no 'mmspec auto' row with a recorded controller state")
    for row in rows:
        state = row["controller"]
        state = ast.literal_eval(state) if isinstance(state, str) else state
        k_max = len(state["acceptance"])
        batch = row["batch"]
        print(f"{row['workload']} B={batch}: acceptance {state['acceptance']}")
        for left in (int(x) for x in a.remaining.split(",")):
            ctl = load_controller(module, state, k_max)
            rates = ctl._rates(batch, [left] * batch)
            shown = " ".join(f"K={k}:{r:.3f}" if r else f"K={k}:-" for k, r in rates.items())
            print(f"  {left:4d} tokens left: {shown}  -> K={ctl._best(rates)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
