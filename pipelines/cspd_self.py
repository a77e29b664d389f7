"""Self-drafted CSpD for MAR: the target drafts later generation steps from its own earlier
conditioning, and every draft is verified along its whole denoising trajectory.

Sources: CSpD (Wang et al., "Continuous Speculative Decoding for Autoregressive Image
Generation", arXiv 2411.11925; github.com/MarkXCloud/CSpD) for speculative sampling of MAR's
diffusion-head tokens; MAR (Li et al., arXiv 2406.11838; github.com/LTH14/mar) for the model.
Drafting from the target's own stale state is our design (the self-speculative idea of, e.g.,
Jacobi decoding, applied to a masked-order model); the trajectory-level test is speculative
sampling (Leviathan et al. 2023; Chen et al. 2023) over the head's denoising path.

Why. The last-step test of `pipelines/cspd.py` compares two heads' final Gaussians, each at the
end of its own trajectory; that Gaussian is ~0.006 wide (the cosine schedule's t = 0 step)
while two different MAR models land ~0.1 apart, so between the bundled testbed models nothing
is accepted. Two changes make drafts acceptable without giving up exactness:

1. The drafted object is the whole denoising path x_T -> ... -> x_0 of a token, and it is
   accepted with min(1, p(path) / q(path)), each density the product of the head's Gaussian
   steps *along the draft's own states* (`DiffLoss.log_density_along`, one batched call). The
   target never leaves the draft's path, so small differences cannot compound; the emitted
   x_0 is the last state of a path distributed as the target's, hence distributed as the
   target's token. A rejected token is replaced by a sample of the residual
   norm(max(0, p - q)) over paths: target paths are proposed with fresh noise and kept with
   probability max(0, 1 - q/p) (acceptance-rejection with proposal p; bounded tries, counted
   fallbacks: a plain target path).
2. The drafter is the target itself with stale conditioning: one target forward gives z for
   every masked position, so the steps after the next one are drafted from z computed before
   their predecessors were known, by the target's own head, with no drafter model at all. On
   the bundled pair at 64 steps a one-step-stale draft passes the path test 83% of the time,
   two steps stale 73%, four 58% (`benchmarks/mar_trajectory_ratio.py`).

A round, per row (rows keep their own step; batched throughout):
  a. one head call samples the drafts of the next steps from the row's stored z (the first
     step's z is fresh when the last forward knew every committed token: that step is a plain
     target sample, not a draft) and, in the same call, residual proposals for the tokens the
     previous round rejected (from their fresh z); the residuals are settled first.
  b. one target forward evaluates one prefix per drafted step (committed tokens plus the drafts
     before it) and gives each drafted step its fresh z (each prefix's z only where it is read:
     its own step and the K + 1 steps a next round may draft from it, `forward_z(need=...)`).
  c. the drafted paths are scored under the fresh z; a row keeps its drafted steps up to the
     first step with a rejection; in that step accepted tokens stay and rejected ones await
     their residual (step a of the next round). The row's z for the next round comes from the
     longest prefix whose tokens are all committed.
MAR samples the tokens of one step independently given the earlier steps, so each token is
judged on its own; a later step's drafts are valid only if every token before them is.

Exactness: each committed token is the target's sample given the committed tokens of earlier
steps (accepted paths by speculative sampling over paths, rejected ones by the residual), up
to the counted fallbacks. Drafts use the per-(row, position) noise of plain sampling; a draft
discarded untested leaves no trace in any decision, so its noise may be reused. With a
conditioning that does not change as tokens are revealed every draft is accepted and the
tokens equal plain sampling's for the same noise (tested).

Limits: temperature > 0 and a last Gaussian step (the density of a path needs it). Speed
depends on tokens per step: at one token per step (num_iter = number of tokens) a step's
drafts pass as often as one token; at 4 tokens per step all four must pass, so the pipeline
pays where steps are fine.
"""

from __future__ import annotations

import time

import torch

from mmspec.sampling import draw

from .cspd import MARStats, guided_z, setup_run


