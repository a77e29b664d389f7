"""`mmspec bench core`: the adaptive draft length (`num_draft_tokens="auto"`) against every
fixed K = 1..6 and plain decoding, at several batch sizes, on several target/drafter pairs
of different agreement, measured in one run with interleaved rounds.

Per (pair, batch) the table gives tokens/s of plain `generate` on the same kernels as
mmspec, of mmspec with each fixed K, of mmspec "auto", the best fixed K in hindsight and the
ratio auto / best fixed; at batch 1 also transformers' assisted generation at its default
(adaptive) schedule, as shipped (on transformers' stock linear kernels: "assisted") and on the
same kernels as plain and mmspec ("assisted same kernels", the like-for-like figure). Every mmspec
output is checked identical to plain greedy.

A cell is a small workload, not one request: round r decodes prompt set (r + 1) mod `prompts`
(the warm-up round set 0) with every method alike. With greedy decoding one request's accepted
runs are a fixed property of its prompt, and on a single 48-token request a fixed K can win by
where those runs happen to end (K = 4, 5 and 6 needing the same 12 steps, say), which no rule
choosing K from past steps can know and no other prompt repeats. A method's time is the sum
over prompt sets of its median seconds on that set; per-round ratios pair the methods on the
same set. `prompts=1` is the single-prompt bench of sessions 12-44.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

import torch

from mmspec.bench import ORDERS
from mmspec.bench.core import _cycling, _interleaved, _prompts
from mmspec.bench.core_pooled import format_pooled, log_interval, pool
from mmspec.bench.pair import PairConfig, build_pair, greedy_agreement
from mmspec.cli_types import positive_int

# Perturbation knobs of the built pair and the greedy agreement they gave on our 2-core VM
# (re-measured and reported by every run; the labels are only names).
PAIRS = {"weak": 0.07, "bench": 0.03, "strong": 0.016}


def named_pair(name: str, base: PairConfig | None = None):
    """(config, target, drafter) of a named bench pair, with EOS off so every request decodes
    `max_new_tokens` tokens (the benches compare lengths of equal work)."""
    pc = PairConfig(**{**asdict(base or PairConfig()), "perturbation": PAIRS[name]})
    target, drafter = build_pair(pc)
    for m in (target, drafter):
        m.generation_config.eos_token_id = None
    return pc, target, drafter


@dataclass(frozen=True)
class DraftLengthBench:
    pairs: tuple[str, ...] = ("weak", "bench", "strong")
    batch_sizes: tuple[int, ...] = (1, 4, 8, 16)
    fixed_k: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
    k_max: int = 8
    max_new_tokens: int = 48
    repeats: int = 2
    threads: int | None = None
    pair: PairConfig = field(default_factory=PairConfig)
    prompts: int = 3
    # Method order within rounds (`mmspec.bench.core._interleaved`): "balanced" since session 50;
    # the earlier reports ran "alternate" (A B C, C B A, ...), where `auto` always came right
    # after K = 6 or first, and mmspec's plain decoding after `generate` in every other round.
    order: str = "balanced"

    def __post_init__(self) -> None:
        unknown = [p for p in self.pairs if p not in PAIRS]
        if unknown:
            raise ValueError(f"unknown pairs {unknown}; choose from {sorted(PAIRS)}")
        if self.repeats < 1 or self.max_new_tokens < 1:
            raise ValueError("repeats and max_new_tokens must be >= 1")
        if isinstance(self.prompts, bool) or not isinstance(self.prompts, int) or self.prompts < 1:
            raise ValueError(f"prompts must be an int >= 1 (prompt sets a cell cycles through), got {self.prompts!r}")
        if not self.batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes must be ints >= 1, got {self.batch_sizes}")
        if not self.fixed_k or any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.k_max
                                   for k in self.fixed_k):
            raise ValueError(f"fixed_k must be ints in 1..k_max={self.k_max} (K = 0 is the plain rows), got {self.fixed_k}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be 'balanced' or 'alternate', got {self.order!r}")


def run(config: DraftLengthBench = DraftLengthBench(), progress=print, checkpoint=None) -> dict:
    import mmspec
    from mmspec.drafters import ModelDrafter, NullDrafter
    from mmspec.models.hf_target import HFTarget
    from mmspec.models.prepack import maybe_packed

    if config.threads:
        torch.set_num_threads(config.threads)
    rows, pairs_info = [], {}
    N = config.max_new_tokens
    for pair_name in config.pairs:
        pc, target, drafter = named_pair(pair_name, config.pair)
        probe, _ = _prompts(8, (12, 32), pc.vocab_size, seed=99)
        agreement = round(greedy_agreement(target, drafter, probe), 3)
        t_wrap = HFTarget(target)  # wrapped once, reused by every call (the kernel choice is made here)
        kernels = t_wrap.kernels
        gen_model = maybe_packed(target)  # the same view (and kernel policy) as the wrap's
        pairs_info[pair_name] = {"perturbation": pc.perturbation, "greedy_agreement": agreement, "kernels": kernels}
        progress(f"pair {pair_name}: greedy agreement {agreement:.0%}, mmspec kernels {kernels}")
        for B in config.batch_sizes:
            # Set 0 is the single-prompt bench's prompt; the others are further draws.
            sets = [_prompts(B, (12, 32), pc.vocab_size, seed=B + 1000 * j) for j in range(config.prompts)]
            gens = [dict(input_ids=i, attention_mask=m, do_sample=False, max_new_tokens=N, pad_token_id=0) for i, m in sets]
            fns = {"plain": lambda j: gen_model.generate(**gens[j])}
            # mmspec's own plain decoding (no drafter) through the same target: what `auto` does
            # when it switches speculation off, so that the loop's cost and the controller's
            # choices can be told apart.
            fns["mmspec plain"] = lambda j: mmspec.speculative_generate(
                t_wrap, NullDrafter(pc.vocab_size), *sets[j], temperature=0, max_new_tokens=N, pad_token_id=0)
            drafters = {f"K={k}": ModelDrafter(drafter, k) for k in config.fixed_k}
            drafters["auto"] = ModelDrafter(drafter, "auto", max_draft_tokens=config.k_max)
            for name, d in drafters.items():
                fns[name] = lambda j, d=d: mmspec.speculative_generate(
                    t_wrap, d, *sets[j], temperature=0, max_new_tokens=N, pad_token_id=0)
            auto_calls: list[list] = []  # per call, the warm-up first: [mean K, plain steps, steps]

            def auto_fn(j, run=fns["auto"]):
                out = run(j)
                ks = out.stats.nodes_per_step
                auto_calls.append([round(sum(ks) / len(ks), 2) if ks else 0.0, ks.count(0), len(ks)])
                return out
            fns["auto"] = auto_fn
            if B == 1:  # transformers' assisted generation (its default schedule): as shipped, and on mmspec's kernels
                fns["assisted"] = lambda j: target.generate(**gens[j], assistant_model=drafter)
                fns["assisted same kernels"] = lambda j: gen_model.generate(**gens[j],
                                                                            assistant_model=maybe_packed(drafter))
            methods = {name: _cycling(fn, config.prompts) for name, fn in fns.items()}
            progress(f"  batch {B}: {len(methods)} methods, interleaved ({config.order}), {config.repeats} rounds over "
                     f"{config.prompts} prompt set{'s' if config.prompts > 1 else ''}")
            rounds: dict[str, list[float]] = {}
            _interleaved(methods, config.repeats, rounds, order=config.order)  # the warm-up round also trains auto
            outs = {name: m.outs[config.repeats % config.prompts] for name, m in methods.items()}  # the last round's
            timed_sets = min(config.repeats, config.prompts)  # sets 1, 2, ... (mod prompts) the rounds ran
            times = {name: _workload_seconds(v, config.prompts) for name, v in rounds.items()}
            tps = {name: B * N * timed_sets / t for name, t in times.items()}
            fixed = {name: tps[name] for name in drafters if name != "auto"}
            best = max(fixed, key=fixed.get)
            auto_stats = outs["auto"].stats
            row = {
                "pair": pair_name, "batch": B, "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
                "best_fixed": best, "auto_vs_best_fixed": round(tps["auto"] / fixed[best], 3),
                "auto_vs_plain": round(tps["auto"] / tps["plain"], 3),
                "auto_k_histogram": _histogram(auto_stats.nodes_per_step),
                "auto_mean_accepted_length": round(auto_stats.mean_accepted_length, 3),
                # Every call's choices (the histogram above is the last call's): what auto did in
                # each round, to tell a controller that switched off for the whole cell from one
                # that did so in a round or two.
                "auto_per_call": {"mean_k": [c[0] for c in auto_calls], "plain_steps": [c[1] for c in auto_calls],
                                  "steps": [c[2] for c in auto_calls]},
                "identical_to_plain": all(torch.equal(methods[n].outs[j].sequences, methods["plain"].outs[j])
                                          for j in methods["plain"].outs for n in [*drafters, "mmspec plain"]),
                "prompt_sets": timed_sets,
                "mmspec_plain_vs_plain": round(tps["mmspec plain"] / tps["plain"], 3),
                "auto_vs_mmspec_plain": round(tps["auto"] / tps["mmspec plain"], 3),
                "auto_vs_mmspec_plain_rounds": _paired(rounds, "auto", "mmspec plain"),
                # Paired per-round ratios (the methods of a round ran back to back, so a drift of
                # the machine cancels): their spread says how far one row can be trusted.
                "auto_vs_plain_rounds": _paired(rounds, "auto", "plain"),
                "auto_vs_best_fixed_rounds": _paired(rounds, "auto", best),
                "seconds_per_round": {k: [round(x, 4) for x in v] for k, v in rounds.items()},
            }
            row["auto_vs_plain_ci90"] = _ratio_ci(row["auto_vs_plain_rounds"])
            row["auto_vs_best_fixed_ci90"] = _ratio_ci(row["auto_vs_best_fixed_rounds"])
            row["auto_vs_mmspec_plain_ci90"] = _ratio_ci(row["auto_vs_mmspec_plain_rounds"])
            # The fastest of each method's rounds: what interference from the rest of the machine
            # (which only ever slows a run down) left untouched; a second, less noisy reading.
            fast = {name: B * N * timed_sets / _workload_seconds(v, config.prompts, min) for name, v in rounds.items()}
            best_fast = max((n for n in drafters if n != "auto"), key=fast.get)
            row["fastest_round"] = {
                "tokens_per_s": {k: round(v, 1) for k, v in fast.items()}, "best_fixed": best_fast,
                "auto_vs_best_fixed": round(fast["auto"] / fast[best_fast], 3),
                "auto_vs_plain": round(fast["auto"] / fast["plain"], 3)}
            if config.repeats >= 2:
                row["auto_vs_best_fixed_split"] = _split_best(rounds, [n for n in drafters if n != "auto"])
                row["twin_below_goal"] = _twin_below(rounds, [n for n in drafters if n != "auto"], config.prompts)
            if "assisted" in tps:
                row["auto_vs_assisted"] = round(tps["auto"] / tps["assisted"], 3)
                row["auto_vs_assisted_same_kernels"] = round(tps["auto"] / tps["assisted same kernels"], 3)
                row["assisted_identical"] = all(torch.equal(methods[a].outs[j], methods["plain"].outs[j])
                                                for j in methods["plain"].outs
                                                for a in ("assisted", "assisted same kernels"))
            rows.append(row)
            progress("    " + format_row(row))
            if checkpoint is not None:  # each cell written as it comes (--json)
                checkpoint({"info": {"device": "cpu", "threads": torch.get_num_threads(), "pairs": pairs_info},
                            "config": asdict(config), "rows": rows})
    from mmspec import cpu_attention

    info = {"device": "cpu", "threads": torch.get_num_threads(), "pairs": pairs_info,
            # the attention forms mmspec's step forwards measured and kept (mmspec/cpu_attention.py)
            "cpu_attention": {"summary": cpu_attention.describe(), "classes": cpu_attention.choices()}}
    return {"info": info, "config": asdict(config), "rows": rows}


def _per_set(seconds: list[float], count: int) -> list[list[float]]:
    """A method's rounds grouped by prompt set: round r ran set (r + 1) % count."""
    per_set: dict[int, list[float]] = {}
    for r, t in enumerate(seconds):
        per_set.setdefault((r + 1) % count, []).append(t)
    return list(per_set.values())


