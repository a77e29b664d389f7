"""Core speed benchmark: plain `generate`, transformers' assisted generation and mmspec,
side by side in one run, on the locally built pair of `mmspec.bench.pair`.

For each batch size it reports tokens/s, the speed-up over plain decoding of the same
target on the same prompts, the mean accepted length, and the *ideal* speed-up that the
measured acceptance and per-call costs predict (target forwards over K+1 tokens and drafter
forwards timed on their own with a plain DynamicCache), so the engine's own overhead shows
as `efficiency = measured / ideal`. Greedy outputs are checked to be identical to plain
decoding. Timings are medians of `repeats` runs after one warm-up.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from mmspec.bench.pair import PairConfig, build_pair, count_parameters, greedy_agreement


@dataclass(frozen=True)
class BenchConfig:
    batch_sizes: tuple[int, ...] = (1, 8)
    num_draft_tokens: tuple[int, ...] = (4, 3)  # per batch size (larger batches verify more tokens)
    max_new_tokens: int = 64
    prompt_lengths: tuple[int, int] = (12, 32)
    repeats: int = 3
    threads: int | None = None
    pair: PairConfig = field(default_factory=PairConfig)

    def __post_init__(self) -> None:
        if len(self.num_draft_tokens) != len(self.batch_sizes):
            raise ValueError("num_draft_tokens needs one entry per batch size")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")


def _median_time(fn, repeats: int):
    fn()  # warm-up
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def _interleaved(methods: dict, repeats: int):
    """Time each method `repeats` times in rounds (A, B, C, A, B, C, ...) after a warm-up
    round, so slow drifts of the machine hit every method alike; returns medians."""
    outs = {name: fn() for name, fn in methods.items()}  # warm-up
    samples = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in samples.items()}, outs


def _prompts(batch: int, lengths: tuple[int, int], vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lengths[0], lengths[1] + 1, (batch,), generator=g).tolist()
    L = max(lens)
    ids = torch.zeros(batch, L, dtype=torch.long)
    mask = torch.zeros(batch, L, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, L - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[b, L - n :] = 1
    return ids, mask


@torch.no_grad()
def _forward_cost(model, batch: int, context: int, width: int, repeats: int = 5) -> float:
    """Seconds of one forward over `width` new tokens after `context` cached tokens."""
    from transformers import DynamicCache

    ids = torch.randint(3, model.config.vocab_size, (batch, context + width))
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True)
    def step():
        model(input_ids=ids[:, context:], past_key_values=cache, use_cache=True)
        cache.crop(-width)  # transformers 5.x: a negative count of tokens to drop
    return _median_time(step, repeats)[0]


def run(config: BenchConfig = BenchConfig(), progress=print) -> dict:
    import mmspec
    from mmspec.drafters import ModelDrafter

    if config.threads:
        torch.set_num_threads(config.threads)
    target, drafter = build_pair(config.pair)
    for m in (target, drafter):
        m.generation_config.eos_token_id = None  # measure fixed-length generations
    probe, _ = _prompts(8, config.prompt_lengths, config.pair.vocab_size, seed=99)
    info = {
        "target_params_M": round(count_parameters(target) / 1e6, 1),
        "drafter_params_M": round(count_parameters(drafter) / 1e6, 1),
        "greedy_agreement": round(greedy_agreement(target, drafter, probe), 3),
        "threads": torch.get_num_threads(),
        "device": "cpu",
    }
    progress(f"pair: target {info['target_params_M']}M params, drafter {info['drafter_params_M']}M params, "
             f"greedy agreement {info['greedy_agreement']:.0%} (built locally, random weights; see mmspec/bench/pair.py)")
    rows = []
    N = config.max_new_tokens
    for B, K in zip(config.batch_sizes, config.num_draft_tokens):
        ids, mask = _prompts(B, config.prompt_lengths, config.pair.vocab_size, seed=B)
        gen_args = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=N, pad_token_id=0)
        methods = {"plain generate": lambda: target.generate(**gen_args)}
        if B == 1:  # transformers' assisted generation refuses batch > 1
            drafter.generation_config.num_assistant_tokens = K
            drafter.generation_config.num_assistant_tokens_schedule = "constant"
            drafter.generation_config.assistant_confidence_threshold = 0.0
            methods["transformers assisted"] = lambda: target.generate(**gen_args, assistant_model=drafter)
        methods["mmspec"] = lambda: mmspec.speculative_generate(
            target, ModelDrafter(drafter, K), ids, mask, temperature=0, max_new_tokens=N, pad_token_id=0)
        progress(f"batch {B}: {', '.join(methods)} (K={K}), interleaved, {config.repeats} timed rounds ...")
        times, outs = _interleaved(methods, config.repeats)
        t_plain, ref = times["plain generate"], outs["plain generate"]
        results = {}
        for name in methods:
            out = outs[name]
            if name == "mmspec":
                results[name] = (times[name], out.stats, torch.equal(out.sequences, ref))
            else:
                results[name] = (times[name], None, torch.equal(out, ref))
        t_mm, out_mm = times["mmspec"], outs["mmspec"]
        # Ideal: the same number of target and drafter calls with no engine overhead at all.
        ctx = ids.shape[1] + N // 2
        st = out_mm.stats
        t_verify = _forward_cost(target, B, ctx, K + 1)
        t_draft = _forward_cost(drafter, B, ctx, 1)
        ideal_time = st.target_calls * t_verify + st.draft_calls * t_draft + _forward_cost(target, B, 1, ids.shape[1], 1)
        ideal = t_plain / ideal_time
        for name, (t, stats, same) in results.items():
            rows.append({
                "batch": B, "method": name, "K": K if name != "plain generate" else None,
                "seconds": round(t, 4), "tokens_per_s": round(B * N / t, 1),
                "speedup_vs_plain": round(t_plain / t, 3),
                "mean_accepted_length": round(stats.mean_accepted_length, 3) if stats else None,
                "ideal_speedup": round(ideal, 3) if name == "mmspec" else None,
                "efficiency": round((t_plain / t) / ideal, 3) if name == "mmspec" else None,
                "identical_to_plain": same,
            })
        if "transformers assisted" in results:
            rows[-1]["speedup_vs_assisted"] = round(results["transformers assisted"][0] / t_mm, 3)
    return {"info": info, "config": asdict(config), "rows": rows}


def format_table(report: dict) -> str:
    head = f"{'batch':>5} {'method':<22} {'K':>2} {'tok/s':>8} {'speedup':>8} {'acc.len':>8} {'ideal':>6} {'effic.':>6} {'same':>5}"
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        lines.append(
            f"{r['batch']:>5} {r['method']:<22} {r['K'] or '':>2} {r['tokens_per_s']:>8.1f} "
            f"{r['speedup_vs_plain']:>7.2f}x {r['mean_accepted_length'] or '':>8} "
            f"{(str(r['ideal_speedup']) + 'x') if r['ideal_speedup'] else '':>6} "
            f"{(format(r['efficiency'], '.0%')) if r['efficiency'] else '':>6} {'yes' if r['identical_to_plain'] else 'NO':>5}"
        )
    for r in report["rows"]:
        if "speedup_vs_assisted" in r:
            lines.append(f"batch {r['batch']}: mmspec is {r['speedup_vs_assisted']:.2f}x faster than transformers' assisted generation")
    return "\n".join(lines)


def save(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