class _Heads:
    """The target's forward and head under (optional) CFG, for flat tokens (row, position)."""

    def __init__(self, model, labels, guidance_scale, cfg_of_step, temperature):
        self.m, self.labels, self.guided = model, labels, guidance_scale != 1.0
        self.dtype = model.dtype  # (a diffusers model's dtype walks its modules: read it once)
        self.cfg_of_step, self.temperature = cfg_of_step.to(model.device, self.dtype), temperature

    def forward(self, tokens, known, seq_rows, need):
        """z (and unconditional z under CFG) [Q, L, Z] for Q sequences of rows seq_rows, at the
        positions `need` [Q, L] (NaN elsewhere: `MARModel.forward_z`)."""
        return guided_z(self.m, tokens, known, self.labels[seq_rows], need, self.guided)

    def cfg(self, steps):
        return self.cfg_of_step[steps] if self.guided else None

    def paths(self, zc, zu, steps, init, step_noise, final, alt=None):
        out = self.m.diffloss.trajectory(zc, init, step_noise, final, z_uncond=zu, cfg=self.cfg(steps),
                                         temperature=self.temperature, record=True, alt=alt)
        if not bool(torch.isfinite(out.sample).all() & torch.isfinite(out.log_density).all()):  # SYNC: per head call
            raise ValueError("the MAR target produced non-finite tokens (NaN or inf); check its weights and dtype, "
                             f"and the temperature ({self.temperature}) that scales its noise (the images would be "
                             "silently wrong)")
        return out

    def log_density(self, states, sample, zc, zu, steps):
        return self.m.diffloss.log_density_along(states, sample, zc, zu, self.cfg(steps), self.temperature)


