"""The `mmspec` command line.

    mmspec demo                      side-by-side speed table on a locally built model pair
    mmspec bench [options]           the core benchmark (plain / assisted / mmspec), JSON out
    mmspec testbed ...               the procedural world, VQ tokenizer and judge (see
                                     mmspec/testbed/commands.py)
    mmspec caption / vqa / train-drafter   VLM captioning, VQA and drafter training (see
                                     pipelines/vlm_cli.py)

argparse options map one to one onto the fields of the config dataclasses they build
(`mmspec.bench.core.BenchConfig`, `mmspec.bench.pair.PairConfig`). Heavy imports happen
inside the command functions, so `mmspec --help` is instant.
"""

from __future__ import annotations

import argparse
import os
import sys


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _bench_config(args):
    from mmspec.bench.core import BenchConfig
    from mmspec.bench.pair import PairConfig

    pair = PairConfig(target_layers=args.target_layers, perturbation=args.perturbation, seed=args.seed)
    if getattr(args, "smoke", False):
        # Seconds-long check that the whole benchmark runs (tiny pair, one round); no figures.
        pair = PairConfig(vocab_size=256, hidden_size=64, intermediate_size=128, target_layers=2, heads=4,
                          perturbation=args.perturbation, seed=args.seed)
        args.batch_sizes, args.draft_tokens, args.max_new_tokens, args.repeats = (1, 2), (3, 2), 8, 1
    try:
        return BenchConfig(
            batch_sizes=args.batch_sizes, num_draft_tokens=args.draft_tokens, max_new_tokens=args.max_new_tokens,
            repeats=args.repeats, threads=args.threads, compare_kernels=not args.no_compare_kernels, pair=pair,
        )
    except ValueError as e:
        raise SystemExit(f"mmspec bench: {e}") from None


def cmd_bench(args) -> int:
    from mmspec.bench.core import format_table, run, save

    config = _bench_config(args)
    report = run(config, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_table(report))
    if args.json:
        save(report, args.json)
        print(f"wrote {args.json}")
    return 0


def cmd_demo(args) -> int:
    print("mmspec demo: speculative decoding vs plain decoding and transformers' assisted generation.\n"
          "The target/drafter pair is BUILT LOCALLY with random weights (mmspec/bench/pair.py): its greedy\n"
          "agreement is measured below. Greedy outputs are checked identical to plain decoding.\n"
          "mmspec runs float32 CPU models on prepacked linear weights by default; every method is also timed on\n"
          "the other kernels (transformers on mmspec's packed view), so 'same kern.' shows the speculative gain alone.\n",
          flush=True)
    args.repeats = args.repeats or 1
    return cmd_bench(args)


def _add_bench_options(p: argparse.ArgumentParser, *, demo: bool) -> None:
    p.add_argument("--batch-sizes", type=_ints, default=(1, 8), help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--draft-tokens", type=_ints, default=(4, 3), help="draft tokens K per batch size (default 4,3)")
    p.add_argument("--max-new-tokens", type=int, default=48 if demo else 64)
    p.add_argument("--repeats", type=int, default=2 if demo else 3, help="timed runs per method (median)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--target-layers", type=int, default=14)
    p.add_argument("--perturbation", type=float, default=0.03, help="target/drafter disagreement knob")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compare-kernels", action="store_true",
                   help="run each method only on its library's default linear kernels (faster, no like-for-like rows)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this path")
    if not demo:
        p.add_argument("--smoke", action="store_true", help="seconds-long run on a tiny pair (checks the bench runs)")


from mmspec.bench import SUITES  # noqa: E402  (a plain dict of names, no heavy imports)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmspec", description="Speculative decoding for VLMs and AR image generators")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="side-by-side speed table on a locally built pair (< 2 min on CPU)")
    _add_bench_options(p, demo=True)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("bench", help="core benchmark: plain generate, assisted generation, mmspec; "
                       f"`mmspec bench SUITE --help` for the suites {sorted(SUITES)}")
    _add_bench_options(p, demo=False)
    p.set_defaults(func=cmd_bench)
    from mmspec.testbed.commands import add_subparsers as add_testbed

    add_testbed(sub)
    from mmspec.pipelines.vlm_cli import add_subparsers as add_vlm

    add_vlm(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in mmspec downloads at run time
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in SUITES:
        # `mmspec bench SUITE ...`: each suite parses its own options (mmspec/bench/__init__.py).
        import importlib

        module, func = SUITES[argv[1]].split(":")
        return int(getattr(importlib.import_module(module), func)(argv[2:]) or 0)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
