"""Image-generation benchmark (`mmspec bench imagegen`): plain AR decoding against speculative
decoding with every drafter and rule, on a `SpeculativeARImagePipeline` folder (default: the
bundled testbed generator).

For each batch size it runs every method on the same class labels and seeds, in rounds whose
methods take turns chunk by chunk (every method decodes a batch of B labels before the next
batch starts: a slow phase of the machine hits them alike) (plain, exact with the small-model
drafter, exact with coupled / Gumbel-coupled / uncoupled Jacobi drafts, LANTERN and GSD with
each drafter, drafter-invariant sampling), and reports target forwards
per image (prefill included; `calls`: target forwards of the batched calls, which wait for their
slowest row), mean accepted length, images per second and the wall-clock
speed-up over plain decoding through the same target code (median over rounds). It also
times the target's verify forward over Q tokens against its one-token forward at the same
context (`verify_cost`), which is what bounds any speed-up: a method pays
cost(Q) / cost(1) per forward for its accepted length. With `judge_images > 0` the testbed
judge scores plain and lossy-rule images (class accuracy, Frechet distance).

Limits: timings are of this machine and its load; run under the CPU lock with fixed threads.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from mmspec.assets_dir import ASSETS
from mmspec.adaptive import summarize
from mmspec.bench.core import williams_rows
from mmspec.bench.report import save
from mmspec.devices import check_device, device_name
from mmspec.models.llamagen_spec import llamagen_target
from mmspec.testbed.judge_model import JUDGE_DIR

# The bundled generator, found from the installed package (the repository root holds assets/),
# so `mmspec demo` / `mmspec generate` work from any working directory.
DEFAULT_MODEL = str(ASSETS / "testbed" / "imagegen")


@dataclasses.dataclass(frozen=True)
class ImageBenchConfig:
    model: str = DEFAULT_MODEL
    batch_sizes: tuple[int, ...] = (1, 8)
    images: int = 8  # images per method and batch size in each round
    repeats: int = 3  # timed rounds (median); one untimed warm-up round first
    guidance_scale: float | None = None  # None: the generator's default (its metrics.json), else 4.0
    temperature: float = 1.0
    top_k: int | None = None
    draft_tokens: tuple[int, ...] = (4, 3)  # small-model drafter K per batch size
    window: tuple[int, ...] = (16, 8)  # Jacobi window per batch size (16: fewest forwards at batch 1 on the testbed generator)
    methods: tuple[str, ...] = ()  # () = all
    seed: int = 0
    threads: int | None = 2
    judge_images: int = 0  # > 0: judge plain vs lossy rules on this many images each
    judge_dir: str = str(JUDGE_DIR)
    device: str = "cpu"  # where the pipeline runs ("cuda": a GPU; timings synchronise the device)

    def __post_init__(self):
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes must be positive ints, got {self.batch_sizes}")
        check_device(self.device)
        for name in ("draft_tokens", "window"):
            values = getattr(self, name)
            if len(values) not in (1, len(self.batch_sizes)):
                raise ValueError(f"{name} needs one value or one per batch size, got {values}")
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be ints >= 1, got {values}")  # found after the loading before
        if self.images < 1 or self.repeats < 1:
            raise ValueError("images and repeats must be >= 1")
        if self.judge_images == 1 or self.judge_images < 0:  # found after every timed run before
            raise ValueError(f"judge_images must be 0 (no judge) or >= 2 (a Frechet distance needs a covariance), "
                             f"got {self.judge_images}")
        for m in self.methods:
            method_spec(m)  # ValueError naming an unknown method
        # found after the model had loaded and the verify cost was being measured before
        from mmspec.models.llamagen_sample import check_guidance_scale
        from mmspec.sampling import SamplingConfig

        SamplingConfig(temperature=self.temperature)
        if self.guidance_scale is not None:
            check_guidance_scale(self.guidance_scale)

    def per_batch(self, name: str, i: int) -> int:
        values = getattr(self, name)
        return values[i] if len(values) > 1 else values[0]


# name -> (drafter kind, coupling, acceptance)
METHODS = {
    "plain": ("plain", None, "exact"),
    "exact/model": ("model", None, "exact"),
    "exact/jacobi-maximal": ("jacobi", "maximal", "exact"),
    "exact/jacobi-gumbel": ("jacobi", "gumbel", "exact"),
    "exact/jacobi-uncoupled": ("jacobi", None, "exact"),
    "lantern/model": ("model", None, "lantern"),
    "lantern/jacobi-maximal": ("jacobi", "maximal", "lantern"),
    "lantern/jacobi-gumbel": ("jacobi", "gumbel", "lantern"),
    "gsd/model": ("model", None, "gsd"),
    "gsd/jacobi-maximal": ("jacobi", "maximal", "gsd"),
    # acceptance="invariant": Gumbel-max sampling with noise keyed by position, so every
    # invariant row emits the same tokens as "invariant/plain" for a seed (checked per round).
    "invariant/plain": ("plain", None, "invariant"),
    "invariant/model": ("model", None, "invariant"),
    "invariant/jacobi-gumbel": ("jacobi", "gumbel", "invariant"),
}
LOSSLESS = ("exact", "invariant")
# Also run by default: Jacobi methods with a fixed window ("@W" overrides the per-batch window),
# so that the window is chosen from measurements of the same run.
# "@auto": the window chosen per request by measurement (JacobiDrafter(window="auto"), up to 16 or
# the batch's window if larger); one drafter per method for the whole run, as a user keeps
# `pipe.drafter` across calls; the untimed round 0 lasts until its warm-up is over.
# "exact/model@auto": the small-model drafter with num_draft_tokens="auto" (K chosen before
# every step, K = 0 plain).
WINDOW_METHODS = ("exact/jacobi-maximal@8", "exact/jacobi-gumbel@8", "gsd/jacobi-maximal@8",
                  "exact/jacobi-gumbel@auto", "lantern/jacobi-maximal@auto", "lantern/jacobi-gumbel@auto",
                  "exact/model@auto", "invariant/jacobi-gumbel@auto")
# A method name ending in STOCK runs on stock linear kernels (`pipe.prepack = False`); the others on
# the kernels measured faster on this machine per row count (`"auto"`, the pipeline's default):
# these rows show what the measured choice gains, and that it never loses.
STOCK = " [stock]"
STOCK_METHODS = ("plain" + STOCK, "exact/jacobi-maximal" + STOCK)


def method_spec(name: str) -> tuple[str, str | None, str, int | str | None]:
    """"exact/jacobi-maximal@8" -> ("jacobi", "maximal", "exact", 8); "@auto" -> window "auto";
    no "@W": window None; a trailing " [stock]" (stock kernels) does not change the spec."""
    base, _, window = name.removesuffix(STOCK).partition("@")
    if base not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {list(METHODS)} (Jacobi ones may end in @WINDOW or @auto)")
    kind, coupling, acceptance = METHODS[base]
    if not window:
        return kind, coupling, acceptance, None
    if kind in ("jacobi", "model") and window == "auto":
        return kind, coupling, acceptance, "auto"
    if kind != "jacobi" or not window.isdigit() or int(window) < 1:
        raise ValueError(f"method {name!r}: only Jacobi methods take @WINDOW (a positive int), Jacobi and model "
                         "methods @auto")
    return kind, coupling, acceptance, int(window)


def load_pipeline(model: str):
    from mmspec.pipelines import SpeculativeARImagePipeline

    pipe = SpeculativeARImagePipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def default_guidance(model: str) -> float:
    metrics = Path(model) / "metrics.json"
    if metrics.is_file():
        default = json.loads(metrics.read_text()).get("eval", {}).get("default", {})
        if "guidance_scale" in default:
            return float(default["guidance_scale"])
    return 4.0


def _auto_drafters(pipe) -> dict:
    """(method[, "K"]) -> what a bench method keeps across its calls (a JacobiDrafter(window="auto"),
    draft-length controllers), held on the pipeline itself: a module dict keyed by id(pipe) kept
    every run's drafters alive and could hand them to a later pipeline at the same address."""
    return pipe.__dict__.setdefault("_bench_auto_drafters", {})


