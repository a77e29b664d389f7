"""VLM commands of the `mmspec` CLI (model code is imported inside the functions).

    mmspec caption IMAGE... [--model DIR] [--drafter NAME] [--batch-size N] [--compare] [--json]
    mmspec vqa IMAGE --question TEXT [--model DIR] [--drafter NAME] [--compare] [--json]
    mmspec train-drafter --pipeline DIR --drafter text|eagle|vispec --out DIR [...]

`--model` is a saved `SpeculativeVLMPipeline` folder (or a transformers VLM checkpoint folder
with its processor, then `--drafter` is a saved drafter folder). It defaults to the bundled
testbed VLM (assets/testbed/vlm, found from the package location, so any working directory
works). `--compare` also decodes plainly through
the same code and reports the wall-clock speed-up and whether the answers are identical.
Options of `train-drafter` map one to one onto `TrainDrafterConfig` fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from mmspec.assets_dir import ASSETS
from mmspec.cli_types import positive_int, window_arg

BUNDLED_VLM = ASSETS / "testbed" / "vlm"


def _model_dir(args) -> str:
    if args.model:
        return args.model
    if (BUNDLED_VLM / "model_index.json").is_file():
        return str(BUNDLED_VLM)
    raise SystemExit(f"mmspec {args.command}: no testbed VLM is bundled yet ({BUNDLED_VLM} is missing); "
                     "pass --model DIR (a saved SpeculativeVLMPipeline or a transformers VLM checkpoint folder)")


def _run(args, images, prompts) -> int:
    import torch

    from .vlm import SpeculativeVLMPipeline

    from mmspec.acceptance import RULES, get_rule, is_position_keyed, rule_table
    from mmspec.devices import check_device, move_pipeline
    from mmspec.sampling import SamplingConfig

    # Refused before the weights load (a progress bar and seconds of work), not after; a
    # ValueError ends the command as `mmspec CMD: message` (mmspec.cli).
    SamplingConfig(temperature=args.temperature)
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.acceptance not in RULES:
        get_rule(args.acceptance)  # raises, naming the known rules
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        check_device(args.device, "--device")
        pipe = SpeculativeVLMPipeline.from_pretrained(_model_dir(args), drafter=None)
        pipe.set_progress_bar_config(disable=args.json)
        if args.drafter:
            pipe.load_drafter(args.drafter)
        move_pipeline(pipe, args.device)
    except ValueError as e:
        raise SystemExit(f"mmspec {args.command}: {e}") from None
    table = rule_table(args.acceptance)
    provided = pipe._spec_target.acceptance_tables()
    if table is not None and table not in provided:  # the library's advice (a rule object) is not for a CLI user
        usable = sorted(r for r in RULES if rule_table(r) in (None, *provided))
        raise SystemExit(f"mmspec {args.command}: --acceptance {args.acceptance} needs a {table} table, which this "
                         f"model does not provide; choose one of {usable}")
    speculative = pipe.drafter is not None
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, batch_size=args.batch_size,
                   acceptance=args.acceptance, generator=torch.Generator().manual_seed(args.seed))
    try:
        out = pipe(images, prompts, speculative=speculative, **options)
        plain = None
        if args.compare:
            options["generator"] = torch.Generator().manual_seed(args.seed)
            plain = pipe(images, prompts, speculative=False, **options)
    except ValueError as e:
        raise SystemExit(f"mmspec {args.command}: {e}") from None
    s = out.stats
    report = {
        "model": _model_dir(args), "drafter": args.drafter or ("default" if speculative else None),
        "items": [{"image": str(img), "prompt": p, "answer": t, "error": e}
                  for img, p, t, e in zip(images, prompts, out.texts, out.errors)],
        "mean_accepted_length": s.mean_accepted_length, "target_calls": s.target_calls,
        "new_tokens": sum(s.new_tokens), "seconds": s.total_seconds,
    }
    if plain is not None:
        report["plain_seconds"] = plain.stats.total_seconds
        report["speedup"] = plain.stats.total_seconds / s.total_seconds if s.total_seconds > 0 else None
        report["identical_to_plain"] = plain.texts == out.texts
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for item in report["items"]:
            head = item["image"] + (f" [{item['prompt']}]" if item["prompt"] else "")
            print(f"{head}: {item['answer'] if item['error'] is None else 'ERROR ' + item['error']}")
        line = (f"{report['new_tokens']} tokens in {s.total_seconds:.2f}s; "
                + (f"mean accepted length {s.mean_accepted_length:.2f} ({s.target_calls} target calls)"
                   if speculative else "plain decoding (no drafter)"))
        if plain is not None:
            speedup = "n/a (nothing decoded)" if report["speedup"] is None else f"{report['speedup']:.2f}x"
            line += (f"; plain {plain.stats.total_seconds:.2f}s, speed-up {speedup}, answers "
                     + ("identical" if report["identical_to_plain"] else "DIFFER"))
            if not report["identical_to_plain"] and args.temperature > 0 and not is_position_keyed(args.acceptance):
                line += (f" (sampled: --acceptance {args.acceptance} draws other tokens than plain sampling for a seed, "
                         "from the same distribution; --acceptance invariant gives plain sampling's answers)")
        print(line)
    return 1 if any(e is not None for e in out.errors) else 0


def cmd_caption(args) -> int:
    return _run(args, list(args.images), [None] * len(args.images))


def cmd_vqa(args) -> int:
    if not args.question.strip():  # refused before the model loads
        raise SystemExit("mmspec vqa: --question is empty; ask a question, or use `mmspec caption` to caption the image")
    return _run(args, [args.image], [args.question])


def cmd_train_drafter(args) -> int:
    from .train_config import TrainDrafterConfig
    from .train_drafter import train_drafter

    names = {f.name for f in dataclasses.fields(TrainDrafterConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["progress"] = not args.no_progress
    try:
        config = TrainDrafterConfig(**values)
        result = train_drafter(config)
    except ValueError as e:
        raise SystemExit(f"mmspec train-drafter: {e}") from None
    losses = result["losses"]
    if losses:
        print(f"trained {config.drafter} drafter: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    print(f"saved to {result['out']} (load with pipe.load_drafter or --drafter)")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="saved pipeline or transformers VLM folder (default: bundled VLM)")
    p.add_argument("--drafter", default=None, help="drafter name saved with the pipeline, or a drafter folder")
    p.add_argument("--batch-size", type=positive_int, default=None, help="items per batch (default: all at once)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer at most (0: none)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--acceptance", default="exact",
                   help="exact (default), invariant (sampled answers equal plain sampling's for a seed), typical, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the pipeline is moved there)")
    p.add_argument("--compare", action="store_true", help="also decode plainly: speed-up and identical answers")
    p.add_argument("--json", action="store_true", help="print a JSON report")


def add_subparsers(sub) -> None:
    p = sub.add_parser("caption", help="caption images with speculative decoding")
    p.add_argument("images", nargs="+")
    _common(p)
    p.set_defaults(func=cmd_caption)
    p = sub.add_parser("vqa", help="answer a question about an image")
    p.add_argument("image")
    p.add_argument("--question", required=True)
    _common(p)
    p.set_defaults(func=cmd_vqa)
    p = sub.add_parser("train-drafter", help="distil a text / EAGLE / ViSpec / FLASH drafter from a pipeline's target")
    from .train_config import HELP, TrainDrafterConfig

    for f in dataclasses.fields(TrainDrafterConfig):
        if f.name == "progress":
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", help=HELP[f.name])
        elif f.default is dataclasses.MISSING:
            p.add_argument(flag, required=True, help=HELP[f.name])
        else:
            kind = {"int": int, "float": float, "int | str": window_arg, "int | None": int,
                    "int | str | None": window_arg}.get(str(f.type), str)  # int | "auto"
            p.add_argument(flag, type=kind, default=f.default, help=HELP[f.name])
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train_drafter)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - `mmspec` is the entry point
    from mmspec.cli import main as cli_main

    return cli_main(argv if argv is not None else sys.argv[1:])
