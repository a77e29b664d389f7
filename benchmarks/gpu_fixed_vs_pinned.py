"""Why does a fixed-K ModelDrafter run slower than the adaptive drafter held at the same K on a GPU?

Sessions 38, 44 and 46 (H100, `mmspec bench gpu --pinned-auto-row`, Llama-2-7B shapes, batch 4) read
the fixed K = 5 row 6-20% behind "auto pinned K=5". This script times variants of the same
K = 5 chain side by side, interleaved, with the phases' device time (CUDA events) per call:

  fixed            ModelDrafter(drafter, 5), first run once over every prompt inside the MATH-only
                   attention context (as `mmspec bench gpu` does for its replay recording)
  fixed fresh      ModelDrafter(drafter, 5), never run before the timed rounds' warm-up
  pinned max8      ModelDrafter(drafter, "auto", max_draft_tokens=8), controller held at K = 5
  pinned max5      the same with max_draft_tokens=5 (the fixed drafter's KV region)

Session 46 (one H100 80GB HBM3, torch 2.11.0+cu130, batch 4, 4 rounds, run twice:
benchmarks/results/gpu_h100_s46_fixed_vs_pinned_b4_run{1,2}.json): fixed 1401 / 1401 ms a call,
fixed fresh 1414 / 1418, pinned max8 1411 / 1452, pinned max5 1420 / 1440; the same 42 verifies and
phase times within 4%. The drafters run alike; the bench's gap between its two rows lies in how
the bench times them, not in the fixed-K path.

Usage (an installed mmspec, as benchmarks/gpu_check.sh installs it; a CUDA machine): python benchmarks/gpu_fixed_vs_pinned.py [--batch 4] [--rounds 4] [--json F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    import mmspec
    from torch.nn.attention import SDPBackend

    from mmspec.adaptive import DraftLengthController
    from mmspec.attention_choice import context
    from mmspec.bench.forced import ForcedDrafter, scripted_tokens
    from mmspec.bench.gpu import WORKLOADS, GpuBenchConfig, _prompt_set, build_models
    from mmspec.drafters import ModelDrafter
    from mmspec.models.hf_target import HFTarget

    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="llama-2-7b", help="tiny: a CPU smoke run")
    a = ap.parse_args()
    cfg = GpuBenchConfig(workloads=(("text", a.batch),), device=a.device, shape=a.shape,
                         dtype="bfloat16" if a.device == "cuda" else "float32")
    target, drafter = build_models(cfg)
    V, N, K, dev = target.config.vocab_size, cfg.max_new_tokens, 5, a.device
    cuda = torch.device(dev).type == "cuda"
    count = a.rounds + 1
    prompts = [(i.to(dev), m.to(dev)) for i, m in _prompt_set(a.batch, WORKLOADS["text"], V, cfg.seed + a.batch, count)]
    with torch.no_grad(), context([SDPBackend.MATH]):
        refs = [target.generate(input_ids=i, attention_mask=m, do_sample=False, max_new_tokens=N, pad_token_id=0)
                for i, m in prompts]
    scripts = [scripted_tokens(r[:, i.shape[1]:], cfg.alpha, V, extra=12, seed=cfg.seed + p)
               for p, (r, (i, _)) in enumerate(zip(refs, prompts))]
    tgt = HFTarget(target)

    def pinned(kmax):
        d = ModelDrafter(drafter, "auto", max_draft_tokens=kmax)
        d.controller = DraftLengthController(kmax, warmup=(K,) * 10**6, probe_every=0)
        return d
    drafters = {"fixed": ModelDrafter(drafter, K), "fixed fresh": ModelDrafter(drafter, K),
                "pinned max8": pinned(8), "pinned max5": pinned(5)}

    def call(name, p):
        out = mmspec.speculative_generate(tgt, ForcedDrafter(drafters[name], scripts[p]), *prompts[p],
                                          temperature=0, max_new_tokens=N, pad_token_id=0)
        if cuda:
            torch.cuda.synchronize()
        return out
    with torch.no_grad():
        with context([SDPBackend.MATH]):  # what the bench's replay recording does with its fixed row
            for p in range(count):
                call("fixed", p)
        res = {n: [] for n in drafters}
        for r in range(count):
            for n in (list(drafters) if r % 2 == 0 else list(drafters)[::-1]):
                t0 = time.perf_counter()
                out = call(n, r)
                dt = time.perf_counter() - t0
                st = out.stats
                same = bool(torch.equal(out.sequences, refs[r]))
                if r:  # round 0 is the warm-up
                    res[n].append({"s": dt, "draft_s": st.draft_seconds, "verify_s": st.verify_seconds,
                                   "verifies": st.target_calls, "same": same})
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "batch": a.batch, "rows": {}}
    for n, v in res.items():
        row = {k: round(statistics.median(x[k] for x in v), 4) for k in ("s", "draft_s", "verify_s")}
        row.update(verifies=v[-1]["verifies"], same=all(x["same"] for x in v), calls_s=[round(x["s"], 4) for x in v])
        report["rows"][n] = row
        print(f"{n:12s} {row['s']*1e3:8.1f} ms  draft {row['draft_s']*1e3:7.1f}  verify {row['verify_s']*1e3:7.1f}  "
              f"verifies {row['verifies']}  same {row['same']}  calls {row['calls_s']}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
