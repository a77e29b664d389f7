"""`mmspec testbed ...`: data, sample assets, judge training, contact sheets.

    mmspec testbed data --out DIR --n 1000 --split train     PNGs + scenes.jsonl (captions, Q/A)
    mmspec testbed samples --out assets/testbed              16 sample scenes + JSON + tokenizer
    mmspec testbed train-judge --out assets/testbed/judge    the judge (class accuracy, Frechet)
    mmspec testbed eval-judge --model assets/testbed/judge   accuracy / Frechet on held-out scenes
    mmspec testbed train-vq / eval-vq                        the LlamaGen-architecture VQ
    mmspec testbed train-imagegen --out DIR                  8x8-token VQ + c2i GPT + drafter
    mmspec testbed contact-sheet --out sheet.png             scenes next to their VQ reconstructions
    mmspec testbed train-mar --out DIR                       the MAR pair (VAE, target, drafter)
    mmspec testbed train-vlm --out DIR                       the LLaVA testbed VLM + text / EAGLE / ViSpec drafters
    mmspec testbed caption-stats                             how multimodal the captions are

Options map one to one onto the fields of the config dataclasses they build.
"""

from __future__ import annotations

import argparse
import json
import os

from mmspec.cli_types import positive_int
from mmspec.testbed.judge_model import JUDGE_DIR


def cmd_data(args) -> int:
    from tqdm import tqdm

    from mmspec.testbed.world import World

    if args.n < 1:
        raise SystemExit(f"mmspec testbed data: --n must be >= 1 (scenes to render), got {args.n}")
    try:
        world = World(seed=args.seed, image_size=args.image_size, split=args.split)
    except ValueError as e:  # e.g. --image-size 0: a message, not a traceback
        raise SystemExit(f"mmspec testbed data: {e}") from None
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scenes.jsonl"), "w") as f:
        for i in tqdm(range(args.n), desc=f"render {args.split}"):
            scene = world.scene(i)
            scene.image.save(os.path.join(args.out, f"{args.split}_{i:06d}.png"))
            f.write(json.dumps({"image": f"{args.split}_{i:06d}.png", **scene.to_json()}) + "\n")
    print(f"wrote {args.n} scenes to {args.out}")
    return 0


def cmd_samples(args) -> int:
    from mmspec.testbed.language import build_tokenizer
    from mmspec.testbed.world import World

    if args.n < 1:  # wrote an empty scenes.json and reported "wrote 0 sample scenes"
        raise SystemExit(f"mmspec testbed samples: --n must be >= 1, got {args.n}")
    img_dir = os.path.join(args.out, "images")
    os.makedirs(img_dir, exist_ok=True)
    scenes = World(seed=0, split="validation").sample(args.n)
    records = []
    for s in scenes:
        name = f"scene_{s.index:02d}.png"
        s.image.save(os.path.join(img_dir, name))
        records.append({"image": name, **s.to_json()})
    with open(os.path.join(img_dir, "scenes.json"), "w") as f:
        json.dump(records, f, indent=1)
    build_tokenizer().save_pretrained(os.path.join(args.out, "tokenizer"))
    print(f"wrote {len(records)} sample scenes to {img_dir} and the tokenizer to {args.out}/tokenizer")
    return 0


def cmd_train_judge(args) -> int:
    from mmspec.testbed.judge_model import JudgeTrainConfig, train_judge

    try:
        config = JudgeTrainConfig(train_scenes=args.train_scenes, val_scenes=args.val_scenes, steps=args.steps,
                                  batch_size=args.batch_size, lr=args.lr, seed=args.seed, threads=args.threads)
    except ValueError as e:
        raise SystemExit(f"mmspec testbed train-judge: {e}") from None
    _, metrics = train_judge(config, args.out)
    print(json.dumps(metrics, indent=2))
    return 0


def cmd_eval_judge(args) -> int:
    from mmspec.testbed.judge_model import Judge
    from mmspec.testbed.world import World

    if args.n < 2:
        raise SystemExit(f"mmspec testbed eval-judge: --n must be >= 2 (the Frechet distance needs a covariance), got {args.n}")
    judge = Judge.from_pretrained(args.model)
    scenes = World(seed=0, split="test").sample(args.n)
    print(json.dumps(judge.score([s.image for s in scenes], [s.class_label for s in scenes]), indent=2))
    return 0