def _set_drafter(pipe, gpt_drafter, kind: str, coupling, K: int, W: int, window: int | str | None = None,
                 method: str | None = None) -> None:
    from mmspec.drafters import JacobiDrafter

    settings = dict(pipe.config.drafter_config)
    if kind == "model":
        if gpt_drafter is None:
            raise ValueError("this pipeline has no drafter model; run the jacobi methods only (--methods)")
        pipe.drafter = gpt_drafter
        settings["num_draft_tokens"] = "auto" if window == "auto" else K
        # K = "auto": the pipeline keeps what the controller learnt across calls; one controller
        # set per bench method, so that rows with different rules do not share acceptance estimates.
        pipe.__dict__["_draft_length_controllers"] = _auto_drafters(pipe).setdefault((method, "K"), {})
    elif kind == "jacobi" and window == "auto":
        kept = _auto_drafters(pipe)
        if method not in kept:
            kept[method] = JacobiDrafter("auto", coupling, max_window=max(W, 16))
        pipe.drafter = kept[method]
    elif kind == "jacobi":
        pipe.drafter = JacobiDrafter(window or W, coupling)
    pipe.register_to_config(drafter_config=settings)


def run_method(pipe, labels: list[int], B: int, method: str, cfg: ImageBenchConfig, scale: float, seed: int) -> dict:
    kind, _, acceptance, _ = method_spec(method)
    gen = torch.Generator().manual_seed(seed)
    forwards, emitted, row_steps, calls, tokens, widths = 0.0, 0, 0, 0, [], []
    t0 = time.perf_counter()
    for i in range(0, len(labels), B):
        out = pipe(labels[i:i + B], guidance_scale=scale, temperature=cfg.temperature, top_k=cfg.top_k,
                   acceptance=acceptance, speculative=kind != "plain", generator=gen, output_type="latent")
        s = out.stats
        forwards += s.target_forwards_per_image * s.images
        emitted += s.emitted_tokens
        row_steps += s.row_steps
        calls += s.target_calls + s.prefill_calls
        widths += list(getattr(s, "nodes_per_step", []))
        tokens.append(out.tokens)
    if tokens[-1].is_cuda:
        torch.cuda.synchronize(tokens[-1].device)  # the host clock times the device's work
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "forwards_per_image": forwards / len(labels), "batch_forwards": calls,
            "mean_accepted_length": emitted / row_steps if row_steps else 1.0, "tokens": torch.cat(tokens),
            "drafted_per_step": widths, "images": len(labels), "emitted": emitted, "row_steps": row_steps}


