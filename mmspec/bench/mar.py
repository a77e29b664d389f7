"""MAR benchmark (`mmspec bench mar`) and the MAR section of `mmspec demo`: plain MAR sampling
against CSpD speculative sampling (`mmspec.pipelines.SpeculativeMARPipeline`) on a saved
pipeline folder (default: the bundled testbed pair, assets/testbed/mar, when one is bundled).

For each batch size it samples the same class labels with the same per-chunk seeds plainly
and speculatively, in interleaved rounds (methods take turns batch by batch; plain first in even
rounds, CSpD first in odd ones; round 0 is an untimed warm-up), and reports the median
wall-clock time, images per second,
the speed-up of CSpD over plain sampling through the same MAR code, target and draft forwards
per image (batched calls each image took part in; a CSpD verify call evaluates one prefix
sequence per drafted step and row, so it costs more than a plain step), the acceptance rate of
judged drafted tokens, residual samples and bounded acceptance-rejection fallbacks. With the
judge on (`--judge DIR`; by default on only for folders trained by `mmspec testbed train-mar`,
whose classes are the judge's) it scores `--judge-images` plain and CSpD images each (class
accuracy, Frechet distance to the judge's real reference). Exact CSpD (`cspd`) may only
differ from plain sampling by sampling noise, as may `cspd-self` (`--self-draft-steps`, default
3, 0 to leave it out: the target drafts from its own earlier conditioning and each draft is
verified along its whole denoising path; no drafter model; pays at one or few tokens per step,
e.g. `--num-iter` equal to the number of tokens); `cspd-relaxed` (on by default,
`--inner-temperature`, 0 to leave it out) runs the accept test of CSpD's public code, whose
Gaussians are widened by an inner temperature (42 there): lossy, so its quality is measured
beside its speed. The peer of a lossy speed-up is plain sampling in fewer generation steps (MAR
trades steps for quality by design): rows `plain@N` (`--plain-iters`, default half and a quarter
of the steps; `--plain-iters 0` for none) sample plainly with N steps, timed and judged beside
the others, so a lossy method's speed is read against what fewer steps alone buy.

`--device cuda` moves the pipeline to the GPU (the generators stay on the CPU, diffusers'
convention; each chunk ends with a device sync so wall times are the GPU's work). There a CSpD
verify call's prefix sequences (one per drafted step and row) are extra rows of one batched
forward, which costs about what one row costs while the GPU is underused; on a CPU each row
costs its own compute, so the verify costs about as many plain steps as it has prefixes.

Limits: timings are of this machine and its load (take them on a quiet machine with fixed
--threads); MAR's token grid must be small for CPU runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

from mmspec.cli_types import positive_int
from mmspec.bench.report import partial_saver, save
from mmspec.devices import check_device, device_name
from mmspec.pipelines.mar_cli import BUNDLED_MAR, MAKE_ONE, is_mar_folder, load_mar, mar_defaults, read_metrics
from mmspec.testbed.judge_model import JUDGE_DIR

METHODS = ("plain", "cspd", "cspd-self", "cspd-relaxed")


@dataclasses.dataclass(frozen=True)
class MARBenchConfig:
    model: str = str(BUNDLED_MAR)
    batch_sizes: tuple[int, ...] = (1, 8)
    num_images: int = 8  # images per method and batch size in each round
    repeats: int = 3  # timed rounds (median); one untimed warm-up round first
    warmup_chunks: int | None = None  # batches of B labels the warm-up round samples (None: all)
    num_iter: int | None = None  # None: the folder's default (mar_defaults)
    guidance_scale: float | None = None
    cfg_schedule: str = "linear"
    temperature: float | None = None  # None: the folder's default
    num_draft_steps: int = 4
    prefill_fraction: float = 0.15
    acceptance: str = "continuous"
    inner_temperature: float = 42.0  # cspd-relaxed's; 0: no cspd-relaxed rows
    self_draft_steps: int = 3  # cspd-self's drafted steps a round; 0: no cspd-self rows
    seed: int = 0
    threads: int | None = None
    judge: str | None = None  # judge folder; None: no judge
    judge_images: int = 256  # images per method for the judge
    draft_head_steps: int | None = None  # the drafter's head sampling steps (None: its folder's)
    plain_iters: tuple[int, ...] | None = None  # `plain@N` peer rows; None: num_iter // 2 and // 4
    device: str = "cpu"

    def __post_init__(self):
        if not self.batch_sizes or any(not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes must be positive ints, got {self.batch_sizes}")
        for name in ("num_images", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.judge is not None and self.judge_images < 2:
            raise ValueError(f"judge_images must be >= 2 (Frechet needs a covariance), got {self.judge_images}")
        if not (self.inner_temperature == 0 or self.inner_temperature >= 1):
            raise ValueError(f"inner_temperature must be 0 (no relaxed rows) or >= 1, got {self.inner_temperature}")
        if isinstance(self.self_draft_steps, bool) or not isinstance(self.self_draft_steps, int) or self.self_draft_steps < 0:
            raise ValueError(f"self_draft_steps must be an int >= 0 (0: no cspd-self rows), got {self.self_draft_steps!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        w = self.warmup_chunks
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"warmup_chunks must be an int >= 1 (batches the warm-up round samples) or None "
                             f"(a whole round), got {w!r}")
        if self.draft_head_steps is not None and self.draft_head_steps < 2:
            raise ValueError(f"draft_head_steps must be >= 2, got {self.draft_head_steps}")
        check_device(self.device)
        if self.plain_iters is not None and any(not isinstance(n, int) or n < 1 for n in self.plain_iters):
            raise ValueError(f"plain_iters must be ints >= 1 (generation steps of the plain@N rows), got {self.plain_iters}")


def _call(cfg: MARBenchConfig, defaults: dict) -> dict:
    return dict(num_iter=cfg.num_iter if cfg.num_iter is not None else defaults["num_iter"],
                guidance_scale=cfg.guidance_scale if cfg.guidance_scale is not None else defaults["guidance_scale"],
                cfg_schedule=cfg.cfg_schedule,
                temperature=cfg.temperature if cfg.temperature is not None else defaults.get("temperature", 1.0),
                acceptance=cfg.acceptance,
                num_draft_steps=cfg.num_draft_steps, prefill_fraction=cfg.prefill_fraction)


def fewer_iters(cfg: MARBenchConfig, num_iter: int) -> tuple[int, ...]:
    """Generation steps of the `plain@N` rows: fewer than `num_iter`, each once, largest first (the
    defaults, half and a quarter, where they are >= 1; values asked for must be fewer)."""
    if cfg.plain_iters is None:
        return tuple(sorted({n for n in (num_iter // 2, num_iter // 4) if n >= 1}, reverse=True))
    too_many = [n for n in cfg.plain_iters if n >= num_iter]
    if too_many:
        raise ValueError(f"plain_iters {too_many} are not fewer than the {num_iter} generation steps of the plain "
                         "row; the plain@N rows are for fewer steps (pass values below it)")
    return tuple(sorted(set(cfg.plain_iters), reverse=True))


def methods(cfg: MARBenchConfig, num_iter: int | None = None) -> tuple[str, ...]:
    """Row names: plain, exact CSpD, relaxed CSpD (if on) and, given the call's `num_iter`, the
    `plain@N` peers."""
    base = tuple(m for m in METHODS if (m != "cspd-relaxed" or cfg.inner_temperature)
                 and (m != "cspd-self" or cfg.self_draft_steps))
    return base + (() if num_iter is None else tuple(f"plain@{n}" for n in fewer_iters(cfg, num_iter)))


def method_call(cfg: MARBenchConfig, call: dict, method: str) -> dict:
    """pipe(...) keyword arguments of one method."""
    if method.startswith("plain@"):
        return {**call, "speculative": False, "num_iter": int(method[len("plain@"):])}
    if method == "cspd-relaxed":
        from mmspec.acceptance import RelaxedContinuousAcceptance

        return {**call, "speculative": True, "acceptance": RelaxedContinuousAcceptance(cfg.inner_temperature)}
    if method == "cspd-self":  # the target drafts from its own stale conditioning (no pre-filling)
        rest = {k: v for k, v in call.items() if k != "prefill_fraction"}
        return {**rest, "speculative": True, "draft": "self", "num_draft_steps": cfg.self_draft_steps}
    return {**call, "speculative": method != "plain"}


def _new_totals() -> dict:
    return dict(target=0, draft=0, accepted=0, judged=0, drafted=0, residual=0, fallbacks=0, calls_t=0, calls_d=0,
                sec_t=0.0, sec_d=0.0, wall=0.0, images=0)


def run_chunk(pipe, chunk: list[int], call: dict, seed: int, totals: dict) -> None:
    """Sample one batch `chunk` with generator seed `seed`, adding its counts and wall time to `totals`."""
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    s = pipe(chunk, **call, generator=gen, output_type="latent").stats
    _sync(pipe)
    t, n = totals, len(chunk)
    t["wall"] += time.perf_counter() - t0
    t["images"] += n
    t["target"] += s.row_forwards  # the forwards each image took part in (rows on a residual sit some out)
    t["draft"] += s.spec.draft_calls * n
    t["calls_t"] += s.spec.target_calls
    t["calls_d"] += s.spec.draft_calls
    t["sec_t"] += s.spec.verify_seconds
    t["sec_d"] += s.spec.draft_seconds
    for key, value in (("accepted", s.accepted_tokens), ("judged", s.judged_tokens), ("drafted", s.drafted_tokens),
                       ("residual", s.residual_tokens), ("fallbacks", s.fallbacks)):
        t[key] += value


def result_of(t: dict) -> dict:
    """A method's round (the totals of its chunks) as the bench's per-run result."""
    N = t["images"]
    return {"wall_s": t["wall"], "target_forwards_per_image": t["target"] / N, "draft_forwards_per_image": t["draft"] / N,
            "accepted_tokens": t["accepted"], "judged_tokens": t["judged"], "drafted_tokens": t["drafted"],
            "residual_tokens": t["residual"], "fallbacks": t["fallbacks"],
            # cost of one batched call: a plain step for plain sampling, a verify call (with accept /
            # residual) for CSpD; a drafter step (forward + head trajectory)
            "ms_per_target_call": 1e3 * t["sec_t"] / t["calls_t"] if t["calls_t"] else None,
            "ms_per_draft_call": 1e3 * t["sec_d"] / t["calls_d"] if t["calls_d"] else None}


def run_method(pipe, labels: list[int], B: int, call: dict, seed: int) -> dict:
    """Sample `labels` in chunks of B; chunk i uses seed (seed, i) for both methods, so plain and
    CSpD share the generation orders and diffusion noise of every image."""
    t = _new_totals()
    for i in range(0, len(labels), B):
        run_chunk(pipe, labels[i:i + B], call, seed * 100_003 + i, t)
    return result_of(t)


def _sync(pipe) -> None:
    """Wait for the pipeline's device (CUDA work is asynchronous; a no-op on the CPU)."""
    device = pipe.transformer.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_judge(pipe, judge_dir) -> None:
    """The judge scores testbed-world images against its own classes: refuse other folders."""
    from mmspec.testbed.judge_model import check_judge_fits

    check_judge_fits(judge_dir, pipe.transformer.config.class_num, pipe.transformer.config.img_size, "this MAR",
                     "drop --judge")


