"""`JacobiDrafter`: training-free self-drafting by Jacobi iteration, with coupled drafts.

Sources: Speculative Jacobi Decoding (SJD; Teng et al. 2024, arXiv 2410.01699; public code
github.com/tyshiwo1/Accelerating-T2I-AR-with-SJD): the target
verifies a window of W draft tokens in one forward; its own output at window position j
(conditioned on the possibly wrong drafts before j) is the next iteration's draft for the
position after j, so the unaccepted tail of the window is recycled instead of thrown away, and
the positions that enter the window fresh are initialised with random tokens. Coupled drafts
(SCD / MC-SJD, So et al., arXiv 2510.24211; public code github.com/junhyukso/SCD): each window position keeps its previous draft unless the
new distribution disagrees, so drafts stop flickering between iterations and the target's
conditional outputs downstream stay valid:

- `coupling="maximal"`: keep the previous draft y (drawn from q_old) with probability
  min(1, q_new(y) / q_old(y)), else draw from norm(max(q_new - q_old, 0)). The new draft is
  distributed exactly q_new (maximal coupling), and equal to y as often as possible.
- `coupling="gumbel"`: every absolute image position owns one Gumbel noise vector g, drawn
  once; its draft is argmax(log q + g) (Gumbel-max: distributed exactly q) at every iteration.
- `coupling=None`: a fresh sample from q_new each iteration (plain SJD).

Exactness: each draft is drawn from the q returned in `Draft.draft_probs`, and conditionally
on everything the verifier has seen (committed tokens, earlier drafts of the step, their
target distributions) its law is still q: the previous draft / the noise of a position only
ever fed forwards whose outputs sit at *later* positions, and a position leaves the window
as soon as the verifier examines it. So exact verification stays lossless (tested by
chi-square), and every rule works (SJD + GSD is what GSD runs; LANTERN).

The drafter reads the target's logits in `commit(info, target_out)` (for a CFG target they
are already guided: drafts follow the guided distribution); temperature / top-k / top-p are
applied in `propose`, exactly like the target's. Batched: every row keeps its own window,
shifted by its own accepted count. Greedy (temperature 0): drafts are the argmax of the
recycled logits (Jacobi decoding proper), no draft probabilities.

`init`: `"random"` (SJD: uniform random tokens, q uniform) or `"last"` (a sample from the
window's last recycled distribution, q = that distribution; uniform when there is none).
`vocab_size` is set by the pipeline (or pass it): the loop checks it against the target's.

`window="auto"` (the default; up to `max_window`, 16 by default) chooses the window by measurement: each
request runs one of a few windows (0 = plain decoding, 2, 4, 8, ..., max_window) and the
emitted tokens per second of whole requests decide which one runs next
(`mmspec.adaptive_window.WindowBandit`; why per request and not per step: its docstring). A
wide window needs fewer forwards but each costs more (on a CPU a 17-token verify of the testbed
generator costs ~2x a one-token forward, on a GPU nearly the same), so the best window differs
from machine to machine and batch size to batch size. The choice depends on finished requests
only, so verification stays exact (and under acceptance="invariant" the tokens of a seed do not
depend on the window at all). The bandit lives on the drafter: keep one drafter
(`pipe.drafter`) across calls and it keeps what it learned (per batch size).

Limits: chains only (a window is one chain); no drafter forward (`draft_calls` stays 0); the
window shrinks near the end of the sequence so no draft runs past `max_new_tokens`.
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec.adaptive_window import WindowBandit
from mmspec.position_noise import DraftsWithPositionNoise
from mmspec.sampling import SamplingConfig, cached_arange, draw, plain_number, process_logits, sample_from
from mmspec.tree import chain_parents
from mmspec.types import CommitInfo, Draft, FeatureRequest, TargetOutput

COUPLINGS = (None, "maximal", "gumbel")
INITS = ("random", "last")


class JacobiDrafter(DraftsWithPositionNoise):
    """Speculative Jacobi decoding drafter (see module docstring)."""

    features = FeatureRequest()  # logits only

    def __init__(self, window: int | str = "auto", coupling: str | None = "maximal", init: str = "random", *,
                 max_window: int | None = None, vocab_size: int | None = None):
        window, max_window, vocab_size = plain_number(window), plain_number(max_window), plain_number(vocab_size)
        self.adaptive = window == "auto"
        if self.adaptive:
            if max_window is None:
                max_window = 16
            if not isinstance(max_window, int) or isinstance(max_window, bool) or max_window < 1:
                raise ValueError(f"max_window must be an int >= 1, got {max_window!r}")
        elif max_window is not None:
            raise ValueError(f"max_window={max_window!r} only applies to window='auto'; with window={window!r} "
                             "the window is fixed")
        elif not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be an int >= 1 or 'auto', got {window!r}")
        if coupling not in COUPLINGS:
            raise ValueError(f"coupling={coupling!r}: must be one of {COUPLINGS}")
        if init not in INITS:
            raise ValueError(f"init={init!r}: must be one of {INITS}")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
            raise ValueError(f"vocab_size must be None (set by the pipeline) or an int >= 1, the target's vocabulary "
                             f"size; got {vocab_size!r}")
        self.window = window  # an int, or "auto"
        self.max_window = max_window if self.adaptive else window
        self.coupling = coupling
        self.init = init
        self.vocab_size = vocab_size
        self.max_draft_nodes = self.max_window  # slots of state; the target's cache is sized for them
        self.k = self.max_window  # positions sent to the target this step (set by the loop when adaptive)
        self.controller = WindowBandit(self.max_window) if self.adaptive else None
        self.draft_calls = 0
        # (DraftsWithPositionNoise: under acceptance="invariant" every coupling drafts argmax(q / E)
        # with the verifier's noise, the draft its greedy check accepts most often; still q-distributed.)

    def __repr__(self) -> str:
        window = f"'auto', max_window={self.max_window}" if self.adaptive else self.window
        return f"JacobiDrafter(window={window}, coupling={self.coupling!r}, init={self.init!r})"

    def set_draft_length(self, k: int) -> None:
        """The loop's choice of how many window positions to verify next step (window="auto": the
        request's window from the bandit)."""
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.max_window:
            raise ValueError(f"draft length must be an int in 0..{self.max_window}, got {k!r}")
        self.k = k

    # ---- protocol --------------------------------------------------------------------------
    def prefill(self, input_ids, attention_mask, target_out: TargetOutput, model_inputs: dict[str, Any],
                max_new_tokens: int) -> None:
        if self.vocab_size is None:
            raise ValueError("JacobiDrafter.vocab_size is not set: pass vocab_size= (the target's vocabulary size)")
        if self.controller is not None:
            self.controller.begin_request()  # the last request's rate is in: pick this one's window
        B, W, V = input_ids.shape[0], self.max_window, self.vocab_size
        device = input_ids.device
        dtype = target_out.logits.dtype
        self.logits = torch.zeros(B, W, V, dtype=dtype, device=device)  # recycled logits per window slot
        self.have_logits = torch.zeros(B, W, dtype=torch.bool, device=device)
        self.prev_tokens = torch.zeros(B, W, dtype=torch.long, device=device)  # previous drafts (coupling)
        self.prev_q: torch.Tensor | None = None  # [B, W, V] the distributions they were drawn from
        self.prev_valid = torch.zeros(B, W, dtype=torch.bool, device=device)
        # Gumbel noise per window slot; only the Gumbel coupling keeps one ([B, W, V] a call otherwise)
        self.noise = (torch.zeros(B, W, V, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                                  device=device) if self.coupling == "gumbel" else None)
        self.noise_valid = torch.zeros(B, W, dtype=torch.bool, device=device)
        self.remaining = [max_new_tokens - 1] * B  # tokens each row still emits after the root
        self.draft_calls = 0
        self._drafted: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def propose(self, roots: torch.Tensor, sampling: SamplingConfig, generator) -> Draft:
        B, V = roots.shape[0], self.vocab_size
        device = roots.device
        N = max(0, min(self.k, max(self.remaining, default=0) - 1))
        if N == 0:
            self._drafted = (roots.new_zeros(B, 0), None)
            return Draft(tokens=roots.new_zeros(B, 0), parents=roots.new_zeros(B, 0), is_chain=True)
        have = self.have_logits[:, :N]
        known = process_logits(self.logits[:, :N], sampling)  # [B, N, V]
        if self.init == "random":  # uniform where nothing is recycled: one masked fill
            init_q = None
            q = known.masked_fill(~have.unsqueeze(-1), 1.0 / V)
        else:
            init_q = self._init_q(known, have)
            q = torch.where(have.unsqueeze(-1), known, init_q)
        if sampling.greedy:
            random_tokens = draw(torch.randint, V, (B, N), generator=generator, device=device)
            tokens = torch.where(have, known.argmax(-1), random_tokens if self.init == "random" else init_q.argmax(-1))
            self._drafted = (tokens, None)
            return Draft(tokens=tokens, parents=chain_parents(B, N, device), draft_probs=None)
        noise = self._chain_noise(N, sampling, q)  # acceptance="invariant": the verifier's own noise
        if noise is not None:
            tokens = (q / noise).argmax(-1)  # = argmax(log q + g)
        elif self.coupling == "gumbel":
            self._fill_noise(N, generator)
            # argmax(log q + g) with g = -log(-log u) is argmin(q / log u) (log u < 0): two
            # operations instead of five, the same draw (a monotone map of the same scores).
            noise = self.noise if N == self.max_window else self.noise[:, :N]
            tokens = (q / (noise if noise.dtype == q.dtype else noise.to(q.dtype))).argmin(-1)
        else:
            if self.coupling == "maximal" and self.prev_q is not None:
                tokens = self._maximal_coupling(q, N, generator)
            else:
                tokens = sample_from(q.reshape(B * N, V), generator).view(B, N)
        self._drafted = (tokens, q)
        return Draft(tokens=tokens, parents=chain_parents(B, N, device), draft_probs=q)

    def commit(self, info: CommitInfo, target_out: TargetOutput) -> None:
        tokens, q = self._drafted
        B, N = tokens.shape
        if N == 0:
            # A plain step (window 0, or the end of the sequence): nothing was drafted, so nothing
            # is recycled; each slot's noise is dropped too (fresh noise is as good, and no gather).
            self.have_logits = torch.zeros_like(self.have_logits)
            self.prev_valid = torch.zeros_like(self.prev_valid)
            self.prev_q = None
            self.noise_valid = torch.zeros_like(self.noise_valid)
            self.remaining = [r - a - 1 for r, a in zip(self.remaining, info.num_accepted_list)]
            return
        W = self.max_window
        device = tokens.device
        n = info.num_accepted
        src = n.unsqueeze(1) + cached_arange(1, W + 1, 1, device)  # [B, W]: old index of new slot k
        logits = target_out.logits  # [B, N+1, V] (guided for CFG targets)
        self.have_logits = src <= N
        self.logits = logits.gather(1, src.clamp(max=N).unsqueeze(-1).expand(B, W, logits.shape[-1]))
        if self.coupling == "maximal" and N > 0:  # the previous drafts, for the coupling
            idx = src.clamp(max=N - 1)
            self.prev_valid = src < N
            self.prev_tokens = tokens.gather(1, idx)
            self.prev_q = None if q is None else q.gather(1, idx.unsqueeze(-1).expand(B, W, q.shape[-1]))
        elif self.coupling == "maximal":
            self.prev_valid = torch.zeros_like(self.prev_valid)
            self.prev_q = None
        if self.coupling == "gumbel":  # each position keeps its noise
            idx = src.clamp(max=W - 1)
            self.noise_valid = self.noise_valid.gather(1, idx) & (src < W)
            self.noise = self.noise.gather(1, idx.unsqueeze(-1).expand_as(self.noise))
        self.remaining = [r - a - 1 for r, a in zip(self.remaining, info.num_accepted_list)]

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        for name in ("logits", "have_logits", "prev_tokens", "prev_q", "prev_valid", "noise", "noise_valid"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows))
        self.remaining = [self.remaining[r] for r in rows_host]

    # ---- internals -------------------------------------------------------------------------
    def _init_q(self, known: torch.Tensor, have: torch.Tensor) -> torch.Tensor:
        """Distribution of the slots without recycled logits [B, N, V]."""
        B, N, V = known.shape
        uniform = torch.full_like(known, 1.0 / V)
        if self.init == "random":
            return uniform
        # "last": the distribution of the row's last slot with recycled logits (uniform if none).
        count = have.long().sum(1)  # recycled slots are a prefix of the window
        last = known.gather(1, (count - 1).clamp_min(0).view(B, 1, 1).expand(B, 1, V))
        return torch.where((count > 0).view(B, 1, 1), last.expand(B, N, V), uniform)

    def _fill_noise(self, N: int, generator) -> None:
        """Draw noise for the window slots that have none yet (positions new to the window;
        after the first step the window's shift brings some in at every step, so the draw is
        not skipped: no host sync). A slot's noise is log u, u ~ U(0, 1) clamped away from 0
        (-log u ~ Exp(1), and -log(-log u) is the slot's Gumbel noise)."""
        B, W, V = self.noise.shape
        u = draw(torch.rand, B, N, V, generator=generator, dtype=self.noise.dtype, device=self.noise.device)
        fresh = u.clamp_min(torch.finfo(self.noise.dtype).tiny).log()  # in [log tiny, 0)
        if N == W:
            self.noise = torch.where(self.noise_valid.unsqueeze(-1), self.noise, fresh)
            self.noise_valid = torch.ones_like(self.noise_valid)
        else:
            self.noise[:, :N] = torch.where(self.noise_valid[:, :N].unsqueeze(-1), self.noise[:, :N], fresh)
            self.noise_valid[:, :N] = True

    def _maximal_coupling(self, q: torch.Tensor, N: int, generator) -> torch.Tensor:
        """Keep the previous draft y w.p. min(1, q(y)/q_old(y)), else draw from norm(max(q - q_old, 0));
        slots without a previous draft draw from q. One categorical draw per slot: each slot's
        weights are its residual (or q where it has no previous draft, or where the residual has
        no mass: then q_old = q and y is always kept), and the draw is used only where y is not."""
        B, _, V = q.shape
        valid = self.prev_valid[:, :N]
        y = self.prev_tokens[:, :N]
        q_old = self.prev_q[:, :N].to(q.dtype)
        qy = q.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        qoy = q_old.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        keep_p = torch.where(qoy > 0, (qy / qoy.clamp_min(torch.finfo(q.dtype).tiny)).clamp(max=1.0),
                             torch.zeros_like(qy))
        u = draw(torch.rand, B, N, generator=generator, dtype=q.dtype, device=q.device)
        residual = (q - q_old).clamp_min(0.0)
        has_mass = residual.sum(-1) > torch.finfo(q.dtype).tiny * V * 16
        weights = torch.where((valid & has_mass).unsqueeze(-1), residual, q)
        drawn = sample_from(weights.reshape(B * N, V), generator).view(B, N)
        return torch.where(valid & (u < keep_p), y, drawn)