def merge_runs(parts: list[dict]) -> dict:
    """One method's chunks of a round (`run_method` results, in label order) as one result."""
    images, emitted, row_steps = (sum(p[k] for p in parts) for k in ("images", "emitted", "row_steps"))
    return {"wall_s": sum(p["wall_s"] for p in parts),
            "forwards_per_image": sum(p["forwards_per_image"] * p["images"] for p in parts) / images,
            "batch_forwards": sum(p["batch_forwards"] for p in parts),
            "mean_accepted_length": emitted / row_steps if row_steps else 1.0,
            "tokens": torch.cat([p["tokens"] for p in parts]),
            "drafted_per_step": [w for p in parts for w in p["drafted_per_step"]],
            "images": images, "emitted": emitted, "row_steps": row_steps}


@torch.no_grad()
def verify_cost(pipe, B: int, scale: float, widths=(1, 2, 4, 5, 8, 9, 16, 17), context: int = 32, calls: int = 20) -> dict:
    """Median seconds of one target verify forward over Q tokens at `context` committed image
    tokens, batch B (CFG doubles the rows), and its ratio to the one-token forward (on the
    pipeline's kernels, `pipe.prepack`)."""
    from mmspec.bench.widths import time_widths
    from mmspec.types import CommitInfo

    T = pipe.num_tokens
    target = llamagen_target(pipe.target, scale, num_tokens=T, prepack=pipe.prepack)
    dev = next(pipe.target.parameters()).device
    labels = (torch.arange(B) % pipe.num_classes).view(B, 1).to(dev)
    target.prefill(labels, torch.ones_like(labels), {}, T, max(widths))
    tok = torch.zeros(B, dtype=torch.long, device=dev)
    for _ in range(min(context, T - 1)):
        target.verify(tok.view(B, 1), None)
        target.commit(CommitInfo(path=torch.zeros(B, 1, dtype=torch.long, device=dev),
                                 num_accepted=torch.zeros(B, dtype=torch.long, device=dev),
                                 accepted_tokens=torch.zeros(B, 0, dtype=torch.long, device=dev), next_tokens=tok,
                                 num_accepted_list=[0] * B))
    batches = {Q: torch.randint(pipe.target.args.vocab_size, (B, Q), generator=torch.Generator().manual_seed(Q)).to(dev)
               for Q in widths}
    # verify without commit leaves the cache as it was; warm calls per width (mmspec/bench/widths.py)
    return time_widths(lambda Q: target.verify(batches[Q], None), widths, rounds=calls, device=dev)


