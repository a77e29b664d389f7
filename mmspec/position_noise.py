"""Gumbel noise keyed by position: sampling whose output does not depend on the drafter.

Gumbel-max sampling draws a token from p as ``argmax(log p + g)`` with ``g`` a vector of i.i.d.
Gumbel(0, 1) variables. If every generated position ``t`` of every row owns its own ``g_t``,
drawn from the request's seed and nothing else, then decoding is a deterministic function of
(target, prompt, seed): ``y_t = argmax(log p(. | y_<t) + g_t)``. Each ``y_t`` is still an exact
sample from ``p(. | y_<t)`` (``g_t`` is independent of the prefix, which depends on
``g_<t`` only), so the sequence is distributed exactly like ancestral sampling.

Speculative verification of such a sequence is greedy verification on the perturbed target,
``argmax(log p + g)``: a drafted token is kept while it equals the perturbed argmax, and the
first mismatch is replaced by it. The emitted tokens are then *the same tokens* plain decoding
with the same seed emits, whatever the drafter, its draft length, its tree, or an adaptive
choice made from timings (Daliri, Musco and Suresh, "Coupling without Communication and
Drafter-Invariant Speculative Decoding", arXiv 2408.07978, 2024). A drafter that drafts with
the same noise (``argmax(log q + g_t)``) is accepted wherever the two perturbed argmaxes agree,
which happens with probability at least (1 - TV) / (1 + TV) for a total variation TV between
p and q (the same paper); exact speculative sampling reaches 1 - TV, so this is a trade of a
little acceptance for reproducibility.

Computed as an exponential race: with ``E = -log(u)`` i.i.d. Exp(1) (so ``g = -log E``),
``argmax(log p + g) = argmax(p / E)``: one logarithm per noise value instead of two, none of p,
and a token of probability 0 can never win. `PositionNoise` holds the request's 63-bit seed (one
draw from the caller's generator, so a seeded generator reproduces the request) and makes the
noise of rows and positions on demand in blocks of `BLOCK` positions, each block from a
`torch.Generator` seeded by mixing (seed, row, block) with SplitMix64, so a position's noise is
the same whichever step or call asks for it. It is drawn in float64 on the generator's device,
as every draw of the loop (`mmspec.sampling.draw`): a CPU generator gives the same numbers for
a CPU and a CUDA model, a CUDA generator draws on the GPU (faster for large vocabularies, other
numbers). Each block is kept in the dtype and on the device it
is asked for until the row's positions have moved past it. Rows are the batch rows of the
request (row 0 is the first prompt).
"""

from __future__ import annotations

import torch

