"""The `mmspec` command line.

    mmspec demo                      side-by-side speed tables: a locally built LLM pair, the bundled
                                     image generator, the bundled VLM's captions
    mmspec bench [options]           the core benchmark (plain / assisted / mmspec), JSON out
    mmspec bench imagegen [options]  image generation: plain vs every drafter and rule, JSON out
    mmspec bench mar [options]       MAR (continuous tokens): plain sampling vs CSpD, JSON out
    mmspec bench vlm [options]       VLM captions / VQA: plain vs each drafter, JSON out (mmspec/bench/vlm.py)
    mmspec bench gpu [options]       7B-shaped target on a GPU, forced acceptance, vs the replay ideal
                                     (mmspec/bench/gpu.py; `--shape tiny --device cpu`: smoke run)
    mmspec generate --class N --out DIR   class-conditional images (speculative; --compare: vs plain;
                                     MAR folders: CSpD, see pipelines/mar_cli.py)
    mmspec testbed ...               the procedural world, VQ tokenizer and judge (see
                                     mmspec/testbed/commands.py)
    mmspec caption / vqa / train-drafter   VLM captioning, VQA and drafter training (see
                                     pipelines/vlm_cli.py)

argparse options map one to one onto the fields of the config dataclasses they build
(`mmspec.bench.core.BenchConfig`, `mmspec.bench.pair.PairConfig`). Model and benchmark code is
imported inside the command functions; building the parsers loads torch but not transformers or
diffusers (`mmspec --help`: about 2 s). A ValueError or a missing path ends a command as
`mmspec CMD: message` (MMSPEC_TRACEBACK=1: the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys

from mmspec.cli_types import given_flags, image_file_names, positive_int, refuse_beside_smoke, window_arg


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
        refuse_beside_smoke(args.command, args, build_parser().parse_args(["bench"]),
                            ("batch_sizes", "draft_tokens", "max_new_tokens", "repeats", "target_layers"))
        # Seconds-long check that the whole benchmark runs (tiny pair, one round); no figures.
        pair = PairConfig(vocab_size=256, hidden_size=64, intermediate_size=128, target_layers=2, heads=4,
                          perturbation=args.perturbation, seed=args.seed)
        args.batch_sizes, args.draft_tokens, args.max_new_tokens, args.repeats = (1, 2), (3, 2), 8, 1
    try:
        return BenchConfig(
            batch_sizes=args.batch_sizes, num_draft_tokens=args.draft_tokens, max_new_tokens=args.max_new_tokens,
            repeats=args.repeats, threads=args.threads, compare_kernels=not args.no_compare_kernels, pair=pair,
            order=args.order,
        )
    except ValueError as e:
        raise SystemExit(f"mmspec {args.command}: {e}") from None


# Options of `mmspec bench` that only one of its two suites reads: given to the other one they
# would be silently ignored, so they are refused by name.
_CORE_ONLY = ("max_new_tokens", "target_layers", "perturbation", "no_compare_kernels", "order")
_IMAGEGEN_ONLY = ("model", "images", "window", "methods", "guidance_scale", "temperature", "judge_images", "device")


def _refuse_other_suites_options(args, names: tuple[str, ...], suite: str) -> None:
    given = given_flags(args, build_parser().parse_args(["bench"]), names)
    if given:
        raise SystemExit(f"mmspec bench{' ' + suite if suite == 'imagegen' else ''}: {', '.join(given)} "
                         f"{'does' if len(given) == 1 else 'do'} not apply to this suite "
                         f"(`mmspec bench --help` groups the options by suite)")


def cmd_bench(args) -> int:
    if args.suite == "imagegen":
        _refuse_other_suites_options(args, _CORE_ONLY, "imagegen")
        return cmd_bench_imagegen(args)
    if args.command == "bench":
        _refuse_other_suites_options(args, _IMAGEGEN_ONLY, "core")
    from mmspec.bench.core import format_table, run
    from mmspec.bench.report import partial_saver, save

    config = _bench_config(args)
    report = run(config, progress=lambda m: print(m, file=sys.stderr, flush=True), checkpoint=partial_saver(args.json))
    print(format_table(report))
    if args.json:
        save(report, args.json)
        print(f"wrote {args.json}")
    return 0


def cmd_bench_imagegen(args) -> int:
    from mmspec.bench.imagegen import DEFAULT_MODEL, ImageBenchConfig, format_table, run, save
    from mmspec.bench.report import partial_saver

    kw = dict(model=args.model or DEFAULT_MODEL, batch_sizes=args.batch_sizes, images=args.images,
              repeats=args.repeats, guidance_scale=args.guidance_scale, temperature=args.temperature,
              draft_tokens=args.draft_tokens, window=args.window, methods=tuple(args.methods or ()), seed=args.seed,
              threads=args.threads or 2, judge_images=args.judge_images, device=args.device)
    if args.smoke:  # a quick check that the benchmark runs end to end (tiny sizes); no figures
        refuse_beside_smoke("bench imagegen", args, build_parser().parse_args(["bench", "imagegen"]),
                            ("batch_sizes", "images", "repeats", "draft_tokens", "window", "judge_images"))
        kw.update(batch_sizes=(1, 2), images=2, repeats=1, draft_tokens=(2,), window=(3,), judge_images=0)
    _require_model(kw["model"], "bench imagegen")
    try:
        config = ImageBenchConfig(**kw)
    except ValueError as e:
        raise SystemExit(f"mmspec bench imagegen: {e}") from None
    report = run(config, progress=lambda m: print(m, file=sys.stderr, flush=True), checkpoint=partial_saver(args.json))
    print(format_table(report))
    if args.json:
        save(report, args.json)
        print(f"wrote {args.json}")
    return 0


def _require_model(path: str, command: str) -> None:
    if not os.path.isdir(path):
        raise SystemExit(f"mmspec {command}: no generator at {path}; pass --model DIR (a SpeculativeARImagePipeline "
                         "folder, or the testbed layout made by `mmspec testbed train-imagegen`)")


def cmd_generate(args) -> int:
    import json
    import time

    import torch

    from mmspec.bench.imagegen import DEFAULT_MODEL, default_guidance, load_pipeline
    from mmspec.drafters import JacobiDrafter
    from mmspec.models.llamagen_gpt import LlamaGenGPT

    model = args.model or DEFAULT_MODEL
    from mmspec.devices import check_device, move_pipeline
    from mmspec.pipelines.mar_cli import check_discrete_options, cmd_generate_mar, is_mar_folder

    try:
        check_device(args.device, "--device")
    except ValueError as e:
        raise SystemExit(f"mmspec generate: {e}") from None
    if args.rounds is not None and not args.compare:
        raise SystemExit("mmspec generate: --rounds times the --compare runs; add --compare (or drop --rounds)")
    args.rounds = args.rounds or 3

    if is_mar_folder(model):  # continuous tokens: SpeculativeMARPipeline with CSpD
        return cmd_generate_mar(args, model)
    _require_model(model, "generate")
    jacobi_flags = [f for f, v in (("--window", args.window), ("--coupling", args.coupling)) if v is not None]
    if jacobi_flags and args.drafter == "model":
        raise SystemExit(f"mmspec generate: {', '.join(jacobi_flags)} set the Jacobi drafter; --drafter model drafts "
                         "with the folder's small GPT (drop them, or use --drafter jacobi)")
    if jacobi_flags and args.drafter is None:
        args.drafter = "jacobi"  # a window or coupling asks for the Jacobi drafter (not the folder's saved one)
    check_discrete_options(args, model)
    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = load_pipeline(model)
    move_pipeline(pipe, args.device)
    pipe.set_progress_bar_config(disable=args.json)
    if args.drafter == "jacobi":
        pipe.drafter = JacobiDrafter(args.window, None if args.coupling == "none" else args.coupling)
    elif args.drafter == "model" and not isinstance(pipe.drafter, LlamaGenGPT):
        if getattr(pipe, "drafter_model", None) is None:
            raise SystemExit(f"mmspec generate: {model} has no drafter model; use --drafter jacobi")
        pipe.drafter = pipe.drafter_model
    scale = args.guidance_scale if args.guidance_scale is not None else default_guidance(model)
    os.makedirs(args.out, exist_ok=True)
    call = dict(num_images_per_prompt=args.num_images, guidance_scale=scale,
                temperature=1.0 if args.temperature is None else args.temperature,
                top_k=args.top_k, acceptance=args.acceptance)
    seeded = lambda: torch.Generator().manual_seed(args.seed)  # noqa: E731
    try:
        if args.compare:
            out, plain, spec_s, plain_s = timed_compare(lambda: pipe(args.class_, **call, generator=seeded()),
                                                        lambda: pipe(args.class_, **call, speculative=False,
                                                                     generator=seeded()), args.rounds)
        else:
            t0 = time.perf_counter()
            out = pipe(args.class_, **call, generator=seeded())
            spec_s = time.perf_counter() - t0
    except ValueError as e:
        raise SystemExit(f"mmspec generate: {e}") from None
    labels = [c for c in args.class_ for _ in range(args.num_images)]
    names = image_file_names(labels)
    for img, name in zip(out.images, names):
        img.save(os.path.join(args.out, name))
    s = out.stats
    summary = {"model": model, "classes": args.class_, "images": len(labels), "guidance_scale": scale,
               "acceptance": args.acceptance, "lossless": s.lossless, "drafter": s.drafter, "seed": args.seed,
               "seconds": round(spec_s, 3), "target_forwards_per_image": round(s.target_forwards_per_image, 3),
               "mean_accepted_length": round(s.mean_accepted_length, 3), "files": names}
    if args.compare:
        for img, name in zip(plain.images, names):
            img.save(os.path.join(args.out, "plain_" + name))
        _side_by_side(out.images, plain.images, os.path.join(args.out, "compare.png"))
        summary.update(plain_seconds=round(plain_s, 3), speedup=round(plain_s / spec_s, 3), rounds=args.rounds,
                       plain_target_forwards_per_image=round(plain.stats.target_forwards_per_image, 3),
                       same_tokens_as_plain=bool(torch.equal(plain.tokens, out.tokens)), compare="compare.png")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {len(labels)} images to {args.out} in {spec_s:.2f}s ({s.drafter}, acceptance={args.acceptance}); "
              f"target forwards per image {s.target_forwards_per_image:.2f}, mean accepted length "
              f"{s.mean_accepted_length:.2f}")
        if args.compare:
            print(f"plain decoding: {plain_s:.2f}s, {plain.stats.target_forwards_per_image:.2f} forwards per image; "
                  f"speed-up {plain_s / spec_s:.2f}x (medians of {args.rounds} rounds); "
                  f"side by side in {os.path.join(args.out, 'compare.png')} "
                  f"(left: speculative, right: plain, same seed); same tokens as plain: "
                  f"{'yes' if summary['same_tokens_as_plain'] else 'no'}")
    return 0


def timed_compare(spec, plain, rounds: int):
    """`mmspec generate --compare`: both zero-argument calls once untimed at the timed shapes (first
    calls of a shape pay one-off costs: kernel and attention-form measurements, allocations; a
    warm-up at batch 1 left them to the timed speculative call, 0.86x reported for 2 images of
    one class in session 52), then `rounds` timed rounds, the two taking turns to run first.
    Returns (first speculative output, first plain output, median seconds of each)."""
    import statistics
    import time

    spec(), plain()
    outs, secs = {}, {"spec": [], "plain": []}
    for r in range(rounds):
        for name in (("spec", "plain") if r % 2 == 0 else ("plain", "spec")):
            t0 = time.perf_counter()
            got = (spec if name == "spec" else plain)()
            secs[name].append(time.perf_counter() - t0)
            outs.setdefault(name, got)
    return outs["spec"], outs["plain"], statistics.median(secs["spec"]), statistics.median(secs["plain"])


def _side_by_side(left, right, path: str, scale: int = 2) -> None:
    from PIL import Image

    w, h = left[0].size
    sheet = Image.new("RGB", (2 * w * scale + 4, len(left) * h * scale), (255, 255, 255))
    for i, (a, b) in enumerate(zip(left, right)):
        sheet.paste(a.resize((w * scale, h * scale), Image.NEAREST), (0, i * h * scale))
        sheet.paste(b.resize((w * scale, h * scale), Image.NEAREST), (w * scale + 4, i * h * scale))
    sheet.save(path)


def cmd_demo(args) -> int:
    print("mmspec demo: speculative decoding vs plain decoding and transformers' assisted generation.\n"
          "The target/drafter pair is BUILT LOCALLY with random weights (mmspec/bench/pair.py): its greedy\n"
          "agreement is measured below. Greedy outputs are checked identical to plain decoding.\n"
          "mmspec runs float32 CPU models on prepacked linear weights by default; every method is also timed on\n"
          "the other kernels (transformers on mmspec's packed view), so 'same kern.' shows the speculative gain alone.\n",
          flush=True)
    if not args.no_images and os.path.exists(args.image_out) and not os.path.isdir(args.image_out):
        # checked first: the image section writes there after minutes of benchmarks
        raise SystemExit(f"mmspec demo: --image-out {args.image_out} is a file, not a folder")
    args.suite = "core"
    code = cmd_bench(args)
    if not args.no_images:
        _demo_images(args)
    if not args.no_captions:
        _demo_captions(args)
    return code


def _demo_captions(args) -> None:
    from mmspec.bench.vlm import DEFAULT_MODEL, demo

    if not os.path.isfile(os.path.join(DEFAULT_MODEL, "model_index.json")):
        print(f"\n(captioning section skipped: no bundled VLM at {DEFAULT_MODEL})")
        return
    print("\nmmspec demo, captions: the bundled testbed VLM (assets/testbed/vlm, a LLaVA-architecture model), plain\n"
          "greedy decoding vs speculative decoding with each of its drafters (text-only small LM, EAGLE head, ViSpec\n"
          "head, FLASH head) on the bundled sample scenes; one timed round, so expect noise.\n", flush=True)
    print(demo(DEFAULT_MODEL, threads=args.threads or 2, progress=lambda m: print(m, file=sys.stderr, flush=True)))


def _demo_images(args) -> None:
    from mmspec.bench.imagegen import DEFAULT_MODEL, demo
    from mmspec.bench.mar import demo_section as mar_demo

    if not os.path.isdir(DEFAULT_MODEL):
        print(f"\n(image section skipped: no bundled generator at {DEFAULT_MODEL})")
        print("\n" + mar_demo(args.image_out, threads=args.threads or 2, progress=lambda m: print(m, file=sys.stderr)))
        return
    print("\nmmspec demo, images: the bundled class-conditional generator (assets/testbed/imagegen), plain AR decoding\n"
          "vs speculative decoding with a small drafter model and with Jacobi self-drafting (exact = lossless), and the\n"
          "relaxed LANTERN and GSD rules; same labels and seeds for every method.\n", flush=True)
    print(demo(DEFAULT_MODEL, args.image_out, progress=lambda m: print(m, file=sys.stderr, flush=True),
               threads=args.threads or 2))
    print("\n" + mar_demo(args.image_out, threads=args.threads or 2, progress=lambda m: print(m, file=sys.stderr)))


def _add_bench_options(p: argparse.ArgumentParser, *, demo: bool) -> None:
    if not demo:
        # `mmspec bench core|mar|vlm|gpu` never reach this parser (main() hands them to SUITES);
        # "core" stays a choice for callers of this parser, and is what no suite runs.
        p.add_argument("suite", nargs="?", choices=("core", "imagegen"), default="core",
                       help="imagegen: the image generator; none: the core speed table (LLM pair: plain generate, "
                            f"assisted generation, mmspec); the suites {sorted(SUITES)} have their own options "
                            "(`mmspec bench SUITE --help`; `core` there is the adaptive draft length table)")
    p.add_argument("--batch-sizes", type=_ints, default=(1, 8), help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--draft-tokens", type=_ints, default=(4, 3), help="draft tokens K per batch size (default 4,3)")
    p.add_argument("--max-new-tokens", type=int, default=48 if demo else 64)
    p.add_argument("--repeats", type=int, default=2 if demo else 3, help="timed runs per method (median)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: torch's choice for the core table; 2 for " +
                        ("the image, MAR and caption sections)" if demo else "imagegen)"))
    p.add_argument("--target-layers", type=int, default=14)
    p.add_argument("--perturbation", type=float, default=0.03, help="target/drafter disagreement knob")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compare-kernels", action="store_true",
                   help="run each method only on its library's default linear kernels (faster, no like-for-like rows)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this path")
    p.add_argument("--order", choices=ORDERS, default="balanced",
                   help="method order within rounds: balanced (every method follows every other equally often; "
                        "default) or alternate (A B C, C B A, ...: the reports before session 52)")
    if not demo:
        p.add_argument("--smoke", action="store_true",
                       help="a quick run at its own tiny sizes (core: a tiny pair, seconds; imagegen: the bundled "
                            "generator, 1-2 minutes on 2 CPU cores): checks the bench runs, no figures")
        g = p.add_argument_group("imagegen")
        g.add_argument("--model", default=None, help="pipeline folder (default assets/testbed/imagegen)")
        g.add_argument("--images", type=int, default=8, help="images per method and batch size per round")
        g.add_argument("--window", type=_ints, default=(16, 8), help="Jacobi window per batch size")
        g.add_argument("--methods", type=lambda t: tuple(x for x in t.split(",") if x), default=None,
                       help="comma-separated subset of the methods (default all)")
        g.add_argument("--guidance-scale", type=float, default=None)
        g.add_argument("--temperature", type=float, default=1.0)
        g.add_argument("--judge-images", type=int, default=0, help="judge plain vs lossy rules on N images each")
        g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the pipeline is moved there)")


from mmspec.bench import ORDERS, SUITES  # noqa: E402  (plain names, no heavy imports)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmspec", description="Speculative decoding for VLMs and AR image generators")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="side-by-side speed tables: a locally built LLM pair, the bundled image "
                       "generator, the bundled VLM")
    _add_bench_options(p, demo=True)
    p.add_argument("--image-out", default="mmspec_demo_images", help="folder for the image section's grid PNG + JSON")
    p.add_argument("--no-images", action="store_true", help="skip the image section")
    p.add_argument("--no-captions", action="store_true", help="skip the VLM captioning section")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("bench", help="core speed table (plain generate, assisted generation, mmspec); "
                       f"`mmspec bench SUITE --help` for the suites {sorted([*SUITES, 'imagegen'])}")
    _add_bench_options(p, demo=False)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("generate", help="class-conditional images with speculative decoding (PNG out)")
    p.add_argument("--model", default=None, help="pipeline folder (default: the bundled assets/testbed/imagegen); "
                   "a SpeculativeMARPipeline folder samples with CSpD")
    p.add_argument("--class", dest="class_", type=int, nargs="+", required=True, help="class id(s)")
    p.add_argument("--num-images", type=int, default=1, help="images per class")
    p.add_argument("--acceptance", default=None, help="rule name: exact (default), invariant (same tokens as plain decoding for a seed, whatever the drafter), lantern, gsd, ...; MAR: continuous")
    p.add_argument("--drafter", choices=("jacobi", "model"), default=None, help="default: the pipeline's")
    p.add_argument("--window", type=window_arg, default=None,
                   help="Jacobi window, an int or 'auto' (chosen by measurement); implies --drafter jacobi (default with it: auto)")
    p.add_argument("--coupling", choices=("maximal", "gumbel", "none"), default=None, help="default maximal")
    p.add_argument("--guidance-scale", type=float, default=None, help="default: the generator's own")
    p.add_argument("--temperature", type=float, default=None,
                   help="default 1.0 (MAR folders: the folder's own, e.g. 0.7 for the testbed pair)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the pipeline is moved there; seeds stay on the CPU)")
    p.add_argument("--compare", action="store_true", help="also decode plainly on the same seed; print the speed-up")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="with --compare: timed rounds of each path after an untimed warm-up (median; default 3)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    p.add_argument("--out", required=True, help="output folder for the PNGs")
    from mmspec.pipelines.mar_cli import add_generate_options as add_mar_generate

    add_mar_generate(p)
    p.set_defaults(func=cmd_generate)
    from mmspec.testbed.commands import add_subparsers as add_testbed

    add_testbed(sub)
    from mmspec.pipelines.vlm_cli import add_subparsers as add_vlm

    add_vlm(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `mmspec ARGS`. Called in-process (a notebook, a test), it puts back what the commands
    set for the process: HF_HUB_OFFLINE (the variable, and huggingface_hub's offline flag, read
    once at its import), torch's thread count (`--threads`) and torch's global random state
    (the benches seed it)."""
    import torch

    offline, threads, rng = os.environ.get("HF_HUB_OFFLINE"), torch.get_num_threads(), torch.random.get_rng_state()
    hub = sys.modules.get("huggingface_hub.constants")
    hub_offline = getattr(hub, "HF_HUB_OFFLINE", None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in mmspec downloads at run time
    try:
        return _main(argv)
    finally:
        if offline is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = offline
        now = sys.modules.get("huggingface_hub.constants")
        if now is not None:  # imported before: its flag as it was; during the call: as the restored variable says
            now.HF_HUB_OFFLINE = hub_offline if hub is not None else (  # (as huggingface_hub reads it)
                (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper()
                in ("1", "ON", "YES", "TRUE"))
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in SUITES:
        # `mmspec bench SUITE ...`: each suite parses its own options (mmspec/bench/__init__.py).
        import importlib

        module, func = SUITES[argv[1]].split(":")
        return _reported(f"bench {argv[1]}", lambda: getattr(importlib.import_module(module), func)(argv[2:]))
    args = build_parser().parse_args(argv)
    name = " ".join(filter(None, (args.command, getattr(args, "testbed_command", None))))
    return _reported(name, lambda: args.func(args))


# What mmspec raises for a bad value, a missing or wrong folder (a ValueError naming it, or the
# OS's error naming the path): printed as `mmspec CMD: message`, as the commands' own checks are,
# not as a traceback. MMSPEC_TRACEBACK=1 shows the traceback (for bug reports).
_USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError)


def _reported(command: str, run) -> int:
    try:
        return int(run() or 0)
    except _USER_ERRORS as e:
        if os.environ.get("MMSPEC_TRACEBACK"):
            raise
        if isinstance(e, FileExistsError) and e.filename and not os.path.isdir(e.filename):
            # (os.makedirs(..., exist_ok=True) raises it only where a file holds a folder's name)
            raise SystemExit(f"mmspec {command}: {e.filename} is a file, not a folder; give the path of a folder "
                             f"to write into (created if missing)") from None
        raise SystemExit(f"mmspec {command}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
