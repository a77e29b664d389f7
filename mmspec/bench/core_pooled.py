"""`mmspec bench core --analyse A.json B.json ...`: `auto` against the best fixed K and against
plain decoding, pooled over several stored runs of the suite.

One run on a noisy machine cannot call a 5% goal: its cells have 8 paired rounds each, and a
controller exactly as fast as the best fixed K reads below 0.95x that K in hindsight in a
fifth to a third of its cells (`twin_below_goal`). Several runs can. Within a run every round
timed each method back to back, so the per-round ratio t_K / t_auto cancels the machine's slow
drift; this module pools those log ratios over every round of every run, per cell:

    L_K          = mean over rounds of log(t_K / t_auto)      (auto's speed against K, in logs)
    best fixed K = the K with the smallest L_K (the fastest K against auto, over all rounds)
    auto / best  = exp(L_best), with a Student t 90% interval on the logs
    auto / plain = the same for `transformers` plain `generate`
    held out     = each run's rounds against the K fastest in the *other* runs, pooled: the
                   ratio against a fixed K chosen in advance, free of the pick's luck

The best K is picked on the same rounds it is measured on, so the pooled ratio still favours
it by its own noise (much less than one run's hindsight: ~48 rounds instead of 8). Runs
of different controller versions pool what each version did: name the runs you pool.
Reports must share the pair configuration and the number of new tokens (refused otherwise).
"""

from __future__ import annotations

import math
import statistics

# Two-sided 90% Student t quantiles; a df between two entries takes the smaller one's (wider).
_T90 = ((1, 6.314), (2, 2.920), (3, 2.353), (4, 2.132), (5, 2.015), (6, 1.943), (7, 1.895),
        (8, 1.860), (9, 1.833), (10, 1.812), (12, 1.782), (15, 1.753), (20, 1.725), (30, 1.697),
        (40, 1.684), (60, 1.671), (120, 1.658))


def t90(df: int) -> float:
    """Two-sided 90% quantile of Student's t with `df` degrees of freedom (conservative between
    tabulated values)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    return [q for d, q in _T90 if d <= df][-1]


def log_interval(logs: list[float]) -> tuple[float, list[float] | None]:
    """exp of the mean of `logs` and a Student t 90% interval around it (None with < 2 values)."""
    n = len(logs)
    mean = sum(logs) / n
    if n < 2:
        return math.exp(mean), None
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t90(n - 1) * sd / math.sqrt(n)
    return math.exp(mean), [round(math.exp(mean - half), 3), round(math.exp(mean + half), 3)]


def pool(reports: list[dict], names: list[str] | None = None) -> dict:
    """Pooled rows, one per (pair, batch) cell found in any report with per-round seconds."""
    names = names or [f"report {i}" for i in range(len(reports))]
    first = reports[0].get("config", {})
    for name, rep in zip(names[1:], reports[1:]):
        cfg = rep.get("config", {})
        for field in ("pair", "max_new_tokens"):
            if cfg.get(field) != first.get(field):
                raise ValueError(f"{name} has config {field}={cfg.get(field)!r}, {names[0]} {first.get(field)!r}: "
                                 "pool runs of the same pairs and lengths only")
    cells: dict[tuple[str, int], list[dict]] = {}
    for rep in reports:
        for row in rep["rows"]:
            secs = row.get("seconds_per_round")
            if secs and secs.get("auto") and secs.get("plain"):
                cells.setdefault((row["pair"], row["batch"]), []).append(secs)
    rows = []
    for (pair, batch), runs in cells.items():
        fixed = [k for k in runs[0] if k.startswith("K=") and all(k in r for r in runs)]
        if not fixed:
            continue

        # log(t_K / t_auto) per run, for every K and plain: the rounds of run j are per_run[j][name]
        per_run = [{name: [math.log(t / a) for t, a in zip(r[name], r["auto"])] for name in fixed + ["plain"]}
                   for r in runs]

        def pooled(name, which=range(len(runs))):
            return [x for j in which for x in per_run[j][name]]

        def fastest(which):  # the fixed K fastest against auto over the runs `which`
            return min(fixed, key=lambda k: statistics.fmean(pooled(k, which)))

        best = fastest(range(len(runs)))
        ratio, ci = log_interval(pooled(best))
        plain, plain_ci = log_interval(pooled("plain"))
        row = {"pair": pair, "batch": batch, "runs": len(runs), "rounds": len(pooled(best)), "best_fixed": best,
               "auto_vs_best_fixed": round(ratio, 3), "auto_vs_best_fixed_ci90": ci,
               "auto_vs_plain": round(plain, 3), "auto_vs_plain_ci90": plain_ci}
        if len(runs) > 1:
            # Free of the pick's luck: each run's rounds against the K that was fastest in the
            # other runs (what a user who chose K from earlier runs would have got).
            picks = [fastest([i for i in range(len(runs)) if i != j]) for j in range(len(runs))]
            held_ratio, held_ci = log_interval([x for j, k in enumerate(picks) for x in per_run[j][k]])
            row.update(auto_vs_held_out=round(held_ratio, 3), auto_vs_held_out_ci90=held_ci, held_out_picks=picks)
        rows.append(row)
    return {"reports": len(reports), "rows": rows}


def format_pooled(pooled: dict, goal_best: float = 0.95, goal_plain: float = 1.0) -> str:
    rows = pooled["rows"]
    out = [f"pooled over {pooled['reports']} reports (per-round ratios within each run; the best fixed K picked "
           "on the same rounds):"]
    for r in rows:
        b, p = (" - ".join(f"{x:.3f}" for x in r[key + "_ci90"]) if r[key + "_ci90"] else "n/a"
                for key in ("auto_vs_best_fixed", "auto_vs_plain"))
        out.append(f"{r['pair']:>6} B={r['batch']:<2} {r['runs']} runs, {r['rounds']:>3} rounds  "
                   f"auto/best fixed ({r['best_fixed']}) {r['auto_vs_best_fixed']:.3f}x [90% CI {b}]  "
                   f"auto/plain {r['auto_vs_plain']:.3f}x [90% CI {p}]" + (
                       f"  auto/K picked on the other runs {r['auto_vs_held_out']:.3f}x [90% CI "
                       f"{' - '.join(f'{x:.3f}' for x in r['auto_vs_held_out_ci90'])}]" if r.get("auto_vs_held_out_ci90") else ""))

    def below(key, goal):
        return [f"{r['pair']} B={r['batch']}" for r in rows if r[key + "_ci90"] and r[key + "_ci90"][1] < goal]

    n = len(rows)
    held = [r for r in rows if "auto_vs_held_out" in r]
    held_text = (f", >= {goal_best}x the K picked on the other runs in "
                 f"{sum(r['auto_vs_held_out'] >= goal_best for r in held)} of {len(held)}" if held else "")
    out.append(f"pooled: auto >= {goal_best}x the best fixed K in {sum(r['auto_vs_best_fixed'] >= goal_best for r in rows)} "
               f"of {n} cells{held_text}, >= {goal_plain}x plain in {sum(r['auto_vs_plain'] >= goal_plain for r in rows)} of {n}; "
               f"significantly below (90% interval wholly under the goal): best fixed K "
               f"{', '.join(below('auto_vs_best_fixed', goal_best)) or 'none'}; plain "
               f"{', '.join(below('auto_vs_plain', goal_plain)) or 'none'}")
    return "\n".join(out)
