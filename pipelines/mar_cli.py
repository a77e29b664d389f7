"""`mmspec generate` on MAR folders (continuous tokens, CSpD), and the helpers that tell a MAR
pipeline folder from a discrete image-generator folder. Imports stay inside the functions, so
`mmspec --help` stays instant.

    mmspec generate --model DIR --class N [N ...] [--num-images K] [--num-iter S] [--guidance-scale G]
                    [--cfg-schedule linear|constant] [--temperature T] [--num-draft-steps K]
                    [--prefill-fraction F] [--draft model|self] [--acceptance continuous] [--compare]
                    [--json] --out DIR

A folder is a MAR folder when its model_index.json names `SpeculativeMARPipeline` (never
guessed from the path). Options of the other kind of pipeline are refused, naming the option:
MAR folders take no Jacobi drafter, window, coupling, top-k or discrete acceptance rule;
discrete folders take no --num-iter, --cfg-schedule, --num-draft-steps, --prefill-fraction or
--draft.
`--compare` also samples plainly (the same MAR code without the drafter) on the same seed and
writes both images side by side; CSpD samples are distributed like plain ones, not equal to
them, so the two images of a pair differ where a draft was rejected.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from mmspec.assets_dir import ASSETS

# The bundled testbed MAR pair, found from the package location (absent until one is trained
# and bundled: `mmspec testbed train-mar --out DIR`).
BUNDLED_MAR = ASSETS / "testbed" / "mar"
MAKE_ONE = "make one with `mmspec testbed train-mar --out DIR` and pass --model DIR"

# generate options that only MAR folders take (dest names; their parser default is None)
MAR_ONLY = {"num_iter": "--num-iter", "cfg_schedule": "--cfg-schedule", "num_draft_steps": "--num-draft-steps",
            "prefill_fraction": "--prefill-fraction", "draft": "--draft"}
# generate options that only discrete (SpeculativeARImagePipeline) folders take
DISCRETE_ONLY = {"window": "--window", "coupling": "--coupling", "top_k": "--top-k"}
DISCRETE_DEFAULTS = {"acceptance": "exact", "window": "auto", "coupling": "maximal"}


def is_mar_folder(path) -> bool:
    """True when `path` is a saved `SpeculativeMARPipeline` (by its model_index.json)."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        return False
    try:
        return json.loads(index.read_text()).get("_class_name") == "SpeculativeMARPipeline"
    except (OSError, ValueError):
        return False


def load_mar(path, dtype=None):
    """The pipeline in float32 (the bundled pair is stored fp16, which CPUs run slowly)."""
    import torch

    from mmspec.pipelines.mar_pipeline import SpeculativeMARPipeline

    pipe = SpeculativeMARPipeline.from_pretrained(str(path), torch_dtype=dtype or torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def mar_defaults(path, pipe) -> dict:
    """Sampling defaults of a folder: the `eval_num_iter` / `eval_guidance` / `eval_temperature`
    that `mmspec testbed train-mar` stores in metrics.json, else MAR's 64 steps (at most one
    per token), guidance 3.0 and temperature 1.0. A metrics.json that does not parse, or holds
    one of those values in a form that cannot be used, is refused by name (it silently gave
    the fallbacks before)."""
    out = {"num_iter": min(64, pipe.transformer.seq_len), "guidance_scale": 3.0, "temperature": 1.0}
    metrics = Path(path) / "metrics.json"
    if not metrics.is_file():
        return out
    cfg = read_metrics(metrics).get("config", {})
    if not isinstance(cfg, dict):
        raise ValueError(f"{metrics}: 'config' is a {type(cfg).__name__}, not an object; fix or remove the file")

    def number(key, whole, zero_ok):
        v = cfg.get(key)
        if v is None:
            return None
        ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and (v >= 0 if zero_ok else v > 0)
              and (not whole or float(v).is_integer()))
        if not ok:
            raise ValueError(f"{metrics}: config.{key} = {v!r} is not a {'whole ' if whole else ''}number "
                             f"{'>=' if zero_ok else '>'} 0; fix or remove it")
        return int(v) if whole else float(v)

    for key, name, whole, zero_ok in (("eval_num_iter", "num_iter", True, False),
                                      ("eval_guidance", "guidance_scale", False, True),
                                      ("eval_temperature", "temperature", False, False)):
        v = number(key, whole, zero_ok)
        if v is not None:
            out[name] = v
    return out