def _workload_seconds(seconds: list[float], count: int, pick=statistics.median) -> float:
    """A method's time for the workload: the sum over the prompt sets seen of `pick` (median,
    or min for the fastest rounds) of the set's rounds."""
    return sum(pick(v) for v in _per_set(seconds, count))


def _paired(rounds: dict[str, list[float]], a: str, b: str) -> list[float]:
    """Per-round speed of `a` relative to `b` (b's seconds / a's seconds), sorted."""
    return sorted(round(tb / ta, 3) for ta, tb in zip(rounds[a], rounds[b]))


def _ratio_ci(ratios: list[float]) -> list[float] | None:
    """90% confidence interval of the typical per-round ratio: a Student t interval on the
    logs of the paired per-round ratios (a round's methods ran back to back, so the machine's
    drift cancels within a pair). None with fewer than 2 rounds. It says how far one row's
    ratio can be trusted: a row whose interval straddles a goal cannot be called from this run."""
    return log_interval([math.log(r) for r in ratios])[1] if len(ratios) >= 2 else None


def _split_best(rounds: dict[str, list[float]], fixed: list[str]) -> dict:
    """An unbiased "best fixed K": picked on the even rounds (median seconds), timed against
    auto on the odd rounds only. The best of six medians of the same rounds is favoured by
    its own noise; this one is not."""
    pick = min(fixed, key=lambda n: statistics.median(rounds[n][0::2]))
    odd_fixed, odd_auto = rounds[pick][1::2], rounds["auto"][1::2]
    return {"picked": pick, "auto_vs_picked": round(statistics.median(odd_fixed) / statistics.median(odd_auto), 3)}