def judge_quality(pipe, cfg: MARBenchConfig, call: dict, progress) -> dict:
    from mmspec.testbed.judge_model import Judge

    judge = Judge.from_pretrained(str(cfg.judge))
    n_cls = pipe.transformer.config.class_num
    labels = [i % n_cls for i in range(cfg.judge_images)]
    out = {}
    for method in methods(cfg, call["num_iter"]):
        pixels = []
        for i in range(0, len(labels), 32):
            gen = torch.Generator().manual_seed(cfg.seed + 7 + 1009 * i)  # same seeds for both methods
            o = pipe(labels[i:i + 32], **method_call(cfg, call, method), generator=gen, output_type="pt")
            pixels.append(o.images.float().cpu() * 2 - 1)  # the judge runs on the CPU
        score = judge.score(torch.cat(pixels), labels)
        out[method] = {"images": len(labels), **{k: round(v, 4) for k, v in score.items()}}
        progress(f"judge {method}: {out[method]}")
    return out


def run(cfg: MARBenchConfig, progress=lambda m: None, checkpoint=None) -> dict:
    """The report; `checkpoint(report)`, if given, after each batch size (see `save`)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    pipe = load_mar(cfg.model)
    if pipe.drafter is None:
        raise ValueError(f"model={cfg.model!r} has no drafter MAR: CSpD needs one")
    pipe.to(cfg.device)
    if cfg.judge is not None:
        check_judge(pipe, cfg.judge)
    if cfg.draft_head_steps is not None:
        pipe.drafter.set_num_sampling_steps(cfg.draft_head_steps)
    call = _call(cfg, mar_defaults(cfg.model, pipe))
    t, d = pipe.transformer, pipe.drafter
    report = {"config": {**dataclasses.asdict(cfg), **call}, "model": {
        "target_parameters": sum(p.numel() for p in t.parameters()),
        "drafter_parameters": sum(p.numel() for p in d.parameters()),
        "image_tokens": t.seq_len, "token_dim": t.token_embed_dim, "classes": t.config.class_num,
        "head_steps": t.config.num_sampling_steps, "drafter_head_steps": d.config.num_sampling_steps,
        "image_size": t.config.img_size,
        "torch_threads": torch.get_num_threads(), "device": device_name(pipe.transformer.device),
    }, "batches": []}
    labels = [i % t.config.class_num for i in range(cfg.num_images)]
    for B in cfg.batch_sizes:
        ms = methods(cfg, call["num_iter"])
        runs: dict[str, list[dict]] = {m: [] for m in ms}
        for r in range(cfg.repeats + 1):  # round 0 warms up
            # Every method samples each batch of B labels (same seed: shared orders and noise) before
            # the next batch starts, so a slow phase of the machine hits every method alike; the
            # order alternates round by round and batch by batch.
            order = ms if r % 2 == 0 else ms[::-1]
            totals = {m: _new_totals() for m in ms}
            starts = range(0, len(labels), B)
            if r == 0 and cfg.warmup_chunks is not None:  # a warm-up meets every shape in its first batch
                starts = starts[:cfg.warmup_chunks]
            for c, i in enumerate(starts):
                for m in order if c % 2 == 0 else order[::-1]:
                    run_chunk(pipe, labels[i:i + B], method_call(cfg, call, m), (cfg.seed + r) * 100_003 + i, totals[m])
            if r > 0:
                for m in ms:
                    runs[m].append(result_of(totals[m]))
            progress(f"batch {B}: round {r}/{cfg.repeats} done")
        plain_wall = statistics.median(x["wall_s"] for x in runs["plain"])
        rows = {}
        for m in ms:
            xs = runs[m]
            wall = statistics.median(x["wall_s"] for x in xs)
            judged = sum(x["judged_tokens"] for x in xs)
            rows[m] = {
                "wall_s": round(wall, 4), "images_per_s": round(cfg.num_images / wall, 3),
                "speedup_vs_plain": round(plain_wall / wall, 3),
                "target_forwards_per_image": round(statistics.mean(x["target_forwards_per_image"] for x in xs), 3),
                "draft_forwards_per_image": round(statistics.mean(x["draft_forwards_per_image"] for x in xs), 3),
                "acceptance_rate": round(sum(x["accepted_tokens"] for x in xs) / judged, 4) if judged else None,
                "drafted_tokens": sum(x["drafted_tokens"] for x in xs),
                "residual_tokens": sum(x["residual_tokens"] for x in xs),
                "fallbacks": sum(x["fallbacks"] for x in xs),
                "ms_per_target_call": _median_or_none(x["ms_per_target_call"] for x in xs),
                "ms_per_draft_call": _median_or_none(x["ms_per_draft_call"] for x in xs),
            }
        report["batches"].append({"batch_size": B, "methods": rows})
        if checkpoint is not None:
            checkpoint(report)
    if cfg.judge is not None:
        report["judge"] = judge_quality(pipe, cfg, call, progress)
    return report


def _median_or_none(values) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


def format_table(report: dict) -> str:
    m, c = report["model"], report["config"]
    lines = [f"MAR, plain vs CSpD: target {m['target_parameters'] / 1e6:.2f}M params, drafter "
             f"{m['drafter_parameters'] / 1e6:.2f}M, {m['image_tokens']} tokens x {m['token_dim']} dims/image, "
             f"{c['num_iter']} steps, guidance {c['guidance_scale']} ({c['cfg_schedule']}), temperature {c['temperature']}, "
             f"{c['num_draft_steps']} draft steps/round (cspd-self: {c.get('self_draft_steps', '-')}), head steps "
             f"{m['head_steps']} (drafter "
             f"{m.get('drafter_head_steps', m['head_steps'])}), threads {m['torch_threads']}, device {m.get('device', 'cpu')}"]
    for e in report["batches"]:
        lines.append(f"\nbatch {e['batch_size']} ({c['num_images']} images per run, median of {c['repeats']} runs)")
        lines.append(f"{'method':<14}{'tgt fwd/img':>12}{'drf fwd/img':>12}{'accept':>8}{'fallbacks':>10}"
                     f"{'img/s':>9}{'speed-up':>10}{'ms/tgt call':>12}{'ms/drf call':>12}")
        for name, r in e["methods"].items():
            acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
            lines.append(f"{name:<14}{r['target_forwards_per_image']:>12.2f}{r['draft_forwards_per_image']:>12.2f}"
                         f"{acc:>8}{r['fallbacks']:>10}{r['images_per_s']:>9.2f}{r['speedup_vs_plain']:>9.2f}x"
                         f"{_ms(r.get('ms_per_target_call')):>12}{_ms(r.get('ms_per_draft_call')):>12}")
    if "judge" in report:
        lines.append("\njudge (class accuracy, Frechet):")
        for name, s in report["judge"].items():
            lines.append(f"  {name:<14} {s['images']} images: accuracy {s['accuracy']:.3f}  frechet {s['frechet']:.3f}")
    return "\n".join(lines)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _batch_sizes(values: list[str]) -> tuple[int, ...]:
    try:
        return tuple(int(x) for v in values for x in v.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"mmspec bench mar: --batch-sizes takes integers, got {values}") from None


def _judge_default(model: str) -> str | None:
    """The judge is on by default only for folders trained by `mmspec testbed train-mar` (their
    metrics.json holds judge scores), whose classes are the testbed judge's."""
    metrics = Path(model) / "metrics.json"
    if not (JUDGE_DIR / "config.json").is_file() or not metrics.is_file():
        return None
    return str(JUDGE_DIR) if "judge_vae_recon" in read_metrics(metrics) else None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mmspec bench mar", description="MAR: plain sampling vs CSpD speculative "
                                "sampling on a SpeculativeMARPipeline folder (speed-up, forwards, acceptance)")
    p.add_argument("--model", default=None, help=f"SpeculativeMARPipeline folder (default: the bundled {BUNDLED_MAR})")
    p.add_argument("--batch-sizes", nargs="+", default=["1", "8"], help="batch sizes (default 1 8)")
    p.add_argument("--num-images", type=int, default=8, help="images per method and batch size per run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method (median), after one warm-up")
    p.add_argument("--num-iter", type=int, default=None, help="generation steps (default: the folder's)")
    p.add_argument("--guidance-scale", type=float, default=None, help="default: the folder's, else 3.0")
    p.add_argument("--cfg-schedule", choices=("linear", "constant"), default="linear")
    p.add_argument("--temperature", type=float, default=None, help="default: the folder's")
    p.add_argument("--num-draft-steps", type=int, default=4)
    p.add_argument("--prefill-fraction", type=float, default=0.15)
    p.add_argument("--self-draft-steps", type=int, default=3,
                   help="cspd-self rows (the target drafts from its own earlier conditioning, verified along whole "
                   "denoising paths): steps drafted a round (0: no such rows)")
    p.add_argument("--inner-temperature", type=float, default=42.0,
                   help="cspd-relaxed rows: CSpD's public-code accept test widened by this factor (lossy; 0: no such rows)")
    p.add_argument("--draft-head-steps", type=int, default=None,
                   help="sample the drafter's diffusion head in this many steps (cheaper drafts; default: its folder's)")
    p.add_argument("--plain-iters", default=None,
                   help="comma-separated generation steps of plain@N peer rows (default: half and a quarter of "
                   "the steps; 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the pipeline is moved there)")
    j = p.add_mutually_exclusive_group()
    j.add_argument("--judge", default=None, help="testbed judge folder: score plain and CSpD images "
                   "(default: on for folders made by `mmspec testbed train-mar`)")
    j.add_argument("--no-judge", action="store_true", help="never run the judge")
    p.add_argument("--judge-images", type=int, default=256, help="images per method for the judge")
    p.add_argument("--json", default=None, help="also write the report as JSON to this path")
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        if not is_mar_folder(BUNDLED_MAR):
            raise SystemExit(f"mmspec bench mar: no --model given and no bundled MAR pair at {BUNDLED_MAR}; {MAKE_ONE}")
        model = str(BUNDLED_MAR)
    elif not is_mar_folder(model):
        raise SystemExit(f"mmspec bench mar: {model} is not a SpeculativeMARPipeline folder (its model_index.json "
                         f"must name SpeculativeMARPipeline); {MAKE_ONE}")
    judge = None if args.no_judge else (args.judge or _judge_default(model))
    plain_iters = None
    if args.plain_iters is not None:
        try:
            plain_iters = tuple(int(x) for x in args.plain_iters.split(",") if x.strip())
        except ValueError:
            raise SystemExit(f"mmspec bench mar: --plain-iters takes integers, got {args.plain_iters!r}") from None
        plain_iters = () if plain_iters == (0,) else plain_iters
    try:
        cfg = MARBenchConfig(model=model, batch_sizes=_batch_sizes(args.batch_sizes), num_images=args.num_images,
                             repeats=args.repeats, num_iter=args.num_iter, guidance_scale=args.guidance_scale,
                             cfg_schedule=args.cfg_schedule, temperature=args.temperature,
                             num_draft_steps=args.num_draft_steps, prefill_fraction=args.prefill_fraction,
                             inner_temperature=args.inner_temperature, self_draft_steps=args.self_draft_steps,
                             draft_head_steps=args.draft_head_steps,
                             seed=args.seed, threads=args.threads, judge=judge, judge_images=args.judge_images,
                             plain_iters=plain_iters, device=args.device)
        report = run(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True), checkpoint=partial_saver(args.json))
    except ValueError as e:
        raise SystemExit(f"mmspec bench mar: {e}") from None
    print(format_table(report))
    if args.json:
        save(report, args.json)
        print(f"wrote {args.json}")
    return 0


