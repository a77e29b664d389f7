"""`mmspec bench gpu`: the engine at real model sizes on a GPU, against plain decoding and
against the replay ideal.

What it measures: a Llama-2-7B-shaped target (32 layers, width 4096, vocabulary 32000) with
random bfloat16 weights and a 1-layer drafter of the same width, on two workloads: a text
prompt (48-64 tokens) and a LLaVA-1.5-7B-shaped prompt (600-640 positions: LLaVA-1.5 puts 576
image positions into the language model's context; the CLIP tower runs once per request at
prefill and is not part of decoding, so the prompt here is token ids of that length).
Random weights agree on nothing, so acceptance is forced (mmspec/bench/forced.py) to a
profile: every position is draftable with probability `alpha`, by default fitted to the
testbed VLM's ViSpec caption run (mean accepted length 3.46 at K = 5, `mmspec bench vlm`,
benchmarks/results/vlm_cpu_epyc_s25.json), i.e. alpha = 0.775.

Every call decodes a fresh prompt (its own length and forced script; `--same-prompt`: one prompt
for all, as before session 29): with one prompt repeated, backends that cache a plan per
attention shape (cuDNN attention) pay it in the warm-up call only, which flatters a fixed K
whose shapes repeat exactly and no real stream of prompts reproduces. References and the
recorded forwards of the ideal run on the math backend, so no fused plan exists before the
timed calls. On CUDA the fixed-K and `auto` rows also run with `attention="torch"` (torch's own
backend choice) beside mmspec's measured one (mmspec/attention_choice.py); the report's
`attention_choice` gives what was measured.

Per workload, timed in interleaved rounds (medians, each call ending in a device sync):
transformers' plain `generate`, mmspec plain (K = 0 through the same loop), mmspec with fixed
K, mmspec `"auto"`, and the *ideal*: exactly the fixed-K run's model forwards replayed with no
engine around them (mmspec/bench/core.py `_replay`); `efficiency = ideal / measured`. With
`--compile` the first workload also runs the opt-in static path (`static=True`) and CUDA graphs
(`compile="reduce-overhead"`) at fixed K. Every output (each request a method decoded: the
warm-up's and every round's prompt) is compared with `generate`'s greedy output, and the
accepted length, mean K and verify forwards (per request) are over those requests (bfloat16: verify shapes differ from one-token decoding, so a near-tie can flip; the
table says so per row rather than hiding it). A deadline (`--deadline-s`) skips what would
not fit and says so. On a machine without CUDA it refuses `--device cuda`; `--shape tiny
--device cpu` is a seconds-long smoke run.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from mmspec.bench.report import save
from mmspec.bench import ORDERS, check_order
from mmspec.bench.core import _cycling, _interleaved, _prompts, _record_forwards, _replay
from mmspec.devices import check_device, device_name

SHAPES = {
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, rms_norm_eps=1e-5, max_position_embeddings=4096),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=256, max_position_embeddings=2048),
}
WORKLOADS = {"text": (48, 64), "llava": (600, 640)}  # prompt lengths (min, max)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def alpha_for(accepted_length: float, k: int) -> float:
    """The per-position rate alpha whose K-token chains give this mean accepted length:
    (1 - alpha^(K+1)) / (1 - alpha) = L (bisection; L in [1, K+1])."""
    if not 1.0 <= accepted_length <= k + 1:
        raise ValueError(f"a mean accepted length at K={k} lies in [1, {k + 1}], got {accepted_length}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < accepted_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def expected_length(alpha: float, k: int) -> float:
    return sum(alpha**i for i in range(k + 1))


@dataclass(frozen=True)
class GpuBenchConfig:
    shape: str = "llama-2-7b"
    drafter_layers: int = 1
    dtype: str = "bfloat16"
    device: str = "cuda"
    workloads: tuple[tuple[str, int], ...] = (("text", 1), ("text", 4), ("llava", 1))
    max_new_tokens: int = 128
    num_draft_tokens: int = 5
    max_draft_tokens: int = 8  # K_max of "auto"
    alpha: float = round(alpha_for(3.462, 5), 4)
    repeats: int = 3
    compile: bool = False
    stable_greedy: bool = True  # see _stable_greedy
    cudnn_attention: bool = True  # False: torch.backends.cuda.enable_cudnn_sdp(False) for the run
    fresh_prompts: bool = True  # a new prompt (length, script) per call: no call replays another's shapes
    attention_rows: bool = True  # CUDA: fixed K and auto also with attention="torch"
    pinned_auto: bool = False  # a diagnostic row: the adaptive drafter with its controller held at K
    other_fixed_k: tuple[int, ...] = ()  # more fixed-K rows beside num_draft_tokens' (is auto's choice right?)
    deadline_s: float | None = None
    seed: int = 0
    # Method order within rounds (`mmspec.bench.core._interleaved`): "balanced" since session 52
    # (every method follows every other equally often); the GPU reports before ran "alternate".
    order: str = "balanced"

    def __post_init__(self) -> None:
        check_order(self.order)
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; choose from {sorted(SHAPES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {sorted(DTYPES)}")
        bad = [w for w, _ in self.workloads if w not in WORKLOADS]
        if bad:
            raise ValueError(f"unknown workloads {bad}; choose from {sorted(WORKLOADS)}")
        rows = [b for _, b in self.workloads if isinstance(b, bool) or not isinstance(b, int) or b < 1]
        if rows:
            raise ValueError(f"workload batch sizes must be ints >= 1, got {rows}")
        try:
            check_device(self.device)
        except ValueError as e:
            raise ValueError(f"{e} (--device cpu --shape tiny for a smoke run here)") from None
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if min(self.repeats, self.max_new_tokens, self.num_draft_tokens, self.drafter_layers) < 1:
            raise ValueError("repeats, max_new_tokens, num_draft_tokens and drafter_layers must be >= 1")
        bad = [k for k in self.other_fixed_k if isinstance(k, bool) or not isinstance(k, int) or k < 1
               or k == self.num_draft_tokens]
        if bad or len(set(self.other_fixed_k)) != len(self.other_fixed_k):
            raise ValueError(f"other_fixed_k must be distinct ints >= 1 other than num_draft_tokens="
                             f"{self.num_draft_tokens}, got {self.other_fixed_k}")


def build_models(config: GpuBenchConfig):
    """Target and drafter with random weights, created on the device in the bench dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(SHAPES[config.shape], bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    dtype = DTYPES[config.dtype]
    models = []
    for seed, layers in ((config.seed, shape["num_hidden_layers"]), (config.seed + 1, config.drafter_layers)):
        torch.manual_seed(seed)
        with torch.device(config.device):
            model = LlamaForCausalLM._from_config(LlamaConfig(**dict(shape, num_hidden_layers=layers)), dtype=dtype)
        model.eval()
        model.generation_config.eos_token_id = None  # fixed-length generations
        if config.stable_greedy:
            _stable_greedy(model)
        models.append(model)
    return models


@torch.no_grad()
def _stable_greedy(model) -> None:
    """Make the greedy continuation immune to rounding: the layers' output projections are
    scaled by 1e-4 and the LM head is a copy of the embedding, so each position's hidden state
    stays close to its token's embedding and the argmax (the same token again) wins by a
    margin far above bfloat16 noise. Same shapes, same kernels, random non-zero data: the cost
    of a forward is unchanged, while a verify of K+1 tokens and a one-token step now agree on
    every argmax (with plain random weights near-ties flip within a few tokens, and a forced
    script built from `generate` stops matching the run)."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(1e-4)
        layer.mlp.down_proj.weight.mul_(1e-4)
    model.lm_head.weight.copy_(model.model.embed_tokens.weight)


def _synced(fn, device):
    if torch.device(device).type != "cuda":
        return fn

    def call():
        out = fn()
        torch.cuda.synchronize()
        return out
    return call


def _prompt_set(B: int, lengths: tuple[int, int], vocab: int, seed: int, count: int) -> list:
    """`count` prompts; at batch 1 of pairwise different lengths (while the range allows), so
    no request's attention shapes repeat another's."""
    if count == 1:
        return [_prompts(B, lengths, vocab, seed=seed)]
    span = lengths[1] - lengths[0] + 1
    if B == 1 and count <= span:
        g = torch.Generator().manual_seed(seed)
        lens = (torch.randperm(span, generator=g)[:count] + lengths[0]).tolist()
        return [_prompts(1, (n, n), vocab, seed=seed + 1 + i) for i, n in enumerate(lens)]
    return [_prompts(B, lengths, vocab, seed=seed + 7919 * i) for i in range(count)]


def controller_state(c, batch: int, new_tokens: int) -> dict:
    """What `auto`'s controller believed after the run: acceptance per draft position, the
    measured step costs (ms) per (rows x queries) for verify and (rows x drafts) for drafting
    with the number of steps behind each, and its projected ms to finish a fresh request of `new_tokens` per row at each K (its
    choice is the smallest)."""
    finish = {k: c.finish_seconds(batch, k, [new_tokens] * batch) for k in range(c.k_max + 1)}
    ms = 1e3 * math.exp(c.log_phase)  # the means are kept in the units of phase 0
    return {"acceptance": [round(a, 3) for a in c.acceptance()],
            "verify_ms": {f"{b}x{q}": round(v * ms, 3) for (b, q), v in sorted(c.verify.means.items())},
            "draft_ms": {f"{b}x{k}": round(v * ms, 3) for (b, k), v in sorted(c.draft.means.items())},
            "speed_phase": round(math.exp(-c.log_phase), 3),
            # how many steps each mean is made of: a key seen a few times is mostly its first
            # observation, which carries whatever a new shape costs once (kernel loading, plans)
            "verify_observations": {f"{b}x{q}": n for (b, q), n in sorted(c.verify.counts.items())},
            "draft_observations": {f"{b}x{k}": n for (b, k), n in sorted(c.draft.counts.items())},
            "finish_ms": {k: None if v is None else round(v * 1e3, 1) for k, v in finish.items()},
            "k_histogram_all_calls": {k: c.history.count(k) for k in sorted(set(c.history))},
            # whether first readings ran dear here (geometric mean of first / second reading over
            # the keys seen twice) and so were treated as provisional (mmspec/adaptive.py)
            "first_reading_ratio": {name: _first_reading(getattr(c, name)) for name in ("verify", "draft")}}


def _first_reading(table) -> dict:
    n, ratio = table.first_reading_ratio()
    return {"keys": n, "ratio": None if ratio is None else round(ratio, 3), "provisional": table.one_time_costs}


def _workload(config, target, drafter, name, B, progress, compile_rows):
    import mmspec
    from torch.nn.attention import SDPBackend

    from mmspec.attention_choice import backends_for, context
    from mmspec.bench.forced import ForcedDrafter, scripted_tokens
    from mmspec.drafters import ModelDrafter, NullDrafter
    from mmspec.models.hf_target import HFTarget

    dev, N, K, V = config.device, config.max_new_tokens, config.num_draft_tokens, target.config.vocab_size
    cuda = torch.device(dev).type == "cuda"
    count = config.repeats + 1 if config.fresh_prompts else 1
    prompts = [(i.to(dev), m.to(dev)) for i, m in _prompt_set(B, WORKLOADS[name], V, config.seed + B, count)]
    gens = [dict(input_ids=i, attention_mask=m, do_sample=False, max_new_tokens=N, pad_token_id=0) for i, m in prompts]
    # References and recorded forwards run on the math backend (CUDA): no per-shape plan of a
    # fused backend is cached before the timed calls meet their shapes (fresh prompts).
    def untimed():
        return context([SDPBackend.MATH] if cuda and config.fresh_prompts else None)
    with torch.no_grad(), untimed():
        refs = [target.generate(**g) for g in gens]
    scripts = [scripted_tokens(ref[:, i.shape[1]:], config.alpha, V, extra=max(config.max_draft_tokens, K, *config.other_fixed_k) + 2,
                               seed=config.seed + p) for p, (ref, (i, _)) in enumerate(zip(refs, prompts))]
    tgt = HFTarget(target)  # built once, reused by every call (the wrap is paid once)
    drafters = {"fixed": ModelDrafter(drafter, K), "auto": ModelDrafter(drafter, "auto", max_draft_tokens=config.max_draft_tokens)}
    args = dict(temperature=0, max_new_tokens=N, pad_token_id=0)

    def spec(t, d):
        return lambda p: mmspec.speculative_generate(t, d(p), *prompts[p], **args)

    methods = {
        "generate": lambda p: target.generate(**gens[p]),
        "mmspec plain": spec(tgt, lambda p: NullDrafter(V)),
        f"mmspec K={K}": spec(tgt, lambda p: ForcedDrafter(drafters["fixed"], scripts[p])),
        "mmspec auto": spec(tgt, lambda p: ForcedDrafter(drafters["auto"], scripts[p])),
    }
    others = [f"mmspec K={k}" for k in config.other_fixed_k]
    for k in config.other_fixed_k:  # the same forced acceptance at other draft lengths
        other = ModelDrafter(drafter, k)
        methods[f"mmspec K={k}"] = spec(tgt, lambda p, other=other: ForcedDrafter(other, scripts[p]))
    if cuda and config.attention_rows:
        # torch's own attention-backend choice, beside mmspec's measured one (mmspec/attention_choice.py)
        t_t = HFTarget(target, attention="torch")
        d_t = {"fixed": ModelDrafter(drafter, K, attention="torch"),
               "auto": ModelDrafter(drafter, "auto", max_draft_tokens=config.max_draft_tokens, attention="torch")}
        methods[f"mmspec K={K} torch attention"] = spec(t_t, lambda p: ForcedDrafter(d_t["fixed"], scripts[p]))
        methods["mmspec auto torch attention"] = spec(t_t, lambda p: ForcedDrafter(d_t["auto"], scripts[p]))
    if config.pinned_auto:
        # The adaptive path (deferred prefill, per-step choice, timing, K_max-sized buffers) at the
        # fixed row's K on every step: the same speed as "K=5" unless that path costs per step.
        from mmspec.adaptive import DraftLengthController

        pinned = ModelDrafter(drafter, "auto", max_draft_tokens=config.max_draft_tokens)
        pinned.controller = DraftLengthController(config.max_draft_tokens, warmup=(K,) * 10**6, probe_every=0)
        methods[f"mmspec auto pinned K={K}"] = spec(tgt, lambda p: ForcedDrafter(pinned, scripts[p]))
    compiled = []
    if compile_rows:
        for label, opts in (("static", dict(static=True)), ("cuda graphs", dict(compile="reduce-overhead"))):
            t_c, d_c = HFTarget(target, **opts), ModelDrafter(drafter, K, **opts)
            compiled.append(f"mmspec K={K} {label}")
            methods[compiled[-1]] = spec(t_c, lambda p, d_c=d_c: ForcedDrafter(d_c, scripts[p]))
    replays = []
    for p, (i, m) in enumerate(prompts):
        with untimed():
            _, log = _record_forwards(lambda: methods[f"mmspec K={K}"](p), {"target": target, "drafter": drafter})
        replays.append(_replay({"target": target, "drafter": drafter}, i, m, log))
    # The ideal runs its forwards under the attention backends mmspec chose for this model (the
    # same kernels as the measured rows), else a fresh prompt's shapes would charge it plan builds.
    chosen = backends_for(tgt.spec, dev, next(target.parameters()).dtype)

    def ideal(p):
        with context(chosen):
            return replays[p]()
    methods["ideal"] = ideal
    with torch.no_grad():  # traces are per capacity bucket, not per attention shape: build them all before timing
        for label in compiled:
            for p in range(1, count):
                methods[label](p)
    cycled = {k: _cycling(v, count) for k, v in methods.items()}  # each keeps its latest output per prompt
    methods = {k: _synced(c, dev) for k, c in cycled.items()}
    L = max(i.shape[1] for i, _ in prompts)
    progress(f"{name} B={B}: prompt {'up to ' if count > 1 else ''}{L} positions, {N} new tokens, "
             f"{'a fresh prompt per call' if count > 1 else 'one prompt for every call'}, {', '.join(methods)} "
             f"interleaved ({config.order} order), {config.repeats} rounds ...")
    with torch.no_grad():
        times, outs = _interleaved(methods, config.repeats, order=config.order)
    rows = []
    for method, t in times.items():
        p, out = outs[method]
        stats = getattr(out, "stats", None)
        row = {"workload": name, "batch": B, "prompt_positions": L, "method": method, "seconds": round(t, 4),
               "tokens_per_s": round(B * N / t, 1), "speedup_vs_generate": round(times["generate"] / t, 3),
               "speedup_vs_mmspec_plain": round(times["mmspec plain"] / t, 3)}
        if method == "ideal":
            row["efficiency_of_fixed_k"] = round(t / times[f"mmspec K={K}"], 3)
        elif method != "generate":
            # every request the method decoded (the warm-up's and each round's prompt), not the last one only
            every = cycled[method].outs
            row["identical_to_generate"] = all(bool(torch.equal(o.sequences, refs[j])) for j, o in every.items())
            row["requests_checked"] = len(every)
            if stats is not None and method != "mmspec plain":
                all_stats = [o.stats for o in every.values()]
                steps = max(sum(s.row_steps for s in all_stats), 1)  # the figures of all those requests
                row["mean_accepted_length"] = round(sum(s.emitted_tokens for s in all_stats) / steps, 3)
                row["mean_k"] = round(sum(s.drafted_nodes for s in all_stats) / steps, 2)
                row["verify_forwards"] = round(sum(s.target_calls for s in all_stats) / len(all_stats), 1)
                if method == "mmspec auto":
                    row["controller"] = controller_state(drafters["auto"].controller, B, N)
                if "auto" not in method and method not in others:  # rows at K: the replay ideal is K's forwards
                    row["expected_accepted_length"] = round(expected_length(config.alpha, K), 3)
                    row["efficiency"] = round(times["ideal"] / t, 3)
        rows.append(row)
    return rows


def run(config: GpuBenchConfig, progress=print, json_path: str | None = None) -> dict:
    """Rows per workload and method; with `json_path` the report is rewritten after every
    workload, so a run cut short keeps what it measured."""
    import transformers

    start = time.perf_counter()
    cuda = config.device.startswith("cuda")
    if cuda and not config.cudnn_attention:
        # A diagnostic switch: `auto` varies the verify's query length from request to request,
        # and a per-shape setup cost in an attention backend would hit it (docs/architecture.md).
        torch.backends.cuda.enable_cudnn_sdp(False)
    info = {"device": device_name(config.device),
            "torch": torch.__version__, "transformers": transformers.__version__, "alpha": config.alpha,
            "sdpa_backends": ({name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
                               for name in ("flash", "mem_efficient", "cudnn", "math")} if cuda else None),
            "profile": "positions draftable with probability alpha, fitted to the testbed VLM's ViSpec captions "
                       "(mean accepted length 3.46 at K=5)"}
    target, drafter = build_models(config)
    info["target_params_M"] = round(sum(p.numel() for p in target.parameters()) / 1e6, 1)
    info["drafter_params_M"] = round(sum(p.numel() for p in drafter.parameters()) / 1e6, 1)
    info["build_seconds"] = round(time.perf_counter() - start, 1)
    progress(f"{info['device']}: target {info['target_params_M']}M, drafter {info['drafter_params_M']}M params "
             f"({config.dtype}, random weights), alpha {config.alpha}")
    report = {"info": info, "config": asdict(config), "rows": [], "skipped": []}
    for i, (name, B) in enumerate(config.workloads):
        elapsed = time.perf_counter() - start
        if config.deadline_s is not None and elapsed > config.deadline_s:
            report["skipped"].append({"workload": name, "batch": B, "why": f"deadline ({elapsed:.0f} s elapsed)"})
            progress(f"skipped {name} B={B}: past the deadline")
            continue
        try:
            report["rows"] += _workload(config, target, drafter, name, B, progress, config.compile and i == 0)
        except Exception as e:  # report and go on: one failing workload must not lose the others' figures
            report["skipped"].append({"workload": name, "batch": B, "why": f"{type(e).__name__}: {e}"[:500]})
            progress(f"FAILED {name} B={B}: {type(e).__name__}: {e}")
        report["info"]["seconds"] = round(time.perf_counter() - start, 1)
        from mmspec.attention_choice import choices

        report["info"]["attention_choice"] = choices()
        progress(format_table(report))
        if json_path:  # marked partial until the run ends
            save({**report, "partial": True}, json_path)
    if json_path:
        save(report, json_path)
    return report


def format_table(report: dict) -> str:
    head = (f"{'workload':<8} {'B':>2} {'method':<26} {'tok/s':>8} {'vs gen':>7} {'vs plain':>8} {'acc.len':>7} "
            f"{'expect':>6} {'mean K':>6} {'effic.':>6} {'same':>5}")
    lines = [f"device: {report['info']['device']} (torch {report['info']['torch']}, transformers "
             f"{report['info']['transformers']})", head, "-" * len(head)]
    for r in report["rows"]:
        eff = r.get("efficiency", r.get("efficiency_of_fixed_k"))
        same = r.get("identical_to_generate")
        lines.append(
            f"{r['workload']:<8} {r['batch']:>2} {r['method']:<26} {r['tokens_per_s']:>8.1f} {r['speedup_vs_generate']:>6.2f}x "
            f"{r['speedup_vs_mmspec_plain']:>7.2f}x {r.get('mean_accepted_length', ''):>7} "
            f"{r.get('expected_accepted_length', ''):>6} {r.get('mean_k', ''):>6} "
            f"{format(eff, '.0%') if eff else '':>6} {'' if same is None else 'yes' if same else 'NO':>5}")
    for r in report["rows"]:
        c = r.get("controller")
        if c and c.get("first_reading_ratio"):
            parts = [f"{name} {v['ratio'] if v['ratio'] is not None else '-'}x over {v['keys']} shapes"
                     f"{' (provisional)' if v['provisional'] else ''}" for name, v in c["first_reading_ratio"].items()]
            lines.append(f"{r['workload']} B={r['batch']} auto, first / second reading of a shape: " + ", ".join(parts))
    for s in report.get("skipped", []):
        lines.append(f"skipped {s['workload']} B={s['batch']}: {s['why']}")
    for key, c in (report["info"].get("attention_choice") or {}).items():
        ms = c.get("fresh_shape_ms")
        lines.append(f"attention ({key}): {c['chosen']}" + (f" (ms per fresh-shape verify + one-token call: torch's "
                     f"choice {ms['torch']}, without cuDNN {ms['without_cudnn']})" if ms else f" ({c.get('why', '')})"))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`mmspec bench gpu [options]`."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="mmspec bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-2-7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--workloads", default="text:1,text:4,llava:1", help="comma-separated NAME:BATCH")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=5)
    p.add_argument("--alpha", type=float, default=None, help="per-position acceptance (default: the testbed fit)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="also static and CUDA-graph rows on the first workload")
    p.add_argument("--plain-random", action="store_true",
                   help="leave the random weights as drawn (greedy near-ties may flip; see _stable_greedy)")
    p.add_argument("--no-cudnn-attention", action="store_true",
                   help="disable cuDNN's scaled-dot-product attention for the run (a diagnostic)")
    p.add_argument("--same-prompt", action="store_true",
                   help="every call decodes the same prompt (the default gives each call a fresh one: with one prompt, "
                        "per-shape attention plans cached by the first call flatter every later one)")
    p.add_argument("--no-attention-rows", action="store_true",
                   help="skip the rows that run with attention='torch' (torch's own backend choice)")
    p.add_argument("--pinned-auto-row", action="store_true",
                   help="a diagnostic row: the adaptive drafter held at the fixed row's K (does its path cost per step?)")
    p.add_argument("--other-fixed-k", default="",
                   help="comma-separated draft lengths for more fixed-K rows (e.g. 1,3): is auto's choice the best K?")
    p.add_argument("--deadline-s", type=float, default=None, help="start no workload after this many seconds")
    p.add_argument("--order", choices=ORDERS, default="balanced",
                   help="method order within rounds (balanced: every method follows every other equally often)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        other_fixed_k = tuple(int(k) for k in a.other_fixed_k.split(",") if k.strip())
    except ValueError:
        raise SystemExit(f"mmspec bench gpu: --other-fixed-k must be comma-separated ints, got {a.other_fixed_k!r}") from None
    try:
        workloads = tuple((w.split(":")[0], int(w.split(":")[1])) for w in a.workloads.split(","))
        kw = {} if a.alpha is None else {"alpha": a.alpha}
        config = GpuBenchConfig(shape=a.shape, device=a.device, dtype=a.dtype, workloads=workloads,
                                max_new_tokens=a.max_new_tokens, num_draft_tokens=a.num_draft_tokens,
                                repeats=a.repeats, compile=a.compile, deadline_s=a.deadline_s,
                                stable_greedy=not a.plain_random,
                                cudnn_attention=not a.no_cudnn_attention, fresh_prompts=not a.same_prompt,
                                attention_rows=not a.no_attention_rows, pinned_auto=a.pinned_auto_row,
                                other_fixed_k=other_fixed_k, order=a.order, **kw)
    except (ValueError, IndexError) as e:
        raise SystemExit(f"mmspec bench gpu: {e}") from None

    report = run(config, progress=lambda m: print(m, file=sys.stderr, flush=True), json_path=a.json)
    print(format_table(report))
    if a.json:
        print(f"wrote {a.json}")
    return 0
