"""VLM benchmark (`mmspec bench vlm`): plain greedy decoding against speculative decoding with
each drafter saved with a `SpeculativeVLMPipeline` (default: the bundled testbed VLM), on
captions and VQA of testbed validation scenes.

Per task (caption, vqa) and batch size it reports, per method (plain, transformers' own greedy
`generate` on the same model and processor outputs as the peer, then each drafter):
mean accepted length (tokens per target verify forward per row, bonus included), target
forwards, wall-clock seconds and the speed-up over plain decoding through the same pipeline
code (median over rounds; plain and speculative runs are interleaved chunk by chunk, so load
drift hits every method alike), whether every answer is identical to plain greedy, and the
in-run cost of a drafter step (drafter seconds per drafter call) and of a verify forward. It
also times the target's verify forward over Q tokens against its one-token forward at the same
context (`verify_cost`, batch B, after the image prompt), which bounds any speed-up: a method
pays cost(Q) / cost(1) per forward for its accepted length. `demo()` is the captioning
section of `mmspec demo` (the bundled sample scenes).

Limits: timings are of this machine and its load; run it on a quiet machine with fixed threads.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from mmspec.assets_dir import ASSETS
from mmspec.adaptive import summarize
from mmspec.cli_types import positive_int
from mmspec.bench.report import partial_saver, save
from mmspec.devices import check_device, device_name

# The bundled VLM, found from the installed package (the repository root holds assets/).
DEFAULT_MODEL = str(ASSETS / "testbed" / "vlm")
SAMPLE_SCENES = ASSETS / "testbed" / "images"
TASKS = ("caption", "vqa")


@dataclasses.dataclass(frozen=True)
class VLMBenchConfig:
    model: str = DEFAULT_MODEL
    num_scenes: int = 64
    batch_sizes: tuple[int, ...] = (1, 4)
    drafters: tuple[str, ...] = ()  # () = every drafter saved with the pipeline
    tasks: tuple[str, ...] = TASKS
    max_new_tokens: int = 40
    repeats: int = 2  # timed rounds (median); a short untimed warm-up round first
    warmup_scenes: int = 2
    threads: int | None = None
    seed: int = 0
    verify_widths: tuple[int, ...] = (1, 2, 4, 6, 8, 16)
    # (depth, top_k, num_nodes): also run every drafter with this dynamic tree ("<name>+tree");
    # num_nodes "auto": the tree's size chosen per request by measured speed
    tree: tuple[int, int, int | str] | None = None
    tree_drafters: tuple[str, ...] = ()  # () = every drafter benchmarked
    # also run these drafters with num_draft_tokens="auto" (K picked per step, "<name>+auto")
    auto_drafters: tuple[str, ...] = ()
    auto_max_draft_tokens: int = 6
    # also run these drafters with each of these fixed chain lengths ("<name>+k<K>"): how much the
    # saved K leaves on the table, measured in the same run
    draft_lengths: tuple[int, ...] = ()
    length_drafters: tuple[str, ...] = ()  # () = every drafter benchmarked
    generate: bool = True  # also time transformers' own greedy `generate` (row "generate", the peer)
    # Sampled answers (temperature > 0) with acceptance="invariant": every method answers exactly like
    # plain sampling for the same seeds, so rows stay comparable (other rules draw other answers).
    temperature: float = 0.0
    acceptance: str = "exact"
    device: str = "cpu"  # where the pipeline runs ("cuda": a GPU; timings synchronise the device)

    def __post_init__(self):
        if self.num_scenes < 1 or self.repeats < 1 or self.max_new_tokens < 1:
            raise ValueError("num_scenes, repeats and max_new_tokens must be >= 1")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes must be positive ints, got {self.batch_sizes}")
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ValueError(f"tasks must be a non-empty subset of {TASKS}, got {self.tasks}")
        if self.tree is not None:
            if len(self.tree) != 3 or not all(isinstance(v, int) and v >= 1 for v in self.tree[:2]):
                raise ValueError(f"tree must be (depth, top_k, num_nodes): ints >= 1, num_nodes also 'auto'; got "
                                 f"{self.tree}")
            from mmspec.types import TreeConfig

            TreeConfig(*self.tree)  # num_nodes: an int >= 1 that the tree can hold, or "auto"
        if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in self.draft_lengths):
            raise ValueError(f"draft_lengths must be ints >= 1, got {self.draft_lengths}")
        # a variant named twice would be registered (and timed) twice under one row name
        for field in ("drafters", "draft_lengths", "tree_drafters", "auto_drafters", "length_drafters"):
            values = getattr(self, field)
            if len(set(values)) != len(values):
                raise ValueError(f"{field} lists an entry twice: {values}")
        # a drafter list without its variant would be ignored
        if self.tree_drafters and self.tree is None:
            raise ValueError("tree_drafters (--tree-drafters) without tree (--tree DEPTH,TOP_K,NODES): pass both")
        if self.length_drafters and not self.draft_lengths:
            raise ValueError("length_drafters (--length-drafters) without draft_lengths (--draft-lengths K,...): pass both")
        check_device(self.device)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        from mmspec.acceptance import RULES, get_rule, is_position_keyed

        if self.acceptance not in RULES:  # refused after the weights loaded and measuring began before
            get_rule(self.acceptance)  # raises, naming the known rules

        if self.temperature > 0 and not is_position_keyed(self.acceptance):
            raise ValueError(f"temperature={self.temperature} with acceptance={self.acceptance!r}: the bench compares "
                             "methods on identical answers, which sampled decoding gives with acceptance='invariant' "
                             "only (pass --acceptance invariant)")
        if self.temperature > 0 and self.generate:
            raise ValueError("transformers' generate (the peer row) samples with its own random numbers: pass "
                             "--no-generate with --temperature > 0")
        if 1 not in self.verify_widths:
            raise ValueError("verify_widths must include 1 (the one-token forward every ratio is taken against)")


def load_pipeline(model: str):
    from mmspec.pipelines.vlm import SpeculativeVLMPipeline

    if not (Path(model) / "model_index.json").is_file():
        raise ValueError(f"no saved SpeculativeVLMPipeline at {model} (model_index.json missing); pass --model DIR "
                         "(made by `mmspec testbed train-vlm` or SpeculativeVLMPipeline.save_pretrained)")
    pipe = SpeculativeVLMPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)  # the bench reports its own progress
    return pipe


def auto_variant(pipe, name: str, max_draft_tokens: int) -> str:
    """Register `<name>+auto`: the saved drafter `name` (same weights) with the adaptive draft
    length (K in 0..max_draft_tokens chosen per step by the loop)."""
    return _variant(pipe, name, "auto", num_draft_tokens="auto", max_draft_tokens=max_draft_tokens)


def _variant(pipe, name: str, suffix: str, **changes) -> str:
    import inspect

    from mmspec.pipelines.vlm_drafter import DrafterComponent

    comp = pipe.drafters[name]
    params = inspect.signature(DrafterComponent.__init__).parameters
    kwargs = {k: v for k, v in comp.config.items() if k in params and k != "self"}
    kwargs.update(changes)
    variant = DrafterComponent(**kwargs)
    variant.load_state_dict(comp.state_dict())
    torch.nn.Module.to(variant, pipe.target.dtype)
    pipe.add_drafter(f"{name}+{suffix}", variant, active=False)
    return f"{name}+{suffix}"


def length_variant(pipe, name: str, k: int) -> str:
    """Register `<name>+k<K>`: the saved drafter `name` (same weights) drafting chains of K."""
    return _variant(pipe, name, f"k{k}", num_draft_tokens=k, max_draft_tokens=None, tree_depth=0, tree_top_k=0,
                    tree_num_nodes=0)


def tree_variant(pipe, name: str, tree: tuple[int, int, int]) -> str:
    """Register `<name>+tree`: the saved drafter `name` (same weights) drafting dynamic trees."""
    # a tree drafts tree_num_nodes nodes: the chain-length fields are reset (an "auto" drafter too)
    return _variant(pipe, name, "tree", tree_depth=tree[0], tree_top_k=tree[1], tree_num_nodes=tree[2],
                    num_draft_tokens=4, max_draft_tokens=None)


def task_items(scenes, task: str) -> tuple[list, list]:
    images = [s.image for s in scenes]
    return images, ([None] * len(scenes) if task == "caption" else [s.qa[0][0] for s in scenes])


GENERATE = "generate"  # transformers' own greedy `generate` on the same model and inputs (the peer)


def _run(pipe, method: str, images, prompts, B: int, cfg: VLMBenchConfig, seed: int):
    if method == GENERATE:
        return _run_generate(pipe, images, prompts, cfg.max_new_tokens)
    if method != "plain":
        pipe.load_drafter(method)
    t0 = time.perf_counter()
    out = pipe(images, prompts, max_new_tokens=cfg.max_new_tokens, speculative=method != "plain", batch_size=B,
               temperature=cfg.temperature, acceptance=cfg.acceptance, generator=torch.Generator().manual_seed(seed))
    return out, time.perf_counter() - t0


@torch.no_grad()
def _run_generate(pipe, images, prompts, max_new_tokens: int):
    """`model.generate(do_sample=False)` on the pipeline's own processor outputs (chat template,
    left padding, the same EOS / pad ids), timed like a pipeline call (preprocessing included).
    Returns an object with the pipeline output's `texts`, `sequences` (EOS kept, padding cut) and
    `stats` (no speculation: one target forward per token)."""
    from types import SimpleNamespace

    from mmspec.stats import SpecStats

    t0 = time.perf_counter()
    loaded = [pipe._load_images(img) for img in images]
    texts = [pipe._prompt(p, len(imgs)) for p, imgs in zip(prompts, loaded)]
    enc = pipe.processor(images=[i for imgs in loaded for i in imgs] or None, text=texts, return_tensors="pt",
                         padding=True, padding_side="left")
    dev = pipe.target.device
    enc = {k: (v.to(dev, pipe.target.dtype) if torch.is_floating_point(v) else v.to(dev)) for k, v in enc.items()}
    eos = pipe.target.generation_config.eos_token_id
    eos = pipe.processor.tokenizer.eos_token_id if eos is None else eos
    pad = pipe.processor.tokenizer.pad_token_id
    out = pipe.target.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                               pad_token_id=pad if pad is not None else 0)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    wall = time.perf_counter() - t0
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    seqs = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        seqs.append(torch.tensor(row[:end]))
    stats = SpecStats(new_tokens=[len(x) for x in seqs], target_calls=max(len(x) for x in seqs) - 1,
                      row_steps=sum(len(x) - 1 for x in seqs), emitted_tokens=sum(len(x) - 1 for x in seqs))
    decoded = [pipe.processor.tokenizer.decode(x, skip_special_tokens=True).strip() for x in seqs]
    return SimpleNamespace(texts=decoded, sequences=seqs, stats=stats), wall


def run_round(pipe, methods, images, prompts, B: int, cfg: VLMBenchConfig) -> dict:
    """Every method on every chunk of B items, interleaved chunk by chunk."""
    acc = {m: {"wall": 0.0, "texts": [], "seqs": [], "emitted": 0, "row_steps": 0, "target_calls": 0,
               "draft_s": 0.0, "draft_calls": 0, "verify_s": 0.0, "widths": []} for m in methods}
    for start in range(0, len(images), B):
        chunk = slice(start, start + B)
        for m in methods:
            out, wall = _run(pipe, m, images[chunk], prompts[chunk], B, cfg, cfg.seed + start)  # same seeds per chunk
            a, s = acc[m], out.stats
            a["wall"] += wall
            a["texts"] += out.texts
            a["seqs"] += [x.tolist() for x in out.sequences]
            a["emitted"] += s.emitted_tokens
            a["row_steps"] += s.row_steps
            a["target_calls"] += s.target_calls
            a["draft_s"] += s.draft_seconds
            a["draft_calls"] += s.draft_calls or 0
            a["verify_s"] += s.verify_seconds
            a["widths"] += list(getattr(s, "nodes_per_step", None) or [])
    return acc


@torch.no_grad()
def verify_cost(pipe, images, B: int, widths, calls: int = 20) -> dict:
    """Median seconds of one target verify forward over Q tokens at batch B right after the
    image + caption prompt, and its ratio to the one-token forward."""
    from mmspec.bench.widths import time_widths
    from mmspec.types import FeatureRequest

    imgs = [images[i % len(images)] for i in range(B)]
    enc = pipe.processor(images=imgs, text=[pipe._prompt(None, 1)] * B, return_tensors="pt", padding=True,
                         padding_side="left")
    params = pipe._spec_target.spec.forward_params
    dev = pipe.target.device
    inputs = {k: (v.to(dev, pipe.target.dtype) if torch.is_floating_point(v) else v.to(dev)) for k, v in enc.items()
              if k in params and k not in ("input_ids", "attention_mask")}
    target = pipe._spec_target
    target.prefill(enc["input_ids"].to(dev), enc["attention_mask"].to(dev), inputs, 8, max(widths), FeatureRequest())
    batches = {Q: torch.randint(5, target.vocab_size, (B, Q), generator=torch.Generator().manual_seed(Q)).to(dev)
               for Q in widths}
    # verify without commit leaves the cache as it was; warm calls per width (mmspec/bench/widths.py)
    return time_widths(lambda Q: target.verify(batches[Q], None), widths, rounds=calls, device=dev)


def run(cfg: VLMBenchConfig, progress=lambda m: None, checkpoint=None) -> dict:
    """The report; `checkpoint(report)`, if given, after each task and batch size (see `save`)."""
    from mmspec.testbed.world import World

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    pipe = load_pipeline(cfg.model)
    if cfg.device != "cpu":
        pipe.to(cfg.device)
    names = list(cfg.drafters) or sorted(pipe.drafters)
    unknown = [n for n in names if n not in pipe.drafters]
    if unknown:
        raise ValueError(f"drafters {unknown} are not saved with {cfg.model}; it has {sorted(pipe.drafters)}")
    methods = ["plain"] + ([GENERATE] if cfg.generate else []) + names
    for kind, chosen in (("tree", cfg.tree_drafters), ("auto", cfg.auto_drafters), ("length", cfg.length_drafters)):
        bad = [n for n in chosen if n not in names]
        if bad:
            raise ValueError(f"{kind} drafters {bad} are not among the benchmarked drafters {names}")
    # A FLASH head drafts chains of at most its slots: "every drafter" leaves out what it cannot
    # draft (naming it in --tree-drafters / --length-drafters is refused by the component).
    slots = {n: pipe.drafters[n].config.head_config["slots"] for n in names if pipe.drafters[n].config.kind == "flash"}
    if cfg.tree is not None:
        methods += [tree_variant(pipe, n, cfg.tree) for n in (cfg.tree_drafters or [n for n in names if n not in slots])]
    methods += [auto_variant(pipe, n, min(cfg.auto_max_draft_tokens, slots.get(n, cfg.auto_max_draft_tokens)))
                for n in cfg.auto_drafters]  # (a FLASH head: at most its slots)
    for n in (cfg.length_drafters or names) if cfg.draft_lengths else ():
        comp = pipe.drafters[n].config
        saved = None if comp.tree_depth else comp.num_draft_tokens  # a chain of the saved K is row <name>
        most = slots[n] if n in slots and not cfg.length_drafters else None
        methods += [length_variant(pipe, n, k) for k in cfg.draft_lengths if k != saved and (most is None or k <= most)]
    adaptive = {m for m in methods if m in pipe.drafters and (pipe.drafters[m].config.num_draft_tokens == "auto"
                                                              or pipe.drafters[m].config.tree_num_nodes == "auto")}
    from mmspec.testbed.vlm_eval import scene_size

    scenes = World(seed=cfg.seed, split="validation", image_size=scene_size(pipe.processor)).sample(cfg.num_scenes)
    t = pipe.target
    report = {"config": dataclasses.asdict(cfg), "model": {
        "target_parameters": sum(p.numel() for p in t.parameters()),
        "drafter_parameters": {n: sum(p.numel() for p in d.parameters()) for n, d in pipe.drafters.items()},
        "drafter_kinds": {n: d.config.kind for n, d in pipe.drafters.items()},
        "num_draft_tokens": {n: d.config.num_draft_tokens for n, d in pipe.drafters.items()},
        "trees": {n: ([d.config.tree_depth, d.config.tree_top_k, d.config.tree_num_nodes] if d.config.tree_depth
                      else None) for n, d in pipe.drafters.items()},
        "default_drafter": next((n for n, d in pipe.drafters.items() if d is pipe.drafter), None),
        "visual_tokens": getattr(t.config, "image_seq_length", None), "torch_threads": torch.get_num_threads(),
        "device": device_name(t.device),
    }, "runs": []}
    for B in cfg.batch_sizes:
        progress(f"batch {B}: verify cost")
        cost = verify_cost(pipe, [s.image for s in scenes], B, cfg.verify_widths)
        for task in cfg.tasks:
            images, prompts = task_items(scenes, task)
            run_round(pipe, methods, images[:cfg.warmup_scenes], prompts[:cfg.warmup_scenes], B, cfg)  # warm-up
            rounds = []
            for r in range(cfg.repeats):
                order = methods[r % len(methods):] + methods[:r % len(methods)]  # rotate who goes first
                rounds.append(run_round(pipe, order, images, prompts, B, cfg))
                progress(f"batch {B} {task}: round {r + 1}/{cfg.repeats} done")
            plain = statistics.median(x["plain"]["wall"] for x in rounds)
            peer = statistics.median(x[GENERATE]["wall"] for x in rounds) if GENERATE in methods else None
            rows = {}
            for m in methods:
                last = rounds[-1][m]
                wall = statistics.median(x[m]["wall"] for x in rounds)
                rows[m] = {
                    "wall_s": round(wall, 4), "speedup_vs_plain": round(plain / wall, 3),
                    "speedup_vs_generate": round(peer / wall, 3) if peer else None,
                    "mean_accepted_length": round(last["emitted"] / max(last["row_steps"], 1), 3),
                    "target_forwards": last["target_calls"],
                    "identical_to_plain": all(x[m]["seqs"] == x["plain"]["seqs"] for x in rounds),
                    "verify_ms_per_forward": round(1e3 * last["verify_s"] / max(last["target_calls"], 1), 3),
                    "drafter_ms_per_step": (round(1e3 * last["draft_s"] / last["draft_calls"], 3)
                                            if last["draft_calls"] else None),
                }
                if m in adaptive:  # what the adaptive drafter chose, over the timed rounds (tokens / nodes: steps)
                    rows[m]["drafted_per_step"] = summarize([w for x in rounds for w in x[m]["widths"]])
            report["runs"].append({"task": task, "batch_size": B, "scenes": len(images), "verify_cost": cost,
                                   "methods": rows, "sample": rounds[-1]["plain"]["texts"][:3]})
            if checkpoint is not None:
                checkpoint(report)
    return report


def _shape(model: dict, name: str) -> str:
    tree = model.get("trees", {}).get(name)
    if tree:
        nodes = "auto nodes (by measured speed)" if tree[2] == "auto" else f"{tree[2]} nodes"
        return f"tree depth {tree[0]} top-k {tree[1]} {nodes}"
    return f"K={model['num_draft_tokens'][name]}"


def format_table(report: dict) -> str:
    m = report["model"]
    lines = [f"VLM: target {m['target_parameters'] / 1e6:.2f}M params, {m['visual_tokens']} visual tokens, drafters "
             + ", ".join(f"{n} ({m['drafter_kinds'][n]}, {p / 1e6:.2f}M, {_shape(m, n)})"
                         for n, p in m["drafter_parameters"].items())
             + f"; default {m['default_drafter']}; threads {m['torch_threads']}; device {m.get('device', 'cpu')}"]
    c = report.get("config", {})
    if c.get("temperature", 0) > 0:
        lines[0] += (f"; sampled at temperature {c['temperature']} with acceptance={c['acceptance']!r} "
                     "('identical': the same answers as plain sampling for the seeds)")
    for r in report["runs"]:
        ratio = r["verify_cost"]["ratio_to_one_token"]
        lines.append(f"\n{r['task']}, batch {r['batch_size']}, {r['scenes']} scenes; verify cost / one-token forward: "
                     + ", ".join(f"Q={q}: {v}x" for q, v in ratio.items()))
        peer = any(x.get("speedup_vs_generate") for x in r["methods"].values())
        lines.append(f"{'method':<13}{'acc.len':>9}{'fwds':>7}{'wall s':>9}{'speed-up':>10}"
                     + (f"{'vs generate':>13}" if peer else "") + f"{'verify ms':>11}{'draft ms':>10}  identical")
        for name, x in r["methods"].items():
            d = "-" if x["drafter_ms_per_step"] is None else f"{x['drafter_ms_per_step']:.2f}"
            v = "-" if name == GENERATE else f"{x['verify_ms_per_forward']:.2f}"
            lines.append(f"{name:<13}{x['mean_accepted_length']:>9.2f}{x['target_forwards']:>7}{x['wall_s']:>9.2f}"
                         f"{x['speedup_vs_plain']:>9.2f}x"
                         + (f"{x['speedup_vs_generate']:>12.2f}x" if peer else "")
                         + f"{v:>11}{d:>10}  {'yes' if x['identical_to_plain'] else 'NO'}")
        for name, x in r["methods"].items():
            if x.get("drafted_per_step"):
                lines.append(f"  {name}: drafted per step (tokens or nodes: steps) {x['drafted_per_step']}")
    return "\n".join(lines)


def demo(model: str = DEFAULT_MODEL, *, scenes: int = 6, batch_sizes=(1, 4), max_new_tokens: int = 32,
         threads: int | None = 2, progress=lambda m: None) -> str:
    """The captioning section of `mmspec demo`: plain vs each drafter on the bundled sample
    scenes (one timed round, interleaved), then each scene's caption with its check."""
    from PIL import Image

    from mmspec.testbed.vlm_eval import caption_correct, scene_size

    if threads:
        torch.set_num_threads(threads)
    pipe = load_pipeline(model)
    records = json.loads((SAMPLE_SCENES / "scenes.json").read_text())[:scenes]
    images = [Image.open(SAMPLE_SCENES / r["image"]).convert("RGB") for r in records]
    size = scene_size(pipe.processor)
    if images and images[0].size != (size, size):  # the same scenes rendered at the size the model reads
        from mmspec.testbed.world import World

        world = World(seed=0, split="validation", image_size=size)
        images = [world.scene(r["index"]).image for r in records]
    prompts = [None] * len(images)
    methods = ["plain"] + sorted(pipe.drafters)
    default = next((n for n, d in pipe.drafters.items() if d is pipe.drafter), None)
    cfg = VLMBenchConfig(model=model, max_new_tokens=max_new_tokens)
    lines = [f"{len(images)} sample scenes, default drafter: {default}"]
    differ = set()  # methods whose answers differ from plain at some batch size
    for B in batch_sizes:
        run_round(pipe, methods, images[:1], prompts[:1], B, cfg)  # warm-up, untimed
        acc = run_round(pipe, methods, images, prompts, B, cfg)
        progress(f"captions at batch {B} done")
        plain = acc["plain"]["wall"]
        lines.append(f"\nbatch {B}: {'method':<8}{'acc.len':>9}{'wall s':>9}{'speed-up':>10}  identical to plain")
        for m in methods:
            a = acc[m]
            length = a["emitted"] / max(a["row_steps"], 1)
            same = a["seqs"] == acc["plain"]["seqs"]
            if not same:
                differ.add(m)
            lines.append(f"         {m:<8}{length:>9.2f}{a['wall']:>9.2f}{plain / a['wall']:>9.2f}x  "
                         f"{'yes' if same else 'NO'}")
    verdict = ("speculative ones are identical" if not differ else
               f"those of {', '.join(sorted(differ))} DIFFER (see the table)")
    lines.append(f"\ncaptions (plain greedy; {verdict}), checked against the scene:")
    for r, text in zip(records, acc["plain"]["texts"]):
        ok = caption_correct(text, r["attributes"])
        lines.append(f"  {r['image']}: {text}  [{'right' if ok else 'WRONG'}]")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`mmspec bench vlm [options]`."""
    import argparse

    def ints(text):
        return tuple(int(x) for x in text.split(",") if x.strip())

    def tree(text):  # DEPTH,TOP_K,NODES with NODES an int or "auto"
        parts = [x.strip() for x in text.split(",") if x.strip()]
        return tuple(int(x) for x in parts[:2]) + tuple(x if x == "auto" else int(x) for x in parts[2:])

    def names(text):
        return tuple(x for x in text.split(",") if x.strip())

    p = argparse.ArgumentParser(prog="mmspec bench vlm", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="saved SpeculativeVLMPipeline (default: bundled VLM)")
    p.add_argument("--num-scenes", type=int, default=64, help="validation scenes per task")
    p.add_argument("--batch-sizes", type=ints, default=(1, 4))
    p.add_argument("--drafters", type=names, default=(), help="comma-separated drafter names (default: all saved)")
    p.add_argument("--tasks", type=names, default=TASKS, help="caption,vqa")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2, help="timed rounds (median)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tree", type=tree, default=None,
                   help="DEPTH,TOP_K,NODES: also run every drafter with this dynamic tree (method <name>+tree); "
                        "NODES may be auto (the tree's size chosen per request by measured speed)")
    p.add_argument("--tree-drafters", type=names, default=(), help="drafters to run with --tree (default: all)")
    p.add_argument("--auto-drafters", type=names, default=(),
                   help="also run these drafters with the adaptive draft length (method <name>+auto)")
    p.add_argument("--auto-max-draft-tokens", type=int, default=6, help="largest K of the +auto variants (default 6)")
    p.add_argument("--draft-lengths", type=ints, default=(),
                   help="also run the drafters with each of these fixed chain lengths (method <name>+k<K>)")
    p.add_argument("--length-drafters", type=names, default=(),
                   help="drafters to run with --draft-lengths (default: all)")
    p.add_argument("--no-generate", action="store_true", help="do not time transformers' own generate beside plain")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: sampled answers (with --acceptance invariant and --no-generate; default 0 = greedy)")
    p.add_argument("--acceptance", default="exact", help="rule of every speculative row (default exact; "
                   "invariant for sampled answers that equal plain sampling's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the pipeline is moved there)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this path")
    a = p.parse_args(argv)
    try:
        config = VLMBenchConfig(model=a.model, num_scenes=a.num_scenes, batch_sizes=a.batch_sizes,
                                drafters=a.drafters, tasks=a.tasks, max_new_tokens=a.max_new_tokens,
                                repeats=a.repeats, threads=a.threads, seed=a.seed, tree=a.tree,
                                tree_drafters=a.tree_drafters, auto_drafters=a.auto_drafters,
                                auto_max_draft_tokens=a.auto_max_draft_tokens, draft_lengths=a.draft_lengths,
                                length_drafters=a.length_drafters, generate=not a.no_generate, device=a.device,
                                temperature=a.temperature, acceptance=a.acceptance)
        report = run(config, progress=lambda m: print(m, file=sys.stderr, flush=True), checkpoint=partial_saver(a.json))
    except ValueError as e:
        raise SystemExit(f"mmspec bench vlm: {e}") from None
    print(format_table(report))
    if a.json:
        save(report, a.json)
        print(f"wrote {a.json}")
    return 0