from mmspec.sampling import draw
from mmspec.tree import ancestors, chain_verify_name, depths, verify_draft
from mmspec.types import Draft, Verdict

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class PositionNoise:
    """Exp(1) race noise [V] for every (row, position) of one request (see module docstring)."""

    BLOCK = 16

    def __init__(self, seed: int, vocab_size: int, device="cpu"):
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        self.seed, self.vocab_size = seed, vocab_size
        self.device = torch.device(device)
        # row -> block -> {(dtype, device): noise [BLOCK, V]} (float64 on `device` always present)
        self._blocks: dict[int, dict[int, dict]] = {}

    @classmethod
    def for_request(cls, generator: torch.Generator | None, vocab_size: int) -> "PositionNoise":
        """One draw from `generator` (torch's global generator when None) seeds the request."""
        seed = int(draw(torch.randint, 0, 2**63 - 1, (1,), generator=generator))
        return cls(seed, vocab_size, generator.device if generator is not None else "cpu")

    def _block(self, row: int, block: int, dtype, device) -> torch.Tensor:
        copies = self._blocks.setdefault(row, {}).get(block)
        if copies is None:
            mixed = _splitmix64(_splitmix64(_splitmix64(self.seed) ^ row) ^ block) & ((1 << 63) - 1)
            gen = torch.Generator(device=self.device).manual_seed(mixed)
            u = torch.rand(self.BLOCK, self.vocab_size, generator=gen, dtype=torch.float64, device=self.device)
            # Exp(1) = -log(u); u = 0 (probability ~1e-16) would give inf: clamp to the smallest normal
            exp1 = (-torch.log(u.clamp_min(torch.finfo(torch.float64).tiny))).clamp_min(torch.finfo(torch.float32).tiny)
            copies = self._blocks[row][block] = {(torch.float64, self.device): exp1}
        key = (dtype, torch.device(device) if device is not None else self.device)
        out = copies.get(key)
        if out is None:
            out = copies[key] = copies[(torch.float64, self.device)].to(device=key[1], dtype=dtype)
        return out

    def race(self, rows: list[int], starts: list[int], length: int, *, dtype=torch.float32,
             device=None) -> torch.Tensor:
        """Exp(1) noise E [len(rows), length, V] of positions start .. start + length - 1 of each row
        (the Gumbel-max token is ``argmax(p / E)``). Blocks wholly before a row's start are
        forgotten (positions only move forwards)."""
        B = self.BLOCK
        out = []
        for row, start in zip(rows, starts):
            if start < 0:
                raise ValueError(f"positions must be >= 0, got start {start} for row {row}")
            blocks = self._blocks.get(row, {})
            first, last = start // B, (start + length - 1) // B
            for old in [b for b in blocks if b < first]:
                del blocks[old]
            if length == 0:
                out.append(torch.zeros(0, self.vocab_size, dtype=dtype, device=device))
                continue
            parts = [self._block(row, b, dtype, device) for b in range(first, last + 1)]
            span = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
            out.append(span[start - first * B: start - first * B + length])
        return torch.stack(out, 0)

    def gumbel(self, rows: list[int], starts: list[int], length: int, *, dtype=torch.float32,
               device=None) -> torch.Tensor:
        """The same noise as Gumbel(0, 1) variables, ``g = -log E`` [len(rows), length, V]."""
        return -torch.log(self.race(rows, starts, length, dtype=dtype, device=device))

    def perturb(self, probs: torch.Tensor, rows: list[int], starts: list[int],
                parents: torch.Tensor | None = None) -> torch.Tensor:
        """The one-hot [R, M, V] of `argmax` (a distribution the rules' chain and tree walks take)."""
        return torch.nn.functional.one_hot(self.argmax(probs, rows, starts, parents), probs.shape[-1]).to(probs.dtype)

    def verdict(self, rule, draft: Draft, probs: torch.Tensor, rows: list[int], starts: list[int],
                method: str | None = None) -> Verdict:
        """The loop's verdict under a position-keyed rule: chains from the perturbed argmax tokens
        (`rule.verify_top`), trees by the rule's tree walk over their one-hots; a rule whose own
        `verify` runs (`method`, see `mmspec.tree.chain_verify_name`) gets the one-hots too."""
        method = method or chain_verify_name(rule)
        if not draft.is_chain or not hasattr(rule, "verify_top") or method != "verify_unchecked":
            return verify_draft(rule, draft, self.perturb(probs, rows, starts, None if draft.is_chain else draft.parents),
                                method=method)
        res = rule.verify_top(draft.tokens, self.argmax(probs, rows, starts))
        B, N = draft.tokens.shape
        path = torch.arange(N + 1, device=probs.device).expand(B, N + 1)
        return Verdict(path=path, num_accepted=res.num_accepted, next_tokens=res.next_tokens)

    def argmax(self, probs: torch.Tensor, rows: list[int], starts: list[int],
               parents: torch.Tensor | None = None) -> torch.Tensor:
        """probs [R, M, V] -> ``argmax(log probs + g) = argmax(probs / E)`` [R, M]: the token
        Gumbel-max sampling emits there. Position j of row i is ``starts[i] + j`` (a chain), or
        with a tree's `parents` [R, M - 1] (``mmspec.tree`` layout, verify position 0 = root)
        ``starts[i]`` + the depth of verify position j."""
        R, M, V = probs.shape
        offsets = None if parents is None else depths(ancestors(parents))
        if V != self.vocab_size:
            raise ValueError(f"probs have {V} tokens, the noise {self.vocab_size}")
        length = M if offsets is None else int(offsets.max()) + 1  # SYNC: tree depths (host needs the span)
        e = self.race(rows, starts, length, dtype=probs.dtype, device=probs.device)
        if offsets is not None:
            e = e.gather(1, offsets.long().unsqueeze(-1).expand(R, M, V))
        return (probs / e).argmax(-1)


class DraftsWithPositionNoise:
    """Mixin of chain drafters that draw their drafts with the loop's noise when it offers it."""

    _shared_noise = None  # set by the loop under acceptance="invariant"

    def set_position_noise(self, noise) -> None:
        """The loop's position-keyed race noise under acceptance="invariant" (``noise(n, dtype) ->
        E [B, n, V]`` for the n positions after the root), or None: chains then draft
        ``argmax(q / E)`` (= ``argmax(log q + g)``) with the verifier's noise (distributed as q,
        accepted where the two perturbed argmaxes agree); trees rank each level's children by
        ``log q - log E`` (Gumbel top-k, `drafters.tree_grow.grow_tree`)."""
        self._shared_noise = noise

    def _chain_noise(self, n: int, sampling, like: torch.Tensor) -> torch.Tensor | None:
        """The race noise E [B, n, V] of a chain's n draft positions in the math dtype of `like`
        (the drafter's logits), or None without the loop's noise or when decoding greedily."""
        if self._shared_noise is None or sampling.greedy:
            return None
        return self._shared_noise(n, torch.float64 if like.dtype == torch.float64 else torch.float32)

    def _tree_noise(self, depth: int, sampling, dtype) -> dict:
        """`grow_tree`'s noise arguments for a tree of `depth` levels (none without the loop's noise
        or when decoding greedily)."""
        if self._shared_noise is None or sampling.greedy:
            return {}
        return {"noise": self._shared_noise(depth, dtype), "sampling": sampling}
