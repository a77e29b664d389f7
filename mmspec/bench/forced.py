"""`ForcedDrafter`: a real drafter whose proposals are replaced by a scripted acceptance profile.

What it is for: timing the engine at real model sizes without trained weights. A 7B target
with random weights and a random 1-layer drafter agree on almost nothing, so a benchmark of
them would measure speculation at ~0% acceptance. `ForcedDrafter` wraps a real drafter (its
forwards run and cost what they cost) and, after each `propose`, replaces the proposed tokens
by a script built from the target's own greedy continuation: every position t of row b is
"easy" with probability `alpha` (the drafter proposes the target's token there) or "hard"
(it proposes a wrong token). A chain drafted from position p is therefore accepted up to the
first hard position, whatever draft length the engine picks, so fixed K and `"auto"` face the
same text. With i.i.d. positions the accepted length of a K-token chain is distributed as
with a per-depth acceptance rate `alpha` (E = (1 - alpha^(K+1)) / (1 - alpha)).

The verification is the engine's own, so the output is still the target's greedy output: if
the target's numerics make a run's greedy output leave the script's reference (bfloat16
verify shapes differ from one-token decoding), the realised acceptance drops after that point;
the benchmark reports the realised accepted length and whether the output matched.

Greedy only (temperature 0): the scripted tokens carry no draft distribution. Chains only.
Used by mmspec/bench/gpu.py; nothing here is a method users would run.
"""

from __future__ import annotations

import torch

from mmspec.types import Draft


def scripted_tokens(reference: torch.Tensor, alpha: float, vocab_size: int, extra: int, seed: int = 0) -> torch.Tensor:
    """The script: reference tokens [B, N] with each position made wrong with probability
    1 - alpha (a fixed other token), padded with `extra` wrong tokens for drafts past the end."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if vocab_size < 2:
        raise ValueError("a forced script needs a vocabulary of at least 2 tokens")
    g = torch.Generator().manual_seed(seed)
    B, N = reference.shape
    ref = torch.cat([reference.cpu(), torch.zeros(B, extra, dtype=reference.dtype)], 1)
    easy = torch.rand(B, N + extra, generator=g) < alpha
    easy[:, N:] = False
    wrong = (ref + 1) % vocab_size
    return torch.where(easy, ref, wrong).to(reference.device)


class ForcedDrafter:
    """Wraps a chain drafter; its proposals are replaced by `script[b, pos_b : pos_b + k]`,
    where pos_b counts the row's committed new tokens (the root included)."""

    def __init__(self, inner, script: torch.Tensor):
        if getattr(inner, "tree", None) is not None:
            raise ValueError("ForcedDrafter scripts chains only; build the inner drafter without tree=")
        self.inner = inner
        self.script = script  # [B, N + extra], on the target's device
        self.pos: torch.Tensor | None = None

    def __getattr__(self, name):  # vocab_size, max_draft_nodes, features, adaptive, controller, ...
        return getattr(self.inner, name)

    def prefill(self, input_ids, attention_mask, target_out, model_inputs, max_new_tokens):
        if input_ids.shape[0] != self.script.shape[0]:
            raise ValueError(f"the script has {self.script.shape[0]} rows, the batch {input_ids.shape[0]}")
        self.inner.prefill(input_ids, attention_mask, target_out, model_inputs, max_new_tokens)
        self.rows = self.script
        # The loop's first token (from the prefill logits) is new token 0 and the first root.
        self.pos = torch.ones(input_ids.shape[0], dtype=torch.long, device=self.script.device)

    def propose(self, roots, sampling, generator) -> Draft:
        if not sampling.greedy:
            raise ValueError("ForcedDrafter scripts greedy decoding only (temperature=0)")
        draft = self.inner.propose(roots, sampling, generator)  # the real forwards, for their cost
        k = draft.tokens.shape[1]
        if k == 0:
            return draft
        cols = self.pos.unsqueeze(1) - 1 + torch.arange(1, k + 1, device=self.pos.device)
        cols = cols.clamp(max=self.rows.shape[1] - 1)
        tokens = self.rows.gather(1, cols)
        return Draft(tokens=tokens, parents=draft.parents, draft_probs=None, is_chain=True)

    def commit(self, info, target_out) -> None:
        self.inner.commit(info, target_out)
        self.pos = self.pos + info.num_accepted + 1

    def select_rows(self, rows, rows_host) -> None:
        self.inner.select_rows(rows, rows_host)
        self.rows = self.rows.index_select(0, rows)
        self.pos = self.pos.index_select(0, rows)