def _twin_below(rounds: dict[str, list[float]], fixed: list[str], count: int, goal: float = 0.95,
                draws: int = 1000, seed: int = 0) -> float:
    """The run's resolution: how often a method exactly as fast as the best fixed K (its rounds a
    fresh draw of that K's rounds) would read below `goal` x the best fixed K in hindsight,
    by bootstrap over the rounds (each prompt set's rounds resampled with replacement, every
    fixed K and the twin alike, the best picked afresh in each draw as the bench picks it).
    Near 0: the cell can tell a 5% loss; 0.3: a perfect controller misses 3 runs in 10."""
    import random

    rng = random.Random(seed)
    per = {name: _per_set(rounds[name], count) for name in fixed}
    best = min(fixed, key=lambda n: _workload_seconds(rounds[n], count))

    def draw(name):
        return sum(statistics.median(rng.choice(v) for _ in v) for v in per[name])

    below = 0
    for _ in range(draws):
        hindsight = min(draw(n) for n in fixed)
        below += hindsight / draw(best) < goal
    return round(below / draws, 3)


def resolution(rows: list[dict]) -> dict:
    """Over a report's rows: the misses a controller exactly as fast as the best fixed K would
    expect in this run (sum of `twin_below_goal`), the misses `auto` read, and the cells whose
    90% interval of paired per-round ratios lies wholly below a goal (0.95x the best fixed K,
    1.0x plain): a miss that the run's noise cannot explain."""
    twins = [r["twin_below_goal"] for r in rows if "twin_below_goal" in r]
    sig_best = [f"{r['pair']} B={r['batch']}" for r in rows
                if r.get("auto_vs_best_fixed_ci90") and r["auto_vs_best_fixed_ci90"][1] < 0.95]
    sig_plain = [f"{r['pair']} B={r['batch']}" for r in rows
                 if r.get("auto_vs_plain_ci90") and r["auto_vs_plain_ci90"][1] < 1.0]
    return {"cells": len(rows), "twin_expected_misses": round(sum(twins), 2) if len(twins) == len(rows) else None,
            "misses_vs_best_fixed": sum(r["auto_vs_best_fixed"] < 0.95 for r in rows),
            "misses_vs_plain": sum(r["auto_vs_plain"] < 1.0 for r in rows),
            "significantly_below_best_fixed": sig_best, "significantly_below_plain": sig_plain}