def check_judge(pipe, judge_dir: str) -> None:
    """The judge scores testbed-world images of its own size and classes: refuse another
    generator before the timed runs (it was scored, or refused, only after all of them)."""
    from mmspec.testbed.judge_model import check_judge_fits

    check_judge_fits(judge_dir, pipe.num_classes, pipe.vq.token_grid * pipe.vq.vq_config.downsample,
                     "this generator", "use judge_images=0 / drop --judge-images")


def judge_quality(pipe, cfg: ImageBenchConfig, scale: float, methods: list[str], progress) -> dict:
    from mmspec.testbed.judge_model import Judge

    judge = Judge.from_pretrained(cfg.judge_dir)
    labels = [i % pipe.num_classes for i in range(cfg.judge_images)]
    out = {}
    for method in methods:
        kind, coupling, acceptance, window = method_spec(method)
        # The settings of the first batch size's speed rows (an "@W" window overrides it).
        _set_drafter(pipe, _drafter_model(pipe), kind, coupling, cfg.per_batch("draft_tokens", 0),
                     cfg.per_batch("window", 0), window, method=method)
        gen = torch.Generator().manual_seed(cfg.seed + 7)
        pixels = []
        for i in range(0, len(labels), 32):
            o = pipe(labels[i:i + 32], guidance_scale=scale, temperature=cfg.temperature, top_k=cfg.top_k,
                     acceptance=acceptance, speculative=kind != "plain", generator=gen, output_type="pt")
            pixels.append((o.images * 2 - 1).cpu())  # the judge runs on the CPU
        out[method] = {k: round(v, 4) for k, v in judge.score(torch.cat(pixels), torch.tensor(labels)).items()}
        progress(f"judge {method}: {out[method]}")
    return out


def _drafter_model(pipe):
    return pipe.__dict__.get("_bench_drafter_model")  # (on the pipeline: see _auto_drafters)


