"""Does a retrained testbed VLM reproduce another one? `mmspec testbed compare-vlm A B`. And how
good is one, on as many scenes as you like? `mmspec testbed eval-vlm [--model DIR] [--scenes N]`
(caption correctness and VQA accuracy with Wilson 95% intervals, by object count and error kind;
train-vlm's own eval uses the first 200 validation scenes, the same scenes as N = 200 here).

Both pipelines answer the same validation scenes (plain greedy, `vlm_eval.evaluate`), so
their caption and VQA outcomes are paired scene by scene. For each check it reports the two
accuracies, the scenes only one of them gets right, the difference B - A with a 95% interval
(the Wald interval of a paired difference of proportions: d = (c - b) / n, se = sqrt(b + c -
(c - b)^2 / n) / n, where b, c count the scenes only A, only B gets right), and the exact
two-sided McNemar p-value (a binomial test of b against b + c at one half). "Within noise"
here means: the interval covers 0. The two usually agree with p >= 0.05 but not always: with
few discordant scenes the Wald interval is the stricter (0 against 5 of 200 scenes: the
interval excludes 0, "DIFFERENT", while p = 0.0625); read the p-value beside the label. A paired test
is the right one for two models on one scene set: the scenes both get right or both get wrong
carry no information on which model is better, and the shared scene sample is not counted
twice as two independent samples would be.
"""

from __future__ import annotations

import json
import math

from mmspec.cli_types import positive_int


def mcnemar_p(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p-value: P(a split of the discordant scenes at least this
    uneven | both models equally likely to be the one right)."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_comparison(a_ok: list, b_ok: list, z: float = 1.959964) -> dict:
    """Compare per-scene outcomes (1 / True = right) of models A and B on the same scenes."""
    if len(a_ok) != len(b_ok) or not a_ok:
        raise ValueError(f"need two equally long, non-empty outcome lists (one per scene), got {len(a_ok)} and {len(b_ok)}")
    n = len(a_ok)
    only_a = sum(1 for x, y in zip(a_ok, b_ok) if x and not y)
    only_b = sum(1 for x, y in zip(a_ok, b_ok) if y and not x)
    d = (only_b - only_a) / n
    se = math.sqrt(max(only_a + only_b - (only_b - only_a) ** 2 / n, 0.0)) / n
    lo, hi = d - z * se, d + z * se
    return {"scenes": n, "a": sum(map(bool, a_ok)) / n, "b": sum(map(bool, b_ok)) / n,
            "only_a": only_a, "only_b": only_b, "difference": d, "ci95": [lo, hi],
            "mcnemar_p": mcnemar_p(only_a, only_b), "within_noise": lo <= 0.0 <= hi}


def compare(dir_a: str, dir_b: str, *, scenes: int = 200, seed: int = 0, max_new_tokens: int = 40,
            progress: bool = True) -> dict:
    from mmspec.bench.vlm import load_pipeline
    from mmspec.testbed.vlm_eval import evaluate, scene_size
    from mmspec.testbed.world import World

    if isinstance(scenes, bool) or not isinstance(scenes, int) or scenes < 1:
        raise ValueError(f"scenes must be an int >= 1 (validation scenes both models answer), got {scenes!r}")
    runs = []
    for d in (dir_a, dir_b):  # the same scenes, each rendered at the size its processor crops to
        pipe = load_pipeline(d)
        val = World(seed=seed, split="validation", image_size=scene_size(pipe.processor)).sample(scenes)
        runs.append(evaluate(pipe, val, max_new_tokens=max_new_tokens, progress=progress))
    out = {"a": dir_a, "b": dir_b, "scenes": scenes, "seed": seed}
    for key, label in (("caption_ok", "captions"), ("vqa_ok", "vqa")):
        out[label] = paired_comparison(*([c == "1" for c in r["per_scene"][key]] for r in runs))
    out["vqa_by_kind"] = {"a": runs[0]["vqa_by_kind"], "b": runs[1]["vqa_by_kind"]}
    return out


def cmd_eval_vlm(args) -> int:
    import torch

    from mmspec.bench.vlm import DEFAULT_MODEL, load_pipeline
    from mmspec.testbed.vlm_eval import evaluate, scene_size
    from mmspec.testbed.world import World

    if args.scenes < 1:
        raise SystemExit(f"mmspec testbed eval-vlm: --scenes must be >= 1, got {args.scenes}")
    torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model or DEFAULT_MODEL)
    val = World(seed=args.seed, split="validation", image_size=scene_size(pipe.processor)).sample(args.scenes)
    r = evaluate(pipe, val, max_new_tokens=40, progress=not args.no_progress)
    n = r["scenes"]
    for key, label in (("caption_correct", "caption correctness"), ("vqa_accuracy", "VQA accuracy (synonyms)")):
        k = round(r[key] * n)
        print(f"{label:24s} {r[key]:.1%} ({k}/{n}) [95% CI {r[key + '_ci95'][0]:.1%}, {r[key + '_ci95'][1]:.1%}]")
    print(f"{'captions, visible objects':24s} {r['caption_correct_visible_objects']:.1%}")
    print("captions by objects in the scene: " + ", ".join(f"{o}: {a}/{b}" for o, (a, b) in r["caption_by_objects"].items()))
    print("captions by the least visible object's pixels at 64 px: "
          + ", ".join(f"{b}: {a}/{c}" for b, (a, c) in r["caption_by_least_visible_px64"].items()))
    print("caption errors: " + ", ".join(f"{k} {v}" for k, v in sorted(r["caption_errors"].items())))
    print("VQA by kind: " + ", ".join(f"{k}: {a}/{b}" for k, (a, b) in r["vqa_by_kind"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in r.items() if k != "examples"}, f, indent=2)
    return 0


def format_comparison(r: dict) -> str:
    lines = [f"A = {r['a']}\nB = {r['b']}\n{r['scenes']} validation scenes (seed {r['seed']}), plain greedy, paired"]
    for label in ("captions", "vqa"):
        c = r[label]
        lines.append(f"{label:9s} A {c['a']:.1%}  B {c['b']:.1%}  only A {c['only_a']}, only B {c['only_b']}  "
                     f"B - A {c['difference']:+.1%} [95% CI {c['ci95'][0]:+.1%}, {c['ci95'][1]:+.1%}]  "
                     f"McNemar p = {c['mcnemar_p']:.3f}  {'within noise' if c['within_noise'] else 'DIFFERENT'}")
    return "\n".join(lines)


def cmd_compare_vlm(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    r = compare(args.a, args.b, scenes=args.scenes, seed=args.seed, progress=not args.no_progress)
    print(format_comparison(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


def _scene_options(p) -> None:
    """The options compare-vlm and eval-vlm share."""
    p.add_argument("--scenes", type=int, default=200, help="validation scenes (default 200, as train-vlm's eval)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--no-progress", action="store_true")


def add_compare_command(sub) -> None:
    p = sub.add_parser("compare-vlm", help="do two testbed VLMs answer equally well? (paired, same scenes)")
    p.add_argument("a", help="a SpeculativeVLMPipeline folder (e.g. assets/testbed/vlm)")
    p.add_argument("b", help="another one (e.g. the --out of a train-vlm run)")
    _scene_options(p)
    p.set_defaults(func=cmd_compare_vlm)
    p = sub.add_parser("eval-vlm", help="caption correctness and VQA accuracy of a testbed VLM, with 95%% intervals")
    p.add_argument("--model", default=None, help="a SpeculativeVLMPipeline folder (default: the bundled VLM)")
    _scene_options(p)
    p.set_defaults(func=cmd_eval_vlm)