def read_metrics(metrics: Path) -> dict:
    """A folder's metrics.json as a dict, or a ValueError naming the file."""
    try:
        data = json.loads(metrics.read_text())
    except ValueError as err:
        raise ValueError(f"{metrics} is not valid JSON ({err}); fix or remove the file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{metrics} holds a {type(data).__name__}, not a JSON object; fix or remove the file")
    return data


def add_generate_options(p) -> None:
    """The MAR options of `mmspec generate` (default None = the folder's default)."""
    g = p.add_argument_group("MAR folders (SpeculativeMARPipeline)")
    g.add_argument("--num-iter", type=int, default=None, help="generation steps (default: the folder's, else 64)")
    g.add_argument("--cfg-schedule", choices=("linear", "constant"), default=None, help="default linear")
    g.add_argument("--draft", choices=("model", "self"), default=None,
                   help="who drafts: the folder's drafter MAR (model, default) or the target from its own earlier "
                   "conditioning, verified along whole denoising paths (self; no drafter needed)")
    g.add_argument("--num-draft-steps", type=int, default=None,
                   help="generation steps drafted per round (default 4; 3 with --draft self)")
    g.add_argument("--prefill-fraction", type=float, default=None,
                   help="fraction of the steps the target runs itself first (default 0.15)")


def check_discrete_options(args, model: str) -> None:
    """For a discrete folder: refuse the MAR-only options and fill in the discrete defaults."""
    for dest, flag in MAR_ONLY.items():
        if getattr(args, dest, None) is not None:
            raise SystemExit(f"mmspec generate: {flag} is for MAR folders (SpeculativeMARPipeline); {model} is a "
                             "discrete-token image generator (drop the option)")
    for dest, value in DISCRETE_DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)


def _check_mar_options(args, model: str) -> None:
    from mmspec.acceptance import CONTINUOUS_RULES

    if args.drafter == "jacobi":
        raise SystemExit(f"mmspec generate: --drafter jacobi is for discrete-token generators; {model} is a MAR "
                         "folder, whose drafter is its own small MAR (drop --drafter or use --drafter model)")
    for dest, flag in DISCRETE_ONLY.items():
        if getattr(args, dest, None) is not None:
            raise SystemExit(f"mmspec generate: {flag} is for discrete-token generators; {model} is a MAR folder "
                             "(drop the option)")
    if args.acceptance is not None and args.acceptance not in CONTINUOUS_RULES:
        raise SystemExit(f"mmspec generate: --acceptance {args.acceptance} is not a continuous-token rule; MAR "
                         f"folders take one of {sorted(CONTINUOUS_RULES)}")