def run(cfg: ImageBenchConfig, progress=lambda m: None, checkpoint=None) -> dict:
    """The report; `checkpoint(report)`, if given, after each batch size (see `save`)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    pipe = load_pipeline(cfg.model)
    if cfg.judge_images > 0:
        check_judge(pipe, cfg.judge_dir)
    gpt_drafter = _drafter_model_of(pipe)
    if cfg.device != "cpu":
        pipe.to(cfg.device)
        if gpt_drafter is not None:  # kept beside the pipeline while a Jacobi drafter is active
            gpt_drafter.to(cfg.device)
    pipe.__dict__["_bench_drafter_model"] = gpt_drafter
    scale = cfg.guidance_scale if cfg.guidance_scale is not None else default_guidance(cfg.model)
    methods = list(cfg.methods) or [m for m in (*METHODS, *WINDOW_METHODS, *STOCK_METHODS)
                                     if gpt_drafter is not None or method_spec(m)[0] != "model"]
    if "plain" not in methods:
        methods.insert(0, "plain")
    report = {"config": {**dataclasses.asdict(cfg), "guidance_scale": scale}, "model": {
        "target_parameters": sum(p.numel() for p in pipe.target.parameters()),
        "drafter_parameters": None if gpt_drafter is None else sum(p.numel() for p in gpt_drafter.parameters()),
        "image_tokens": pipe.num_tokens, "codebook": pipe.target.args.vocab_size, "torch_threads": torch.get_num_threads(),
        "kernels": llamagen_target(pipe.target, scale).kernels,  # measured here, once per model
        "device": device_name(cfg.device),
        "method_order": "balanced",  # Williams rows, chunks alternating direction (session 52; "rotated" before)
    }, "batches": []}
    labels = [i % pipe.num_classes for i in range(cfg.images)]
    for bi, B in enumerate(cfg.batch_sizes):
        K, W = cfg.per_batch("draft_tokens", bi), cfg.per_batch("window", bi)
        progress(f"batch {B}: verify cost")
        entry = {"batch_size": B, "draft_tokens": K, "window": W, "verify_cost": verify_cost(pipe, B, scale)}
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for r in range(cfg.repeats + 1):  # round 0 warms up
            # Every method runs each chunk of B labels (same seed) before the next chunk starts, so
            # a slow phase of the machine (seconds long on our VMs) hits every method alike. Round
            # r runs row r of a Williams design (`williams_rows`, since session 52; before, each
            # round started at the next method of a fixed cycle, so a method always followed the
            # same one): every method follows every other equally often over a cycle of rows, and
            # the order reverses chunk by chunk, so no method keeps one position (the first call of
            # a round ran measurably slower on our VM).
            rows = williams_rows(len(methods))
            order = [methods[i] for i in rows[r % len(rows)]]
            parts: dict[str, list[dict]] = {m: [] for m in methods}
            for c, start in enumerate(range(0, len(labels), B)):
                for m in order if c % 2 == 0 else order[::-1]:
                    kind, coupling, _, window = method_spec(m)
                    _set_drafter(pipe, gpt_drafter, kind, coupling, K, W, window, method=m)
                    pipe.prepack = False if m.endswith(STOCK) else "auto"
                    parts[m].append(run_method(pipe, labels[start:start + B], B, m, cfg, scale,
                                               (cfg.seed + r) * 1_000_003 + start))
            for m in methods:
                kind, coupling, _, window = method_spec(m)
                if r > 0:
                    runs[m].append(merge_runs(parts[m]))
                elif window == "auto" and kind == "jacobi":
                    # The untimed round also covers the bandit's warm-up at this batch size (a
                    # one-off per process, like the kernel measurement), so the timed rounds show
                    # its steady state; at batch 8 with 8 images a round is a single request.
                    _set_drafter(pipe, gpt_drafter, kind, coupling, K, W, window, method=m)
                    pipe.prepack = "auto"
                    bandit = pipe.drafter.controller
                    for extra in range(16):
                        if bandit.warmed_up(B):
                            break
                        run_method(pipe, labels, B, m, cfg, scale, cfg.seed + 1000 + extra)
            pipe.prepack = "auto"
            progress(f"batch {B}: round {r}/{cfg.repeats} done")
        plain_wall = statistics.median(x["wall_s"] for x in runs["plain"])
        rows = {}
        for m in methods:
            wall = statistics.median(x["wall_s"] for x in runs[m])
            rows[m] = {
                "wall_s": round(wall, 4), "images_per_s": round(cfg.images / wall, 3),
                "speedup_vs_plain": round(plain_wall / wall, 3),
                "forwards_per_image": round(statistics.mean(x["forwards_per_image"] for x in runs[m]), 3),
                "batch_forwards": statistics.mean(x["batch_forwards"] for x in runs[m]),
                "mean_accepted_length": round(statistics.mean(x["mean_accepted_length"] for x in runs[m]), 3),
                "lossless": method_spec(m)[2] in LOSSLESS,
                "window": (method_spec(m)[3] or W) if method_spec(m)[0] == "jacobi" else None,
            }
            # The same ratio round by round (plain and the method timed in the same round): how
            # far one round's figure moves on this machine.
            paired = sorted(p["wall_s"] / x["wall_s"] for p, x in zip(runs["plain"], runs[m]))
            rows[m]["speedup_rounds_min_max"] = [round(paired[0], 3), round(paired[-1], 3)]
            if method_spec(m)[2] == "invariant" and "invariant/plain" in runs and m != "invariant/plain":  # same tokens?
                rows[m]["identical_to_invariant_plain"] = all(
                    torch.equal(x["tokens"], p["tokens"]) for x, p in zip(runs[m], runs["invariant/plain"]))
            if method_spec(m)[3] == "auto":  # what the controller chose over the timed rounds (per step)
                key = "windows_chosen" if method_spec(m)[0] == "jacobi" else "draft_lengths_chosen"
                rows[m][key] = summarize([k for x in runs[m] for k in x["drafted_per_step"]])
        entry["methods"] = rows
        report["batches"].append(entry)
        # Each batch size's figures as soon as they exist (a run cut short by a time limit keeps them).
        if checkpoint is not None:
            checkpoint(report)
        progress(f"batch {B}: speed-up vs plain " + ", ".join(f"{m} {rows[m]['speedup_vs_plain']:.2f}x" for m in methods))
    if cfg.judge_images > 0:
        lossy = [m for m in methods if method_spec(m)[2] not in LOSSLESS]
        report["judge"] = judge_quality(pipe, cfg, scale, ["plain"] + lossy, progress)
    return report


def format_table(report: dict) -> str:
    lines = []
    m = report["model"]
    d = m["drafter_parameters"]
    drafter = "-" if d is None else f"{d / 1e6:.2f}M"
    lines.append(f"image generation: target {m['target_parameters'] / 1e6:.2f}M params, drafter {drafter}, "
                 f"{m['image_tokens']} tokens/image, codebook {m['codebook']}, guidance "
                 f"{report['config']['guidance_scale']}, threads {m['torch_threads']}, device {m.get('device', 'cpu')}")
    if m.get("kernels"):
        lines.append(f"target kernels (measured on this machine; rows '{STOCK.strip()}': stock kernels): {m['kernels']}")
    for e in report["batches"]:
        ratio = e["verify_cost"]["ratio_to_one_token"]
        lines.append(f"\nbatch {e['batch_size']} (model drafter K={e['draft_tokens']}, Jacobi window {e['window']}); "
                     "verify cost / one-token forward: " + ", ".join(f"Q={q}: {r}x" for q, r in ratio.items()))
        lines.append(f"{'method':<26}{'fwd/image':>10}{'calls':>7}{'acc.len':>9}{'img/s':>9}{'speed-up':>10}"
                     f"{'rounds':>12}  lossless")
        for name, r in e["methods"].items():
            lo, hi = r.get("speedup_rounds_min_max", (r["speedup_vs_plain"],) * 2)
            lines.append(f"{name:<26}{r['forwards_per_image']:>10.2f}{r['batch_forwards']:>7.0f}{r['mean_accepted_length']:>9.2f}"
                         f"{r['images_per_s']:>9.2f}{r['speedup_vs_plain']:>9.2f}x{lo:>6.2f}-{hi:<5.2f}"
                         f"  {'yes' if r['lossless'] else 'no'}"
                         + {True: ", same tokens as invariant/plain", False: ", TOKENS DIFFER from invariant/plain",
                            None: ""}[r.get("identical_to_invariant_plain")])
        for name, r in e["methods"].items():
            if r.get("windows_chosen"):
                lines.append(f"  {name}: windows chosen (window: steps) {r['windows_chosen']}")
            if r.get("draft_lengths_chosen"):
                lines.append(f"  {name}: draft lengths chosen (K: steps) {r['draft_lengths_chosen']}")
    if "judge" in report:
        lines.append("\njudge (class accuracy, Frechet):")
        for name, s in report["judge"].items():
            lines.append(f"  {name:<26} accuracy {s['accuracy']:.3f}  frechet {s['frechet']:.3f}")
    return "\n".join(lines)


DEMO_METHODS = ("plain", "exact/model", "exact/jacobi-maximal", "lantern/model", "gsd/jacobi-maximal",
                "invariant/plain", "invariant/jacobi-gumbel")  # the last two: the same images for a seed


def demo(model: str, out_dir: str, progress=lambda m: None, threads: int = 2) -> str:
    """The image section of `mmspec demo`: one timed round of plain vs speculative decoding (exact
    with each drafter, LANTERN, GSD) at batch 1 and 8 on the same labels and seeds, and a grid PNG
    (one row per method, same seed) in `out_dir`. Returns the table text."""
    from PIL import Image, ImageDraw

    has_model = _drafter_model_of(load_pipeline(model)) is not None
    methods = tuple(m for m in DEMO_METHODS if has_model or method_spec(m)[0] != "model")
    cfg = ImageBenchConfig(model=model, images=8, repeats=1, methods=methods, threads=threads)
    report = run(cfg, progress)
    pipe = load_pipeline(model)
    gpt_drafter = _drafter_model_of(pipe)
    scale = report["config"]["guidance_scale"]
    labels = [i % pipe.num_classes for i in range(8)]
    rows = []
    for m in methods:
        kind, coupling, acceptance, window = method_spec(m)
        _set_drafter(pipe, gpt_drafter, kind, coupling, cfg.per_batch("draft_tokens", 1), cfg.per_batch("window", 1),
                     window, method=m)
        out = pipe(labels, guidance_scale=scale, acceptance=acceptance, speculative=kind != "plain",
                   generator=torch.Generator().manual_seed(cfg.seed))
        rows.append((m, out.images))
    w, h = rows[0][1][0].size
    s, pad = 2, 170
    sheet = Image.new("RGB", (pad + len(labels) * w * s, len(rows) * h * s), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for r, (m, images) in enumerate(rows):
        draw.text((4, r * h * s + h * s // 2 - 6), m, fill=(0, 0, 0))
        for c, img in enumerate(images):
            sheet.paste(img.resize((w * s, h * s), Image.NEAREST), (pad + c * w * s, r * h * s))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    grid = Path(out_dir) / "imagegen_methods.png"
    sheet.save(grid)
    save(report, str(Path(out_dir) / "imagegen_demo.json"))
    return format_table(report) + f"\n\nsame seed, one row per method: {grid}"


def _drafter_model_of(pipe):
    from mmspec.models.llamagen_gpt import LlamaGenGPT

    if isinstance(pipe.drafter, LlamaGenGPT):
        return pipe.drafter
    return getattr(pipe, "drafter_model", None)
