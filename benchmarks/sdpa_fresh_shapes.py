"""What one attention call costs on a shape seen for the first time, per backend, against the
same shape again (CUDA). Speculative decoding meets a new (queries, key length) shape on nearly
every verify; a backend that builds a plan per shape pays it there. Prints one line per backend
and form; `--json` writes the figures. Usage: python benchmarks/sdpa_fresh_shapes.py [--json F]."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--keys", type=int, default=600, help="key lengths start here")
    p.add_argument("--shapes", type=int, default=6)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
    default = None  # torch's own choice among everything enabled
    results, next_key = [], [a.keys]
    for form, Q, masked in (("verify Q=6, float mask", 6, True), ("one token, no mask", 1, False),
                            ("verify Q=6, no mask, causal", 6, False)):
        for name, backend in [("torch default", default)] + list(backends.items()):
            fresh, again = [], []
            for _ in range(a.shapes):
                next_key[0] += 7
                S = next_key[0]
                q = torch.randn(1, a.heads, Q, a.head_dim, device=dev, dtype=dtype)
                k = torch.randn(1, a.heads, S, a.head_dim, device=dev, dtype=dtype)
                v = torch.randn_like(k)
                mask = None
                if masked:
                    vis = torch.ones(Q, S, dtype=torch.bool, device=dev).tril(S - Q)
                    mask = torch.zeros(1, 1, Q, S, dtype=dtype, device=dev).masked_fill(~vis, torch.finfo(dtype).min)
                causal = not masked and Q > 1 and Q == S

                def call():
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
                ctx = sdpa_kernel([backend]) if backend is not None else sdpa_kernel(list(backends.values()))
                try:
                    with ctx:
                        fresh.append(timed(call))
                        again.append(statistics.median(timed(call) for _ in range(3)))
                except RuntimeError as e:
                    fresh = again = None
                    err = str(e).split("\n")[0][:120]
                    break
            row = {"form": form, "backend": name}
            if fresh is None:
                row["error"] = err
                print(f"{form:<30} {name:<14} not available: {err}")
            else:
                row.update(fresh_ms=round(statistics.median(fresh[1:]), 3), first_ms=round(fresh[0], 3),
                           repeat_ms=round(statistics.median(again), 3))
                print(f"{form:<30} {name:<14} fresh shape {row['fresh_ms']:8.3f} ms   same shape again "
                      f"{row['repeat_ms']:7.3f} ms   (very first {row['first_ms']:.1f} ms)")
            results.append(row)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "heads": a.heads, "head_dim": a.head_dim, "dtype": "bfloat16"}
    print(info)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"info": info, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