def format_resolution(res: dict) -> str:
    twin = ("" if res["twin_expected_misses"] is None else
            f"; a method exactly as fast as the best fixed K would read < 0.95x in {res['twin_expected_misses']:.1f} "
            f"of {res['cells']} (bootstrap over rounds)")
    return (f"misses: auto < 0.95x best fixed K in {res['misses_vs_best_fixed']} of {res['cells']} cells{twin}; "
            f"auto < 1.0x plain in {res['misses_vs_plain']}. Significantly below (90% interval of paired rounds "
            f"wholly under the goal): best fixed K {', '.join(res['significantly_below_best_fixed']) or 'none'}; "
            f"plain {', '.join(res['significantly_below_plain']) or 'none'}")


def _histogram(ks: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in ks:
        out[str(k)] = out.get(str(k), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def format_row(row: dict) -> str:
    t = row["tokens_per_s"]
    fixed = " ".join(f"{k}:{v:.0f}" for k, v in t.items() if k.startswith("K="))
    extra = (f"  auto/assisted {row['auto_vs_assisted']:.2f}x (same kernels {row['auto_vs_assisted_same_kernels']:.2f}x)"
             if "auto_vs_assisted_same_kernels" in row else
             f"  auto/assisted {row['auto_vs_assisted']:.2f}x" if "auto_vs_assisted" in row else "")
    spread = ""
    if row.get("auto_vs_plain_ci90"):  # 90% interval of the per-round ratio
        (fl, fh), (pl, ph) = row["auto_vs_best_fixed_ci90"], row["auto_vs_plain_ci90"]
        spread = f" [90% CI {fl:.2f}-{fh:.2f}]", f" [90% CI {pl:.2f}-{ph:.2f}]"
    elif "auto_vs_plain_rounds" in row:  # rows of older reports: min-max of the per-round ratios
        p, f = row["auto_vs_plain_rounds"], row["auto_vs_best_fixed_rounds"]
        spread = f" [rounds {f[0]:.2f}-{f[-1]:.2f}]", f" [rounds {p[0]:.2f}-{p[-1]:.2f}]"
    fixed_spread, plain_spread = spread or ("", "")
    fast = ""
    if "fastest_round" in row:
        fr = row["fastest_round"]
        fast = (f"  fastest rounds: auto/best fixed ({fr['best_fixed']}) {fr['auto_vs_best_fixed']:.2f}x, "
                f"auto/plain {fr['auto_vs_plain']:.2f}x")
    own = ""
    if "auto_vs_mmspec_plain" in row:  # rows of older reports have no mmspec plain decoding
        ci = row.get("auto_vs_mmspec_plain_ci90")
        own = (f"  auto/mmspec plain {row['auto_vs_mmspec_plain']:.2f}x" + (f" [90% CI {ci[0]:.2f}-{ci[1]:.2f}]" if ci else "")
               + f"  mmspec plain/plain {row['mmspec_plain_vs_plain']:.2f}x")
    return (f"{row['pair']:>6} B={row['batch']:<2} plain {t['plain']:.0f}  {fixed}  auto {t['auto']:.0f} tok/s | "
            f"auto/best fixed ({row['best_fixed']}) {row['auto_vs_best_fixed']:.2f}x{fixed_spread}  auto/plain "
            f"{row['auto_vs_plain']:.2f}x{plain_spread}{own}{extra}{fast}  same={'yes' if row['identical_to_plain'] else 'NO'}")


def format_table(report: dict) -> str:
    # Reports from before session 50 carry no `order`: they ran "alternate".
    order = report.get("config", {}).get("order", "alternate")
    lines = [f"device: {report['info']['device']}, {report['info']['threads']} threads, method order {order}"]
    for name, p in report["info"]["pairs"].items():
        lines.append(f"pair {name}: greedy agreement {p['greedy_agreement']:.0%} (perturbation {p['perturbation']}), "
                     f"kernels {p['kernels']}")
    if "cpu_attention" in report["info"]:  # reports from before session 51 have none
        lines.append(f"mmspec step attention on CPU: {report['info']['cpu_attention']['summary']}")
    lines += [format_row(r) for r in report["rows"]]
    if report["rows"]:
        lines.append(format_resolution(resolution(report["rows"])))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`mmspec bench core [options]`."""
    import argparse
    import json
    import sys

    def ints(text):
        return tuple(int(x) for x in text.split(","))

    p = argparse.ArgumentParser(prog="mmspec bench core", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", default="weak,bench,strong", help=f"comma-separated, from {sorted(PAIRS)}")
    p.add_argument("--batch-sizes", type=ints, default=None, help="default 1,4,8,16")
    p.add_argument("--fixed-k", type=ints, default=(1, 2, 3, 4, 5, 6))
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=None, help="timed rounds after the warm-up one (default 2)")
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--prompts", type=int, default=3,
                   help="prompt sets each cell cycles through, one per round (default 3; 1: one prompt, as before)")
    p.add_argument("--order", choices=ORDERS, default="balanced",
                   help="method order within rounds: balanced (a Williams design: every method follows every other "
                        "equally often; default) or alternate (A B C, C B A, ...: the order of reports before session 50)")
    p.add_argument("--smoke", action="store_true",
                   help="seconds-long run on a tiny pair with its own K and lengths (checks the suite runs)")
    p.add_argument("--json", default=None)
    p.add_argument("--analyse", default=None, nargs="+", metavar="REPORT.json",
                   help="print the table of a stored report, with the resolution figures of its rounds; with several "
                        "reports also auto's ratios pooled over all their rounds; runs nothing")
    a = p.parse_args(argv)
    if a.analyse:
        return _analyse(a.analyse)
    pair = PairConfig()
    if a.smoke:
        from mmspec.cli_types import refuse_beside_smoke

        refuse_beside_smoke("bench core", a, p.parse_args([]), ("pairs", "fixed_k", "k_max", "max_new_tokens"))
        pair = PairConfig(vocab_size=256, hidden_size=64, intermediate_size=128, target_layers=2, heads=4)
        a.fixed_k, a.k_max, a.max_new_tokens, a.pairs = (1, 2), 3, 8, "bench"
    # Defaults only where the option was not given (a given 0 reaches DraftLengthBench's check).
    if a.batch_sizes is None:
        a.batch_sizes = (1, 2) if a.smoke else (1, 4, 8, 16)
    if a.repeats is None:
        a.repeats = 1 if a.smoke else 2
    try:
        config = DraftLengthBench(pairs=tuple(a.pairs.split(",")), batch_sizes=a.batch_sizes, fixed_k=a.fixed_k,
                                  k_max=a.k_max, max_new_tokens=a.max_new_tokens, repeats=a.repeats,
                                  threads=a.threads, pair=pair, prompts=a.prompts, order=a.order)
    except ValueError as e:
        raise SystemExit(f"mmspec bench core: {e}") from None
    from mmspec.bench.report import partial_saver

    report = run(config, progress=lambda m: print(m, file=sys.stderr, flush=True), checkpoint=partial_saver(a.json))
    print(format_table(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.json}")
    return 0


def _analyse(paths: list[str]) -> int:
    """`--analyse`: each stored report's table, with `twin_below_goal` computed from its rounds where
    the report predates it (reports from before per-round seconds were kept get none); with two
    or more reports, the ratios pooled over all their rounds (`mmspec/bench/core_pooled.py`)."""
    import json

    reports = []
    for path in paths:
        try:
            with open(path) as f:
                report = json.load(f)
            rows = report["rows"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"mmspec bench core --analyse: cannot read a bench core report from {path}: {e}") from None
        try:
            prompts = report.get("config", {}).get("prompts", 1)
            for row in rows:
                secs = row.get("seconds_per_round", {})
                fixed = [n for n in secs if n.startswith("K=")]
                if "twin_below_goal" not in row and fixed and len(secs[fixed[0]]) >= 2:
                    row["twin_below_goal"] = _twin_below(secs, fixed, prompts)
            table = format_table(report)
        except (KeyError, TypeError, AttributeError) as e:  # another suite's report, or a damaged one
            raise SystemExit(f"mmspec bench core --analyse: {path} is not a bench core report (missing {e})") from None
        if len(paths) > 1:
            print(f"== {path}")
        print(table)
        reports.append(report)
    if len(reports) > 1:
        try:
            pooled = pool(reports, paths)
        except ValueError as e:
            raise SystemExit(f"mmspec bench core --analyse: {e}") from None
        if not pooled["rows"]:
            raise SystemExit("mmspec bench core --analyse: no report keeps per-round seconds (`seconds_per_round`): "
                             "nothing to pool")
        print(format_pooled(pooled))
    return 0