def cmd_caption_stats(args) -> int:
    """How multimodal the caption distribution is: distinct captions and empirical entropy
    (bits) of `--captions` samples per scene, averaged over `--n` validation scenes."""
    import dataclasses
    import math
    from collections import Counter

    from mmspec.testbed.world import World, WorldConfig

    if args.n < 1 or args.captions < 1:
        raise SystemExit(f"mmspec testbed caption-stats: --n and --captions must be >= 1, got {args.n} and {args.captions}")
    config = dataclasses.replace(WorldConfig(), captions_per_scene=args.captions)
    scenes = World(seed=0, split="validation", config=config).sample(args.n)
    distinct, entropy = [], []
    for s in scenes:
        counts = Counter(s.captions)
        distinct.append(len(counts))
        entropy.append(-sum(c / args.captions * math.log2(c / args.captions) for c in counts.values()))
    default = World(seed=0, split="validation").sample(args.n)
    result = {
        "scenes": args.n,
        "distinct_of_default_5": sum(len(set(s.captions)) for s in default) / args.n,
        f"distinct_of_{args.captions}": sum(distinct) / args.n,
        f"entropy_bits_of_{args.captions}": sum(entropy) / args.n,
    }
    print(json.dumps(result, indent=2))
    return 0


def cmd_contact_sheet(args) -> int:
    import torch
    from PIL import Image, ImageDraw

    from mmspec.models import LlamaGenVQ
    from mmspec.testbed.judge_model import to_pixels
    from mmspec.testbed.vq_train import psnr as psnr_db
    from mmspec.testbed.world import World

    if args.n < 1:
        raise SystemExit(f"mmspec testbed contact-sheet: --n must be >= 1, got {args.n}")

    vq = LlamaGenVQ.from_pretrained(args.vq).eval()
    scenes = World(seed=0, split="validation").sample(args.n)
    pixels = to_pixels([s.image for s in scenes])
    with torch.no_grad():
        recon = vq.decode(vq.encode(pixels)).clamp(-1, 1)
    psnr = psnr_db(recon, pixels).tolist()
    size, scale, cols = pixels.shape[-1], 2, 8
    cell = size * scale
    rows = (args.n + cols - 1) // cols
    sheet = Image.new("RGB", (cols * cell, rows * (2 * cell + 14)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    as_img = lambda t: Image.fromarray(((t.permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).byte().numpy())
    for i in range(args.n):
        x, y = (i % cols) * cell, (i // cols) * (2 * cell + 14)
        sheet.paste(scenes[i].image.resize((cell, cell), Image.NEAREST), (x, y))
        sheet.paste(as_img(recon[i]).resize((cell, cell), Image.NEAREST), (x, y + cell))
        draw.text((x + 2, y + 2 * cell), f"{psnr[i]:.1f} dB", fill=(0, 0, 0))
    sheet.save(args.out)
    print(f"wrote {args.out}: top = scene, bottom = VQ reconstruction; mean PSNR {sum(psnr) / len(psnr):.2f} dB")
    return 0


def add_subparsers(subparsers) -> None:
    """Register `testbed` and its sub-commands on the `mmspec` parser."""
    tb = subparsers.add_parser("testbed", help="the procedural world, VQ tokenizer and judge")
    sub = tb.add_subparsers(dest="testbed_command", required=True)
    p = sub.add_parser("data", help="render scenes to PNG + scenes.jsonl")
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--split", choices=["train", "validation", "test"], default="train")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=64)
    p.set_defaults(func=cmd_data)
    p = sub.add_parser("samples", help="write the bundled sample scenes and the tokenizer")
    p.add_argument("--out", default="assets/testbed")
    p.add_argument("--n", type=int, default=16)
    p.set_defaults(func=cmd_samples)
    p = sub.add_parser("train-judge", help="train the judge (CPU, a few minutes)")
    p.add_argument("--out", default=str(JUDGE_DIR))
    p.add_argument("--train-scenes", type=int, default=10000)
    p.add_argument("--val-scenes", type=int, default=2000)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1)
    p.set_defaults(func=cmd_train_judge)
    p = sub.add_parser("eval-judge", help="judge accuracy and Frechet distance on held-out scenes")
    p.add_argument("--model", default=str(JUDGE_DIR))
    p.add_argument("--n", type=int, default=1000)
    p.set_defaults(func=cmd_eval_judge)
    p = sub.add_parser("caption-stats", help="distinct captions and caption entropy per scene")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--captions", type=int, default=32)
    p.set_defaults(func=cmd_caption_stats)
    p = sub.add_parser("contact-sheet", help="PNG of validation scenes above their VQ reconstructions")
    p.add_argument("--out", default="assets/testbed/contact_sheet.png")
    p.add_argument("--vq", default=os.path.join(os.path.dirname(JUDGE_DIR), "vq"),
                   help="VQ folder (default: the bundled one)")
    p.add_argument("--n", type=int, default=16)
    p.set_defaults(func=cmd_contact_sheet)
    from mmspec.testbed.mar_train import add_mar_command

    add_mar_command(sub)

    from mmspec.testbed.imagegen_train import add_imagegen_command

    add_imagegen_command(sub)

    from mmspec.testbed.vlm_train import add_vlm_command

    add_vlm_command(sub)

    from mmspec.testbed.vlm_compare import add_compare_command

    add_compare_command(sub)
    from mmspec.testbed.vq_train import add_vq_commands

    add_vq_commands(sub)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmspec.testbed.commands")
    add_subparsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