def demo_section(out_dir: str, model=BUNDLED_MAR, threads: int | None = 2, progress=lambda m: None) -> str:
    """The MAR section of `mmspec demo`: one timed round of plain vs CSpD sampling at batch 1 and
    4 (4 images per method: the section is the demo's longest; `mmspec bench mar` times batch 8
    and more images) on the same labels and seeds, and a PNG with one row per method (plain,
    exact CSpD with the drafter MAR, self-drafted CSpD; same seeds) in `out_dir`. It samples one
    token a step (as many steps as tokens, at most MAR's 64), where self-drafting pays; the
    folder's own default (fewer, coarser steps) is `mmspec bench mar`'s. Returns the text to print: a one-line skip notice when no MAR pair is bundled
    (checked before any model is loaded, so an absent pair costs nothing)."""
    if not is_mar_folder(model):
        return (f"(MAR section skipped: no bundled MAR pair at {model}; make one with "
                "`mmspec testbed train-mar --out DIR`, then run `mmspec bench mar --model DIR`)")
    from PIL import Image

    pipe = load_mar(model)
    # the demo keeps to the exact methods (bench mar adds the lossy relaxed rule and the fewer-steps rows)
    # The warm-up samples one batch per method (at batch 1 a full warm-up round of the drafter MAR,
    # which accepts nothing here, took ~40 s of the demo's ~5 minutes on a 2-core Xeon).
    cfg = MARBenchConfig(model=str(model), batch_sizes=(1, 4), num_images=4, repeats=1, threads=threads,
                         num_iter=min(64, pipe.transformer.seq_len), inner_temperature=0, plain_iters=(),
                         warmup_chunks=1)
    report = run(cfg, progress)
    call = _call(cfg, mar_defaults(model, pipe))
    labels = [i % pipe.transformer.config.class_num for i in range(4)]  # the timed batch-4 shapes
    rows = [pipe(labels, **method_call(cfg, call, m), generator=torch.Generator().manual_seed(cfg.seed)).images
            for m in methods(cfg)]
    w, h = rows[0][0].size
    s = 2
    sheet = Image.new("RGB", (len(labels) * w * s, len(rows) * h * s), (255, 255, 255))
    for r, images in enumerate(rows):
        for c, img in enumerate(images):
            sheet.paste(img.resize((w * s, h * s), Image.NEAREST), (c * w * s, r * h * s))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    grid = Path(out_dir) / "mar_plain_vs_cspd.png"
    sheet.save(grid)
    save(report, str(Path(out_dir) / "mar_demo.json"))
    return format_table(report) + f"\n\nsame seeds, rows top to bottom {', '.join(methods(cfg))}: {grid}"