def cmd_generate_mar(args, model: str) -> int:
    """`mmspec generate` for a MAR folder (see the module docstring)."""
    import torch

    from mmspec.devices import move_pipeline

    _check_mar_options(args, model)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        pipe = load_mar(model)
    except ValueError as e:
        raise SystemExit(f"mmspec generate: {e}") from None
    move_pipeline(pipe, args.device)
    pipe.set_progress_bar_config(disable=args.json)
    draft = args.draft or "model"
    if pipe.drafter is None and draft == "model":
        raise SystemExit(f"mmspec generate: {model} has no drafter MAR, so it cannot sample speculatively with it "
                         "(--draft self needs none)")
    n_cls = pipe.transformer.config.class_num
    bad = [c for c in args.class_ if not 0 <= c < n_cls]
    if bad:
        raise SystemExit(f"mmspec generate: --class {bad[0]} is out of range: this MAR has classes 0..{n_cls - 1}")
    if args.num_images < 1:
        raise SystemExit(f"mmspec generate: --num-images must be >= 1, got {args.num_images}")
    defaults = mar_defaults(model, pipe)
    call = dict(num_iter=args.num_iter if args.num_iter is not None else defaults["num_iter"],
                guidance_scale=args.guidance_scale if args.guidance_scale is not None else defaults["guidance_scale"],
                cfg_schedule=args.cfg_schedule or "linear",
                temperature=args.temperature if args.temperature is not None else defaults["temperature"],
                acceptance=args.acceptance or "continuous", draft=draft,
                num_draft_steps=args.num_draft_steps if args.num_draft_steps is not None else (3 if draft == "self" else 4))
    if draft == "model" or args.prefill_fraction is not None:  # (the pipeline refuses it with --draft self)
        call["prefill_fraction"] = args.prefill_fraction if args.prefill_fraction is not None else 0.15
    labels = [c for c in args.class_ for _ in range(args.num_images)]
    os.makedirs(args.out, exist_ok=True)
    seeded = lambda: torch.Generator().manual_seed(args.seed)  # noqa: E731
    try:
        if args.compare:  # an untimed warm-up of both at the timed shapes, then alternating timed rounds
            from mmspec.cli import timed_compare

            out, plain, spec_s, plain_s = timed_compare(lambda: pipe(labels, **call, generator=seeded()),
                                                        lambda: pipe(labels, **call, speculative=False,
                                                                     generator=seeded()), args.rounds)
        else:
            t0 = time.perf_counter()
            out = pipe(labels, **call, generator=seeded())
            spec_s = time.perf_counter() - t0
    except ValueError as e:
        raise SystemExit(f"mmspec generate: {e}") from None
    from mmspec.cli_types import image_file_names

    names = image_file_names(labels)
    for img, name in zip(out.images, names):
        img.save(os.path.join(args.out, name))
    s = out.stats
    summary = {"model": model, "pipeline": "SpeculativeMARPipeline", "classes": args.class_, "images": len(labels),
               **call, "speculative": "cspd" if draft == "model" else "cspd-self", "seed": args.seed, "seconds": round(spec_s, 3),
               "target_forwards_per_image": round(s.target_forwards_per_image, 3),
               "draft_forwards_per_image": float(s.spec.draft_calls), "acceptance_rate": round(s.acceptance_rate, 4),
               "accepted_tokens": s.accepted_tokens, "judged_tokens": s.judged_tokens,
               "residual_tokens": s.residual_tokens, "fallbacks": s.fallbacks, "files": names}
    if args.compare:
        from mmspec.cli import _side_by_side

        for img, name in zip(plain.images, names):
            img.save(os.path.join(args.out, "plain_" + name))
        _side_by_side(out.images, plain.images, os.path.join(args.out, "compare.png"))
        summary.update(plain_seconds=round(plain_s, 3), speedup=round(plain_s / spec_s, 3), rounds=args.rounds,
                       plain_target_forwards_per_image=round(plain.stats.target_forwards_per_image, 3),
                       compare="compare.png")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"wrote {len(labels)} images to {args.out} in {spec_s:.2f}s (CSpD, draft={draft}, acceptance={call['acceptance']}, "
          f"{call['num_iter']} steps); acceptance rate {s.acceptance_rate:.3f}, target forwards per image "
          f"{s.target_forwards_per_image:.0f}, draft forwards per image {s.spec.draft_calls}, fallbacks {s.fallbacks}")
    if args.compare:
        print(f"plain MAR sampling: {plain_s:.2f}s, {plain.stats.target_forwards_per_image:.0f} target forwards per "
              f"image; speed-up {plain_s / spec_s:.2f}x (medians of {args.rounds} rounds); "
              f"side by side in {os.path.join(args.out, 'compare.png')} "
              "(left: CSpD, right: plain, same seed; equal in distribution, not pixel for pixel)")
    return 0
