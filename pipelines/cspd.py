"""CSpD: continuous speculative sampling for MAR, and plain MAR sampling through the same code.

Source: Wang et al., "Continuous Speculative Decoding for Autoregressive Image Generation"
(arXiv 2411.11925; public code github.com/MarkXCloud/CSpD) on top of MAR (Li et al., arXiv
2406.11838; github.com/LTH14/mar). A masked-order model has no causal cache, so this is a
loop of its own; verification is `mmspec.acceptance.ContinuousAcceptance`.

How a round works, per row (every row keeps its own generation step and accepted set):
1. Pre-filling: the first `ceil(prefill_fraction * num_iter)` steps are plain target steps.
2. Draft: the drafter runs up to `num_draft_steps` MAR generation steps from the row's
   current step, along the row's fixed random order and the cosine schedule.
3. Verify: one batched target call evaluates, for every drafted step k, the target's
   conditional given the committed tokens plus the drafted steps before k (one sequence per
   prefix; the last prefix gives a bonus step), and denoises every drafted token along the
   *same* noise as the drafter (trajectory alignment: shared x_T and per-step noise, fresh
   noise at the last step, so the last step of both is a Gaussian).
4. Accept: each token of a step is judged independently with min(1, p(x) / q(x)) of the two
   last-step Gaussians; a rejected token is replaced by a sample of the residual
   norm(max(0, p - q)) (bounded acceptance-rejection; fallbacks counted). The row keeps every
   drafted step up to and including the first step with a rejection (or all of them plus the
   bonus step) and discards the rest.

Exactness: MAR samples the tokens of one step independently given the tokens known before
it, and the target's sample of a token is a deterministic function of its noise (x_T, the
per-step noises) followed by a last Gaussian step. Conditioned on that noise, accept /
residual emits exactly the target's last-step Gaussian, so every committed step is distributed
as the target's own step. Noise is drawn once per (row, position) before sampling, so a
token's noise does not depend on when it is generated: with the drafter equal to the target
every draft is accepted and the image equals plain sampling with the same generator.
Deviation from CSpD's public code (which verifies all drafted steps against one target
forward given only the pre-draft tokens, and keeps every drafted token): that is exact only
for a coarser schedule than `num_iter`; we verify each drafted step against its own prefix.

Limits: the sampler's last step adds noise `std_0 * temperature` (the official MAR sampler
adds none; `final_step_noise=False` reproduces it in plain mode only). temperature must be > 0
for speculative sampling (a zero-variance Gaussian cannot be verified).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from mmspec.acceptance import ContinuousAcceptance
from mmspec.models.mar import MARModel, mar_schedule
from mmspec.sampling import check_generator, draw
from mmspec.stats import SpecStats


@dataclass
class MARNoise:
    """All randomness of one sampling run that plain and speculative sampling share; drawn in
    this order from the generator: orders, init, steps, final."""

    orders: torch.Tensor  # [B, L] long: generation order (a permutation per row)
    init: torch.Tensor  # [B, L, D]: x_T of each token's diffusion head
    steps: torch.Tensor  # [B, L, S-1, D]: noise of respaced steps S-1 .. 1
    final: torch.Tensor  # [B, L, D]: noise of the last step


def draw_noise(batch: int, seq_len: int, dim: int, num_steps: int, generator, device, dtype) -> MARNoise:
    # Drawn on the generator's device (a CPU generator may drive a CUDA model), then moved.
    kw = dict(generator=generator, device=device)
    orders = draw(torch.rand, batch, seq_len, **kw).argsort(1)
    init = draw(torch.randn, batch, seq_len, dim, dtype=dtype, **kw)
    steps = draw(torch.randn, batch, seq_len, num_steps - 1, dim, dtype=dtype, **kw)
    final = draw(torch.randn, batch, seq_len, dim, dtype=dtype, **kw)
    return MARNoise(orders, init, steps, final)


@dataclass
class MARStats:
    """What a MAR sampling run cost and what speculation bought. `spec` holds the shared
    counters (target_calls, draft_calls, accepted_drafts, drafted_nodes = drafted tokens,
    seconds, new_tokens per row)."""

    spec: SpecStats = field(default_factory=SpecStats)
    images: int = 0
    drafted_tokens: int = 0  # tokens the drafter proposed that were tested (draft="self": drafts of rows
    # waiting on a residual are dropped untested and not counted)
    judged_tokens: int = 0  # drafted tokens in steps up to the first rejected step of their row
    accepted_tokens: int = 0  # judged tokens accepted (committed drafts)
    residual_tokens: int = 0  # committed residual samples (rejected tokens)
    fallbacks: int = 0  # residual samples that used the explicit fallback
    bonus_steps: int = 0  # draft="model": row steps sampled by the target after all its drafts passed
    bonus_tokens: int = 0  # tokens committed from the target's own samples, plain prefill steps included
    rounds: int = 0
    residual_tries: int = 0  # draft="self" only: target trajectories drawn as residual proposals (the
    # drafter path's rule draws its max_tries proposals per judged token, vectorised, and counts none)
    draft_steps: int = 0  # generation steps drafted a round (0: plain sampling)
    row_forwards: int = 0  # target forwards each image took part in, summed over the images

    @property
    def acceptance_rate(self) -> float:
        """Accepted / judged drafted tokens."""
        return self.accepted_tokens / self.judged_tokens if self.judged_tokens else 0.0

    @property
    def target_forwards_per_image(self) -> float:
        """Target forwards an image took part in, mean over the images (a row waiting on a
        residual, or finished, sits a forward out; `spec.target_calls` counts the batch's calls)."""
        return self.row_forwards / self.images if self.images else 0.0

    def summary(self) -> str:
        return (f"{self.images} images; target calls {self.spec.target_calls}, draft calls {self.spec.draft_calls}; "
                f"acceptance {self.acceptance_rate:.3f} ({self.accepted_tokens}/{self.judged_tokens} judged, "
                f"{self.drafted_tokens} drafted); fallbacks {self.fallbacks}; {self.spec.total_seconds:.2f}s")


def _cfg_scales(lens: list[int], seq_len: int, guidance_scale: float, cfg_schedule: str) -> torch.Tensor:
    """Guidance scale of each step [num_iter] float64 (Muse's linear schedule as MAR)."""
    if cfg_schedule == "linear":
        return torch.tensor([1 + (guidance_scale - 1) * (seq_len - m) / seq_len for m in lens], dtype=torch.float64)
    if cfg_schedule == "constant":
        return torch.full((len(lens),), float(guidance_scale), dtype=torch.float64)
    raise ValueError(f"cfg_schedule must be 'linear' or 'constant', got {cfg_schedule!r}")


def guided_z(model, tokens, known, labels, need, guided: bool):
    """z and, under classifier-free guidance, the unconditional z ([Q, L, Z] each, NaN outside
    `need`: `MARModel.forward_z`) of Q sequences with class labels `labels` [Q]; both halves in
    one forward. -> (z, z_uncond or None)."""
    Q = tokens.shape[0]
    emb = model.class_embedding(labels, Q)
    if not guided:
        return model.forward_z(tokens, known, emb, need=need), None
    z = model.forward_z(torch.cat([tokens, tokens]), torch.cat([known, known]),
                        torch.cat([emb, model.class_embedding(None, Q)]), need=torch.cat([need, need]))
    return z.chunk(2)


class _Predictor:
    """One model's forward + diffusion-head trajectories for flat (sequence, position) tokens."""

    def __init__(self, model, class_labels, guidance_scale, cfg_scale_of_step, noise, temperature, final_noise,
                 name: str = "target"):
        self.model, self.labels, self.guided, self.name = model, class_labels, guidance_scale != 1.0, name
        self.cfg_of_step, self.noise, self.temperature, self.final_noise = cfg_scale_of_step, noise, temperature, final_noise

    def __call__(self, tokens, known, seq_rows, seq, pos, step_of_token):
        """tokens [Q, L, D], known [Q, L] for Q sequences belonging to rows seq_rows [Q];
        flat tokens (seq [N], pos [N]) at generation steps step_of_token [N]."""
        m = self.model
        need = torch.zeros_like(known, dtype=torch.bool)
        need[seq, pos] = True  # the last decoder block runs at these positions only
        z_c, z_u = guided_z(m, tokens, known, self.labels[seq_rows], need, self.guided)
        zu = None if z_u is None else z_u[seq, pos]
        cfg = None if z_u is None else self.cfg_of_step.to(z_c.device)[step_of_token].to(z_c.dtype)
        rows = seq_rows[seq]
        n = self.noise
        out = m.diffloss.trajectory(z_c[seq, pos], n.init[rows, pos], n.steps[rows, pos],
                                    n.final[rows, pos] if self.final_noise else None,
                                    z_uncond=zu, cfg=cfg, temperature=self.temperature)
        # SYNC: one flag per model call (the loop syncs every step anyway): a NaN or inf token
        # would otherwise be decoded into a silently broken image.
        if not bool(torch.isfinite(out.sample).all() & torch.isfinite(out.std).all()):
            raise ValueError(f"the MAR {self.name} produced non-finite tokens (NaN or inf); check its weights and dtype, "
                             f"and the temperature ({self.temperature}) that scales its noise (the images would be "
                             "silently wrong)")
        return out


@dataclass
class MARRun:
    """What every MAR sampler of one request derives from its arguments (validated)."""

    labels: torch.Tensor  # [B] long, on the target's device
    noise: MARNoise
    pos_step: torch.Tensor  # [B, L] long: the generation step of every position
    cfg_of_step: torch.Tensor  # [num_iter] float64: guidance scale of each step


def check_sampling(temperature, guidance_scale, cfg_schedule: str = "linear") -> None:
    """Refuse a temperature, guidance scale or schedule a request cannot honour (bool is not a
    number here)."""
    if cfg_schedule not in ("linear", "constant"):
        raise ValueError(f"cfg_schedule must be 'linear' or 'constant', got {cfg_schedule!r}")
    if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
                                             and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if temperature > 1e30:  # the diffusion noise's scale: inf in float32
        raise ValueError(f"temperature={temperature!r} is too large (it scales the diffusion noise); use at most 1e30")
    if isinstance(guidance_scale, bool) or not (isinstance(guidance_scale, (int, float)) and math.isfinite(guidance_scale)):
        raise ValueError(f"guidance_scale must be a finite number, got {guidance_scale!r}")


def check_speculative(temperature, num_draft_steps, prefill_fraction=None) -> None:
    """Refuse what speculative sampling cannot honour: a zero temperature, a draft length that is
    not an int >= 1, a prefill fraction outside [0, 1] (None: not used, as with self-drafting).
    `temperature=None`: the draft options alone (a plain call checks them too)."""
    if temperature is not None and not temperature > 0:
        raise ValueError("temperature must be > 0 for speculative sampling (a zero-variance Gaussian cannot be verified)")
    if not isinstance(num_draft_steps, int) or isinstance(num_draft_steps, bool) or num_draft_steps < 1:
        raise ValueError(f"num_draft_steps must be an int >= 1, got {num_draft_steps!r}")
    if prefill_fraction is not None and (isinstance(prefill_fraction, bool) or not isinstance(prefill_fraction, (int, float))
                                         or not 0.0 <= prefill_fraction <= 1.0):
        raise ValueError(f"prefill_fraction must be a number in [0, 1], got {prefill_fraction!r}")


def setup_run(target, class_labels, num_iter, guidance_scale, cfg_schedule, temperature, generator, noise) -> MARRun:
    """Validate a request's common arguments and derive its schedule, noise and step map."""
    if not isinstance(target, MARModel):
        raise TypeError(f"target must be a mmspec.models.mar.MARModel, got {type(target).__name__}")
    check_generator(generator)
    cfg = target.config
    L, D, S = target.seq_len, target.token_embed_dim, target.diffloss.gen.num_steps
    masked, lens = mar_schedule(L, num_iter)
    if not isinstance(class_labels, torch.Tensor) or class_labels.dim() != 1 or class_labels.dtype != torch.long:
        raise ValueError("class_labels must be a 1-D long tensor of class ids")
    if class_labels.numel() and (int(class_labels.min()) < 0 or int(class_labels.max()) >= cfg.class_num):  # SYNC: validation
        raise ValueError(f"class_labels must be in [0, {cfg.class_num}), got {class_labels.tolist()}")
    check_sampling(temperature, guidance_scale, cfg_schedule)
    cfg_of_step = _cfg_scales(lens, L, float(guidance_scale), cfg_schedule)
    B = class_labels.shape[0]
    dev, dtype = target.device, target.dtype
    if noise is None:
        noise = draw_noise(B, L, D, S, generator, dev, dtype)
    elif tuple(noise.init.shape) != (B, L, D) or tuple(noise.steps.shape) != (B, L, S - 1, D):
        raise ValueError(f"noise must be drawn for [B, L, D] = {[B, L, D]} with {S} head steps")
    # rank[b, p]: place of position p in row b's order; step s reveals ranks [masked[s+1], masked[s])
    rank = torch.empty_like(noise.orders)
    rank.scatter_(1, noise.orders, torch.arange(L, device=dev).expand(B, L))
    rank_step = torch.empty(L, dtype=torch.long)
    for s in range(num_iter):
        rank_step[masked[s + 1]: masked[s]] = s
    return MARRun(class_labels.to(dev), noise, rank_step.to(dev)[rank], cfg_of_step)


@torch.no_grad()
def sample_mar(
    target,
    class_labels: torch.Tensor,  # [B] long
    *,
    num_iter: int = 64,
    guidance_scale: float = 3.0,
    cfg_schedule: str = "linear",
    temperature: float = 1.0,
    drafter=None,
    num_draft_steps: int = 4,
    prefill_fraction: float = 0.15,
    acceptance: ContinuousAcceptance | None = None,
    final_step_noise: bool = True,
    generator: torch.Generator | None = None,
    callback=None,
    noise: MARNoise | None = None,
) -> tuple[torch.Tensor, MARStats]:
    """Sample token maps [B, L, D]; plain MAR sampling when `drafter` is None, CSpD otherwise.
    `callback(steps_done)` is called after every target call with the smallest step reached.
    `noise` replaces the orders and diffusion noise drawn from `generator` (studies, tests)."""
    t0 = time.perf_counter()
    run = setup_run(target, class_labels, num_iter, guidance_scale, cfg_schedule, temperature, generator, noise)
    if drafter is not None:
        check_drafter(target, drafter)
        if not final_step_noise:
            raise ValueError("final_step_noise=False is plain sampling only: speculative verification needs a Gaussian last step")
        check_speculative(temperature, num_draft_steps, prefill_fraction)
    acceptance = acceptance or ContinuousAcceptance()
    if not isinstance(acceptance, ContinuousAcceptance):  # failed in the first verify with an AttributeError
        raise ValueError(f"acceptance must be a ContinuousAcceptance (e.g. get_continuous_rule('continuous')), got "
                         f"{type(acceptance).__name__}")
    B, L, D = run.labels.shape[0], target.seq_len, target.token_embed_dim
    dev, dtype = target.device, target.dtype
    labels, noise, pos_step, cfg_of_step = run.labels, run.noise, run.pos_step, run.cfg_of_step
    tgt = _Predictor(target, labels, guidance_scale, cfg_of_step, noise, float(temperature), final_step_noise)
    drf = None if drafter is None else _Predictor(drafter, labels, guidance_scale, cfg_of_step, noise, float(temperature), True,
                                                  name="drafter")

    stats = MARStats(images=B, draft_steps=0 if drafter is None else min(num_draft_steps, num_iter))
    tokens = torch.zeros(B, L, D, dtype=dtype, device=dev)
    step = torch.zeros(B, dtype=torch.long, device=dev)
    all_rows = torch.arange(B, device=dev)
    n_prefill = num_iter if drf is None else min(num_iter, math.ceil(prefill_fraction * num_iter))

    def plain_step():
        """One target step for every unfinished row (rows are in lock step here)."""
        sel = pos_step == step[:, None]
        seq, pos = sel.nonzero(as_tuple=True)
        t = time.perf_counter()
        out = tgt(tokens, pos_step < step[:, None], all_rows, seq, pos, step[seq])
        tokens[seq, pos] = out.sample
        stats.spec.verify_seconds += time.perf_counter() - t
        stats.spec.target_calls += 1
        stats.row_forwards += B
        stats.bonus_tokens += seq.numel()  # the target's own samples (they were counted nowhere)
        step.add_(1)

    for _ in range(n_prefill):
        plain_step()
        if callback is not None:
            callback(int(step.min()))
    while drf is not None and bool((step < num_iter).any()):  # SYNC: loop control
        # A round never drafts past the last step: K above num_iter buys nothing (and 10**12 died
        # allocating the round's [B, K + 1] flags).
        _spec_round(tgt, drf, acceptance, tokens, step, pos_step, num_iter, min(num_draft_steps, num_iter), stats,
                    generator)
        if callback is not None:
            callback(int(step.min()))
    stats.spec.new_tokens = [L] * B
    stats.spec.total_seconds = time.perf_counter() - t0
    return tokens, stats


def _spec_round(tgt, drf, acceptance, tokens, step, pos_step, num_iter, K, stats, generator):
    B, L, D = tokens.shape
    dev = tokens.device
    active = step < num_iter
    k_b = torch.where(active, (num_iter - step).clamp(max=K), torch.zeros_like(step))  # [B] steps to draft
    draft = tokens.clone()
    # The drafts as drawn, before rounding to the model dtype: the accept test is exact for a
    # draft that follows q, and a bfloat16-rounded one does not (its rounding step near |x| ~ 1 is
    # 1-4 standard deviations of the last denoising step: bf16 CSpD drifted from plain sampling).
    draft64 = tokens.double()
    mq = torch.zeros(B, L, D, dtype=torch.float64, device=dev)
    sq = torch.ones(B, L, D, dtype=torch.float64, device=dev)
    t = time.perf_counter()
    for k in range(K):
        rows = (k < k_b).nonzero(as_tuple=True)[0]  # SYNC: rows that still draft
        if rows.numel() == 0:
            break
        sub_step = step[rows] + k
        sel = pos_step[rows] == sub_step[:, None]
        seq, pos = sel.nonzero(as_tuple=True)
        out = drf(draft[rows], pos_step[rows] < sub_step[:, None], rows, seq, pos, sub_step[seq])
        r = rows[seq]
        draft[r, pos], mq[r, pos], sq[r, pos] = out.sample, out.mean, out.std
        draft64[r, pos] = out.mean + out.std * drf.noise.final[r, pos].double()  # out.sample before rounding
        stats.spec.draft_calls += 1
    stats.spec.draft_seconds += time.perf_counter() - t

    # verify: one sequence per (row, prefix k), k = 0..k_b (the last one only when a bonus step exists)
    t = time.perf_counter()
    n_pref = torch.where(step + k_b < num_iter, k_b + 1, k_b)  # [B]
    seq_rows = torch.repeat_interleave(torch.arange(B, device=dev), n_pref)  # [Q]
    first = torch.cumsum(n_pref, 0) - n_pref
    seq_k = torch.arange(seq_rows.numel(), device=dev) - first[seq_rows]  # [Q] prefix index
    seq_step = step[seq_rows] + seq_k  # [Q] the generation step this sequence predicts
    known = pos_step[seq_rows] < seq_step[:, None]
    sel = pos_step[seq_rows] == seq_step[:, None]
    seq, pos = sel.nonzero(as_tuple=True)
    out = tgt(draft[seq_rows], known, seq_rows, seq, pos, seq_step[seq])
    stats.spec.target_calls += 1
    stats.row_forwards += int((n_pref > 0).sum())  # SYNC: once a round
    row, k = seq_rows[seq], seq_k[seq]
    is_draft = k < k_b[row]  # [N] verified drafted token; else a bonus-step token
    res = acceptance.accept_tokens(
        draft64[row, pos][:, None], mq[row, pos][:, None], sq[row, pos][:, None],
        out.mean[:, None], out.std[:, None], generator=generator,
    )
    acc, resid, fb = res.accepted[:, 0], res.samples[:, 0], res.fell_back[:, 0]
    # first drafted step of each row with a rejection (k_b when none)
    flag = torch.zeros(B, K + 1, dtype=torch.bool, device=dev)
    flag[row[is_draft & ~acc], k[is_draft & ~acc]] = True
    flag |= torch.arange(K + 1, device=dev)[None] >= k_b[:, None]
    stop = flag.int().argmax(1)  # [B]
    ks = stop[row]
    take_draft = is_draft & (k < ks)
    take_resid = is_draft & (k == ks)
    take_bonus = ~is_draft & (ks == k_b[row])
    new = torch.where(take_draft[:, None], draft[row, pos].double(), resid)
    new = torch.where(take_bonus[:, None], out.sample.double(), new)
    commit = take_draft | take_resid | take_bonus
    tokens[row[commit], pos[commit]] = new[commit].to(tokens.dtype)
    step.copy_(torch.where(active, (step + stop + 1).clamp(max=num_iter), step))
    judged = is_draft & (k <= ks)
    # SYNC: statistics (one host transfer per round)
    counts = torch.stack([is_draft.sum(), judged.sum(), (judged & acc).sum(), (take_resid & ~acc).sum(),
                          (take_resid & ~acc & fb).sum(), (active & (stop == k_b) & (n_pref > k_b)).sum(),
                          take_bonus.sum()]).tolist()
    stats.drafted_tokens += counts[0]
    stats.judged_tokens += counts[1]
    stats.accepted_tokens += counts[2]
    stats.residual_tokens += counts[3]
    stats.fallbacks += counts[4]
    stats.bonus_steps += counts[5]
    stats.bonus_tokens += counts[6]
    stats.rounds += 1
    stats.spec.drafted_nodes += counts[0]
    stats.spec.accepted_drafts += counts[2]
    stats.spec.row_steps += int(active.sum())
    stats.spec.active_rows.append(int(active.sum()))
    stats.spec.verify_seconds += time.perf_counter() - t


def check_drafter(target, drafter) -> None:
    """A drafter must share the target's token grid, token dimension and classes, and its
    dtype and device (the shared noise is drawn once, in the target's dtype). It may sample its
    head in fewer steps than the target (a cheaper draft): it then uses the first of the shared
    per-step noises, and its trajectory is aligned with the target's at x_T and at the final
    noise only. Exactness does not depend on it (the target's trajectory is its own)."""
    for arg, model in (("target", target), ("drafter", drafter)):
        if not isinstance(model, MARModel):
            raise TypeError(f"{arg} must be a mmspec.models.mar.MARModel, got {type(model).__name__}")
    for name in ("dtype", "device"):
        if getattr(target, name) != getattr(drafter, name):
            raise ValueError(f"drafter {name}={getattr(drafter, name)} differs from the target's {getattr(target, name)}; "
                             "move both to one dtype and device (e.g. pipe.to(torch.float32))")
    for name in ("seq_len", "token_embed_dim"):
        if getattr(target, name) != getattr(drafter, name):
            raise ValueError(f"drafter {name}={getattr(drafter, name)} differs from the target's {getattr(target, name)}")
    for name in ("class_num", "patch_size", "vae_embed_dim"):
        if getattr(target.config, name) != getattr(drafter.config, name):
            raise ValueError(f"drafter config {name}={getattr(drafter.config, name)} differs from the target's "
                             f"{getattr(target.config, name)}")
    if drafter.diffloss.gen.num_steps > target.diffloss.gen.num_steps:
        raise ValueError(f"drafter config num_sampling_steps={drafter.config.num_sampling_steps} is above the target's "
                         f"{target.config.num_sampling_steps}: the shared noise is drawn for the target's head steps; "
                         "give the drafter as many head steps or fewer")