def keep_proposal(u: torch.Tensor, log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """Acceptance-rejection for the residual norm(max(0, p - q)) with proposal p: keep a target
    path with probability max(0, 1 - q/p)."""
    return u < -torch.expm1(log_q - log_p)


def accept_draft(u: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Speculative sampling over paths: accept a drafted path with probability min(1, p/q)."""
    return u.log() < log_p - log_q


@torch.no_grad()
def sample_mar_self(
    target,
    class_labels: torch.Tensor,  # [B] long
    *,
    num_iter: int = 64,
    guidance_scale: float = 3.0,
    cfg_schedule: str = "linear",
    temperature: float = 1.0,
    num_draft_steps: int = 3,
    residual_tries: int = 4,
    max_residual_tries: int = 256,
    generator: torch.Generator | None = None,
    callback=None,
    noise=None,
) -> tuple[torch.Tensor, MARStats]:
    """Sample token maps [B, L, D] with self-drafted CSpD (module docstring). `num_draft_steps`
    stale steps are drafted per round; a rejected token draws `residual_tries` target paths in
    the next round (four times as many in a round after one without success, at most
    `max_residual_tries` a round) and falls back (counted: a plain target path) once it has
    drawn `max_residual_tries` or more without success."""
    t0 = time.perf_counter()
    run = setup_run(target, class_labels, num_iter, guidance_scale, cfg_schedule, temperature, generator, noise)
    if not temperature > 0:
        raise ValueError("temperature must be > 0 for speculative sampling (a zero-variance Gaussian cannot be verified)")
    for name, v in (("num_draft_steps", num_draft_steps), ("residual_tries", residual_tries),
                    ("max_residual_tries", max_residual_tries)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    K = min(num_draft_steps, num_iter)  # a round never drafts past the last step (10**12 died in the allocator)
    B, L, D = run.labels.shape[0], target.seq_len, target.token_embed_dim
    S = target.diffloss.gen.num_steps
    dev, dtype = target.device, target.dtype
    noise, pos_step = run.noise, run.pos_step
    heads = _Heads(target, run.labels, guidance_scale, run.cfg_of_step, float(temperature))
    stats = MARStats(images=B, draft_steps=K)
    rows_all = torch.arange(B, device=dev)
    tokens = torch.zeros(B, L, D, dtype=dtype, device=dev)
    step = torch.zeros(B, dtype=torch.long, device=dev)  # steps whose tokens are committed or pending
    pending = torch.zeros(B, L, dtype=torch.bool, device=dev)  # rejected tokens awaiting a residual
    tries = torch.zeros(B, L, dtype=torch.long, device=dev)
    # z of every position from the last forward whose known tokens are all committed; `fresh`:
    # that forward knew every committed token, so z of step `step` is the target's own.
    t = time.perf_counter()
    # a prefix whose own step is s serves the tests of step s and the drafts of the next round,
    # steps s .. s + K: its z is computed at those positions only
    def upcoming(rows, s):
        return (pos_step[rows] >= s[:, None]) & (pos_step[rows] <= s[:, None] + K)

    zc, zu = heads.forward(tokens, torch.zeros(B, L, dtype=torch.bool, device=dev), rows_all, upcoming(rows_all, step))
    stats.spec.target_calls += 1
    stats.row_forwards += B
    stats.spec.verify_seconds += time.perf_counter() - t
    fresh = torch.ones(B, dtype=torch.bool, device=dev)
    pend_zc, pend_zu = zc.clone(), None if zu is None else zu.clone()  # fresh z of pending tokens
    pend_qc, pend_qu = zc.clone(), None if zu is None else zu.clone()  # the z their drafts used
    gen_kw = dict(generator=generator, device=dev)

    while True:
        open_rows = step < num_iter
        if not bool(open_rows.any() | pending.any()):  # SYNC: loop control
            break
        stats.rounds += 1
        # -- a. drafts and residual proposals, one head call --------------------------------
        t = time.perf_counter()
        k_b = torch.where(open_rows, (num_iter - step).clamp(max=K) + fresh.long(), 0).clamp(max=num_iter - step)
        d_sel = (pos_step >= step[:, None]) & (pos_step < (step + k_b)[:, None])
        d_row, d_pos = d_sel.nonzero(as_tuple=True)
        p_row, p_pos = pending.nonzero(as_tuple=True)
        n_d, n_p = d_row.numel(), p_row.numel()
        # a residual still open after a round of proposals gets four times as many in the next
        # (few tokens need more than one round; those that do are the ones p and q barely separate)
        T = min(residual_tries * (4 if n_p and bool((tries[p_row, p_pos] > 0).any()) else 1),  # SYNC: once a round
                max_residual_tries)
        c_row, c_pos = p_row.repeat_interleave(T), p_pos.repeat_interleave(T)
        zc_in = torch.cat([zc[d_row, d_pos], pend_zc[c_row, c_pos]])
        zu_in = None if zu is None else torch.cat([zu[d_row, d_pos], pend_zu[c_row, c_pos]])
        steps_in = torch.cat([pos_step[d_row, d_pos], pos_step[c_row, c_pos]])
        nc = n_p * T
        init, s_noise, final = noise.init[d_row, d_pos], noise.steps[d_row, d_pos], noise.final[d_row, d_pos]
        if nc:  # fresh noise for the residual proposals
            init = torch.cat([init, draw(torch.randn, nc, D, dtype=dtype, **gen_kw)])
            s_noise = torch.cat([s_noise, draw(torch.randn, nc, S - 1, D, dtype=dtype, **gen_kw)])
            final = torch.cat([final, draw(torch.randn, nc, D, dtype=dtype, **gen_kw)])
        # the proposals' density under the draft's (stale) z rides along as extra rows of the same head calls
        alt = None if not n_p else (torch.arange(n_d, n_d + nc, device=dev), pend_qc[c_row, c_pos],
                                    None if zu is None else pend_qu[c_row, c_pos])
        out = heads.paths(zc_in, zu_in, steps_in, init, s_noise, final, alt)
        stats.spec.draft_calls += 1
        stats.spec.draft_seconds += time.perf_counter() - t
        t = time.perf_counter()
        if n_p:  # settle the residuals: keep a target path with probability max(0, 1 - q/p)
            cs = out.sample[n_d:]
            u = draw(torch.rand, nc, dtype=torch.float64, **gen_kw)
            ok = keep_proposal(u, out.alt_log_density, out.log_density[n_d:]).view(n_p, T)
            first = ok.int().argmax(1)
            got = ok.any(1)
            p_tries = tries[p_row, p_pos] + T
            give_up = ~got & (p_tries >= max_residual_tries)  # counted fallback: a plain target path
            take = got | give_up
            pick = torch.where(got, first, 0) + torch.arange(n_p, device=dev) * T
            tokens[p_row[take], p_pos[take]] = cs[pick[take]]
            pending[p_row[take], p_pos[take]] = False
            tries[p_row, p_pos] = p_tries
            counts = torch.stack([got.sum(), give_up.sum(), (~take).sum()]).tolist()  # SYNC: statistics
            stats.residual_tokens += counts[0] + counts[1]
            stats.fallbacks += counts[1]
            stats.residual_tries += nc
        # -- b. verify: one prefix per drafted step of rows with nothing pending -------------
        ready = open_rows & ~pending.any(1)
        j0 = fresh.long()  # a fresh first step is the target's own sample: no prefix tests it
        n_pref = torch.where(ready, k_b + 1 - j0 - (step + k_b >= num_iter).long(), 0)
        d_ok = ready[d_row]
        first_seq = torch.cumsum(n_pref, 0) - n_pref
        zc_q = zu_q = None
        if bool(n_pref.any()):  # SYNC: none at a request's last step or while only residuals are open
            draft_tok = tokens.clone()
            draft_tok[d_row, d_pos] = out.sample[:n_d]
            seq_rows = torch.repeat_interleave(rows_all, n_pref)
            seq_j = torch.arange(seq_rows.numel(), device=dev) - first_seq[seq_rows] + j0[seq_rows]
            seq_step = step[seq_rows] + seq_j
            zc_q, zu_q = heads.forward(draft_tok[seq_rows], pos_step[seq_rows] < seq_step[:, None], seq_rows,
                                       upcoming(seq_rows, seq_step))
            stats.spec.target_calls += 1
            stats.row_forwards += int((n_pref > 0).sum())  # SYNC: once a round (rows on a residual sit out)
        # -- c. score the drafted paths under their fresh z --------------------------------
        d_j = pos_step[d_row, d_pos] - step[d_row]  # drafted step index within the round
        tested = d_ok & (d_j >= j0[d_row])
        seq_of = first_seq[d_row] + d_j - j0[d_row]  # the prefix that gives a drafted token its fresh z
        tr, tp, ts = d_row[tested], d_pos[tested], seq_of[tested]
        accept = torch.ones(n_d, dtype=torch.bool, device=dev)
        if tr.numel():
            log_p = heads.log_density(out.states[:n_d][tested], out.sample[:n_d][tested], zc_q[ts, tp],
                                      None if zu_q is None else zu_q[ts, tp], pos_step[tr, tp])
            u = draw(torch.rand, tr.numel(), dtype=torch.float64, **gen_kw)
            accept[tested] = accept_draft(u, log_p, out.log_density[:n_d][tested])
        rej = d_ok & ~accept
        flag = torch.zeros(B, K + 2, dtype=torch.bool, device=dev)
        flag[d_row[rej], d_j[rej]] = True
        flag |= torch.arange(K + 2, device=dev)[None] >= k_b[:, None]
        stop = flag.int().argmax(1)  # [B] first drafted step with a rejection (k_b when none)
        keep = d_ok & ((d_j < stop[d_row]) | ((d_j == stop[d_row]) & accept))
        tokens[d_row[keep], d_pos[keep]] = out.sample[:n_d][keep]
        new_pend = d_ok & (d_j == stop[d_row]) & ~accept
        pr, pp = d_row[new_pend], d_pos[new_pend]
        pending[pr, pp] = True
        tries[pr, pp] = 0
        # the prefix of the row's longest committed run: `stop` (its tokens are all committed)
        has_next = ready & ((stop < k_b) | (step + k_b < num_iter))
        src = first_seq + stop - j0  # sequence index of prefix `stop`
        if pr.numel():  # (a rejection was tested, so the forward ran)
            pend_seq = src[pr]
            pend_zc[pr, pp], pend_qc[pr, pp] = zc_q[pend_seq, pp], zc[pr, pp]
            if zu is not None:
                pend_zu[pr, pp], pend_qu[pr, pp] = zu_q[pend_seq, pp], zu[pr, pp]
        upd = has_next.nonzero(as_tuple=True)[0]
        if zc_q is not None:  # (has_next needs a prefix, so no row has one without the forward)
            zc[upd] = zc_q[src[upd]]
            if zu is not None:
                zu[upd] = zu_q[src[upd]]
        full = stop == k_b
        fresh = torch.where(ready, full, fresh)
        step = torch.where(ready, torch.where(full, step + k_b, step + stop + 1), step)
        judged = tested & (d_j <= stop[d_row])
        counts = torch.stack([tested.sum(), judged.sum(), (judged & accept).sum(),
                              (d_ok & ~tested & (d_j < stop[d_row] + 1)).sum(), ready.sum()]).tolist()  # SYNC
        stats.drafted_tokens += counts[0]
        stats.judged_tokens += counts[1]
        stats.accepted_tokens += counts[2]
        stats.bonus_tokens += counts[3]  # tokens sampled from fresh z (plain target samples)
        stats.spec.drafted_nodes += counts[0]
        stats.spec.accepted_drafts += counts[2]
        stats.spec.row_steps += counts[4]
        stats.spec.active_rows.append(counts[4])
        stats.spec.verify_seconds += time.perf_counter() - t
        if callback is not None:
            callback(int(step.min()))
    stats.spec.new_tokens = [L] * B
    stats.spec.total_seconds = time.perf_counter() - t0
    return tokens, stats
