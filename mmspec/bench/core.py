"""Core speed benchmark: plain `generate`, transformers' assisted generation and mmspec,
side by side in one run, on the locally built pair of `mmspec.bench.pair`.

For each batch size it reports tokens/s, the speed-up over plain decoding of the same
target on the same prompts (both against stock transformers and against plain decoding on
the row's own linear kernels), the mean accepted length, and the *ideal* speed-up: the
time of exactly the run's model forwards replayed with no engine around them (`_replay`),
timed in the same interleaved rounds, so the engine's own overhead shows as
`efficiency = measured / ideal`. mmspec runs float32 CPU models on prepacked weights by
default (mmspec/models/prepack.py); with `compare_kernels` every method also runs on the
other kernels, so the kernel gain and the speculative gain can be read apart. Greedy
outputs are checked to be identical to plain decoding. Timings are medians of `repeats`
runs after one warm-up.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from mmspec.bench import check_order
from mmspec.bench.pair import PairConfig, build_pair, count_parameters, greedy_agreement
from mmspec.models.hf_target import HFTarget


@dataclass(frozen=True)
class BenchConfig:
    batch_sizes: tuple[int, ...] = (1, 8)
    num_draft_tokens: tuple[int, ...] = (4, 3)  # per batch size (larger batches verify more tokens)
    max_new_tokens: int = 64
    prompt_lengths: tuple[int, int] = (12, 32)
    repeats: int = 3
    threads: int | None = None
    compare_kernels: bool = True  # also run every method on the other linear kernels
    pair: PairConfig = field(default_factory=PairConfig)
    # Method order within rounds (`_interleaved`): "balanced" since session 52 (a Williams design,
    # as `mmspec bench core` since session 50); the earlier reports ran "alternate".
    order: str = "balanced"

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes must be ints >= 1, got {self.batch_sizes}")
        if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in self.num_draft_tokens):
            raise ValueError(f"draft tokens must be ints >= 1, got {self.num_draft_tokens}")
        if len(self.num_draft_tokens) != len(self.batch_sizes):
            raise ValueError("num_draft_tokens needs one entry per batch size")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        check_order(self.order)


def _interleaved(methods: dict, repeats: int, samples: dict | None = None, order: str = "alternate"):
    """Time each method `repeats` times in rounds after a warm-up round, so slow drifts of the
    machine hit every method alike; returns medians. Pass a dict as `samples` to get every
    round's seconds per method too (for paired per-round ratios).

    `order="alternate"`: rounds run A B C, C B A, A B C, ... (a method's neighbours are always
    the same two). `order="balanced"`: round r runs row r of a Williams design over the
    methods (`williams_rows`), so a method follows a different one in each of the first
    n - 1 rounds (n even) and, over a full cycle of rows, every other method equally often:
    a method whose speed depends on what ran before it (the allocator's state after a call
    with larger buffers, say) is not favoured or handicapped by where the list put it."""
    check_order(order)
    outs = {name: fn() for name, fn in methods.items()}  # warm-up
    rounds = {} if samples is None else samples
    rounds.update({name: [] for name in methods})
    items = list(methods.items())
    rows = williams_rows(len(items)) if order == "balanced" else [list(range(len(items))),
                                                                 list(range(len(items)))[::-1]]
    for r in range(repeats):
        for i in rows[r % len(rows)]:
            name, fn = items[i]
            t0 = time.perf_counter()
            outs[name] = fn()
            rounds[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in rounds.items()}, outs


def williams_rows(n: int) -> list[list[int]]:
    """A Williams design (Williams 1949, "Experimental designs balanced for the estimation of
    residual effects of treatments"): orders of 0..n-1 in which every ordered pair (a, b) has
    b run right after a equally often: once over the n rows for even n, twice over the 2n rows
    (each row and its reverse) for odd n. Row r is the base row 0, 1, n-1, 2, n-2, ... plus r
    (mod n)."""
    if n < 1:
        raise ValueError(f"need at least one method, got {n}")
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    rows = [[(b + r) % n for b in base] for r in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def _cycling(fn, count: int):
    """A zero-argument method for `_interleaved` whose i-th call runs `fn(i % count)` and returns
    (i % count, output): the warm-up call gets prompt set 0 and round r set r + 1, for every
    method alike. The latest output per set is kept in `.outs`."""
    calls = [0]

    def call():
        j = calls[0] % count
        calls[0] += 1
        call.outs[j] = fn(j)
        return j, call.outs[j]
    call.outs = {}
    return call


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


def _record_forwards(fn, models: dict):
    """Run `fn()` once with forward pre-hooks on `models` ({name: module}); returns the
    output and the list of (name, rows, width) of every forward, in order."""
    log, handles = [], []
    for name, model in models.items():
        def hook(module, args, kwargs, name=name):
            ids = kwargs.get("input_ids", args[0] if args else None)
            log.append((name, ids.shape[0], ids.shape[1]))
        handles.append(model.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        out = fn()
    finally:
        for h in handles:
            h.remove()
    return out, log


def _replay(models: dict, ids, mask, log):
    """The ideal engine for a speculative run: exactly its model forwards (`log`, from
    `_record_forwards`: which model, how many rows, how many new tokens) and nothing else.
    Each model's first forward is the prompt's prefill; the others run on plain
    DynamicCaches built before timing (one per model and row count) and are cropped away
    again, so the context stays at the prompt (slightly cheaper attention than the real
    run's: a conservative efficiency). Timed in the same rounds as the methods:
    `efficiency = replay time / measured time`."""
    from transformers import DynamicCache

    from mmspec.models.hf_cache import cache_argument

    vocab = min(m.config.vocab_size for m in models.values())
    width = max(w for _, _, w in log)
    new = torch.randint(3, vocab, (ids.shape[0], width), generator=torch.Generator().manual_seed(0)).to(ids.device)
    caches, seen, plan = {}, set(), []
    with torch.no_grad():
        for name, b, w in log:
            if name not in seen:  # the prefill
                seen.add(name)
                plan.append((models[name], None, b, w))
                continue
            if (name, b) not in caches:
                cache = DynamicCache(config=models[name].config)
                models[name](input_ids=ids[:b], attention_mask=mask[:b], use_cache=True,
                             **{cache_argument(models[name]): cache})
                caches[name, b] = cache
            plan.append((models[name], caches[name, b], b, w))

    @torch.no_grad()
    def replay():
        for model, cache, b, w in plan:
            if cache is None:
                model(input_ids=ids[:b], attention_mask=mask[:b])
            else:
                model(input_ids=new[:b, :w], use_cache=True, **{cache_argument(model): cache})
                cache.crop(-w)  # transformers 5.x: a negative count of tokens to drop
        return None

    return replay


def _assisted_setup(drafter, K: int) -> None:
    """transformers' assisted generation with a fixed K: constant schedule, no early stop."""
    drafter.generation_config.num_assistant_tokens = K
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0


def run(config: BenchConfig = BenchConfig(), progress=print, checkpoint=None) -> dict:
    """Rows per batch size. `kernels` says which linear kernels a row's models run on:
    "stock" (`F.linear`, what plain transformers uses) or "prepacked" (oneDNN prepacked
    weights, mmspec's default on float32 CPU models, see mmspec/models/prepack.py). With
    `compare_kernels` every method also runs on the other kernels, so the speculative gain
    and the kernel gain can be read apart (transformers' generate runs on mmspec's packed
    view of the same models)."""
    import mmspec
    from mmspec.drafters import ModelDrafter
    from mmspec.models.prepack import kernels_of, maybe_packed, should_prepack

    if config.threads:
        torch.set_num_threads(config.threads)
    target, drafter = build_pair(config.pair)
    for m in (target, drafter):
        m.generation_config.eos_token_id = None  # measure fixed-length generations
    packed = should_prepack(target, "auto") and should_prepack(drafter, "auto")
    models = {"stock": (target, drafter)}
    if packed:  # mmspec's "auto" kernels: the packed view, each row count on its measured-faster kernel
        models["prepacked"] = (maybe_packed(target), maybe_packed(drafter))
    probe, _ = _prompts(8, config.prompt_lengths, config.pair.vocab_size, seed=99)
    info = {
        "target_params_M": round(count_parameters(target) / 1e6, 1),
        "drafter_params_M": round(count_parameters(drafter) / 1e6, 1),
        "greedy_agreement": round(greedy_agreement(target, drafter, probe), 3),
        "threads": torch.get_num_threads(),
        "device": "cpu",
        "mmspec_kernels": kernels_of(models["prepacked"][0], target) if packed else "stock",
        "order": config.order,
    }
    progress(f"pair: target {info['target_params_M']}M params, drafter {info['drafter_params_M']}M params, "
             f"greedy agreement {info['greedy_agreement']:.0%} (built locally, random weights; see mmspec/bench/pair.py)")
    default = "prepacked" if packed else "stock"
    kernel_sets = list(models) if config.compare_kernels else [default]
    rows = []
    N = config.max_new_tokens
    for B, K in zip(config.batch_sizes, config.num_draft_tokens):
        ids, mask = _prompts(B, config.prompt_lengths, config.pair.vocab_size, seed=B)
        gen_args = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=N, pad_token_id=0)
        methods = {("plain generate", "stock"): lambda: target.generate(**gen_args)}  # the reference, always
        for kern in kernel_sets:
            t_m, d_m = models[kern]
            methods[("plain generate", kern)] = lambda t_m=t_m: t_m.generate(**gen_args)
            if B == 1:  # transformers' assisted generation refuses batch > 1
                _assisted_setup(d_m, K)
                methods[("transformers assisted", kern)] = lambda t_m=t_m, d_m=d_m: t_m.generate(**gen_args, assistant_model=d_m)
            # "auto": the wrap runs the very view (and measured kernel policy) that generate runs on
            # above; True would be a view of its own, packed at every row count.
            pre = "auto" if kern == "prepacked" else False
            methods[("mmspec", kern)] = lambda pre=pre: mmspec.speculative_generate(
                HFTarget(target, prepack=pre), ModelDrafter(drafter, K, prepack=pre), ids, mask,
                temperature=0, max_new_tokens=N, pad_token_id=0)
        names = sorted({m for m, _ in methods}, key=["plain generate", "transformers assisted", "mmspec"].index)
        progress(f"batch {B}: {', '.join(names)} (K={K}) on {' and '.join(kernel_sets)} kernels, interleaved "
                 f"({config.order} order), {config.repeats} timed rounds ...")
        for kern in kernel_sets:  # the ideal engine for each mmspec run (an extra, untimed run records it)
            named = {"target": models[kern][0], "drafter": models[kern][1]}
            _, log = _record_forwards(methods[("mmspec", kern)], named)
            methods[("ideal", kern)] = _replay(named, ids, mask, log)
        times, outs = _interleaved(methods, config.repeats, order=config.order)
        t_plain, ref = times[("plain generate", "stock")], outs[("plain generate", "stock")]
        for (name, kern), t in times.items():
            if name == "ideal":
                continue
            out = outs[(name, kern)]
            stats = out.stats if name == "mmspec" else None
            seqs = out.sequences if name == "mmspec" else out
            row = {
                "batch": B, "method": name, "kernels": kern, "K": K if name != "plain generate" else None,
                "seconds": round(t, 4), "tokens_per_s": round(B * N / t, 1),
                "speedup_vs_plain": round(t_plain / t, 3),
                "speedup_vs_plain_same_kernels": round(times[("plain generate", kern)] / t, 3),
                "mean_accepted_length": round(stats.mean_accepted_length, 3) if stats else None,
                "ideal_speedup": None, "efficiency": None,
                "identical_to_plain": torch.equal(seqs, ref),
            }
            if stats is not None:
                ideal_time = times[("ideal", kern)]  # the same forwards, same kernels, no engine
                row["ideal_speedup"] = round(t_plain / ideal_time, 3)
                row["efficiency"] = round(ideal_time / t, 3)
                for peer_kern in kernel_sets:
                    if ("transformers assisted", peer_kern) in times:
                        row[f"speedup_vs_assisted_{peer_kern}"] = round(times[("transformers assisted", peer_kern)] / t, 3)
            rows.append(row)
        if checkpoint is not None:  # each batch size's rows written as they come (--json)
            checkpoint({"info": info, "config": asdict(config), "rows": rows})
    return {"info": info, "config": asdict(config), "rows": rows}


def format_table(report: dict) -> str:
    """The side-by-side table; `vs plain` is against plain `generate` on stock kernels (what
    transformers users run), `same kern.` against plain `generate` on the row's own kernels."""
    head = (f"{'batch':>5} {'method':<22} {'kernels':<9} {'K':>2} {'tok/s':>7} {'vs plain':>8} {'same kern.':>10} "
            f"{'acc.len':>7} {'ideal':>6} {'effic.':>6} {'same':>5}")
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        lines.append(
            f"{r['batch']:>5} {r['method']:<22} {r['kernels']:<9} {r['K'] or '':>2} {r['tokens_per_s']:>7.1f} "
            f"{r['speedup_vs_plain']:>7.2f}x {r['speedup_vs_plain_same_kernels']:>9.2f}x {r['mean_accepted_length'] or '':>7} "
            f"{(str(r['ideal_speedup']) + 'x') if r['ideal_speedup'] else '':>6} "
            f"{(format(r['efficiency'], '.0%')) if r['efficiency'] else '':>6} {'yes' if r['identical_to_plain'] else 'NO':>5}"
        )
    default = report["info"].get("mmspec_kernels", "stock")
    for r in report["rows"]:
        if r["method"] != "mmspec":
            continue
        for key, value in r.items():
            if key.startswith("speedup_vs_assisted_"):
                peer = key.removeprefix("speedup_vs_assisted_")
                what = ("as each library runs by default" if r["kernels"] == default and peer == "stock"
                        else "same kernels" if peer == r["kernels"] else "mixed kernels")
                if what == "mixed kernels":
                    continue
                lines.append(f"batch {r['batch']}: mmspec ({r['kernels']}) runs at {value:.2f}x the speed of transformers' "
                             f"assisted generation ({peer}) [{what}]")
    return "\n".join(lines)
