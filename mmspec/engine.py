"""The speculative loop: `speculative_generate`.

Per step, for the B active rows (finished rows are dropped from the working batch, so they
stop costing draft *and* verify work):

    draft  = drafter.propose(roots)                       # chain [B, K] or tree [B, N]
    out    = target.verify([roots | draft], parents)      # ONE target forward
    result = rule.verify(...) or verify_tree(rule, ...)   # per-row accepted path
    target.commit(info); drafter.commit(info, out)        # per-row rollback

The only host sync per step is the `.tolist()` that tells the host how many tokens each
row kept (and whether it finished); everything else stays on the device. Greedy
(`temperature=0`) output equals plain greedy decoding token for token; with a lossless rule
(`"exact"`) sampled output is distributed like plain sampling with the same temperature,
top-k and top-p (Leviathan et al. 2023; Chen et al. 2023).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from mmspec.sampling import SamplingConfig, process_logits
from mmspec.stats import SpecStats
from mmspec.tree import verify_tree
from mmspec.types import CommitInfo


@dataclass
class SpecOutput:
    sequences: torch.Tensor  # [B, L + N] prompt + new tokens, padded with pad_token_id after EOS
    stats: SpecStats


_TARGET_METHODS = ("prefill", "verify", "commit", "select_rows")
_DRAFTER_METHODS = ("prefill", "propose", "commit", "select_rows")


def as_target(target):
    """An `mmspec.Target`: returned as is, or an HF model wrapped in `HFTarget`."""
    if all(hasattr(target, m) for m in _TARGET_METHODS):
        return target
    if hasattr(target, "config") and callable(target):
        from mmspec.models.hf_target import HFTarget  # adapters may import transformers

        return HFTarget(target)
    raise TypeError(
        f"target must be a transformers PreTrainedModel or implement mmspec.Target "
        f"({', '.join(_TARGET_METHODS)}), got {type(target).__name__}"
    )


def _eos_list(eos_token_id) -> list[int]:
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be None, an int >= 0 or a list of them, got {eos_token_id!r}")
    return ids


def _check_inputs(input_ids, attention_mask, max_new_tokens):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(
            f"input_ids must be a LongTensor of shape [batch, length], got "
            f"{getattr(input_ids, 'dtype', type(input_ids))} {tuple(getattr(input_ids, 'shape', ()))}"
        )
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must hold at least one token per row, got shape {tuple(input_ids.shape)}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got "
            f"{tuple(getattr(attention_mask, 'shape', ()))}"
        )
    am = attention_mask.long()
    # SYNC: input validation, once per call. Left padding: once a row starts it stays on.
    if bool(((am[:, 1:] - am[:, :-1]) < 0).any()) or bool((am.sum(1) == 0).any()):
        raise ValueError(
            "attention_mask must be left-padded (zeros only before each row's first token) and every row "
            "must have at least one real token; re-tokenize with padding_side='left'"
        )
    return am


@torch.no_grad()
def speculative_generate(
    target,
    drafter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    acceptance: Any = "exact",
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    **model_inputs,
) -> SpecOutput:
    """Generate with speculative decoding; see DESIGN.md "Public API".

    `input_ids` [B, L] are left-padded like transformers' batched generation;
    `sequences[:, L:]` are the new tokens. `temperature=0` is greedy. `model_inputs`
    (pixel_values, image_grid_thw, ...) go to the target's prefill."""
    from mmspec.acceptance import GreedyAcceptance, get_rule  # core -> rules only at call time

    sampling = SamplingConfig(temperature, top_k, top_p)
    attention_mask = _check_inputs(input_ids, attention_mask, max_new_tokens)
    eos = _eos_list(eos_token_id)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    if not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id must be None or an int >= 0, got {pad_token_id!r}")
    target = as_target(target)
    missing = [m for m in _DRAFTER_METHODS if not hasattr(drafter, m)]
    if missing:
        raise TypeError(f"drafter must implement mmspec.Drafter; {type(drafter).__name__} lacks {missing}")
    d_vocab = getattr(drafter, "vocab_size", None)
    if d_vocab is not None and d_vocab != target.vocab_size:
        raise ValueError(
            f"drafter vocabulary ({d_vocab}) differs from the target's ({target.vocab_size}); the drafter must "
            "share the target's tokenizer and vocabulary size"
        )
    rule = get_rule(acceptance)
    if not all(hasattr(rule, m) for m in ("accept_probability", "residual", "sample")):
        raise TypeError(
            f"acceptance rule {type(rule).__name__} does not verify discrete tokens (it lacks accept_probability / "
            "residual / sample); continuous-token rules run through the MAR pipeline"
        )
    if sampling.greedy and getattr(rule, "name", None) == "exact":
        rule = GreedyAcceptance()  # exact verification of one-hot p is greedy verification

    # The loop builds well-formed inputs itself: skip the rule's validation (a host sync).
    verify_chain = getattr(rule, "verify_unchecked", rule.verify)
    B, L = input_ids.shape
    device = input_ids.device
    stats = SpecStats(new_tokens=[0] * B)
    if max_new_tokens == 0:
        return SpecOutput(input_ids.clone(), stats)
    t_start = time.perf_counter()
    out_buf = torch.full((B, max_new_tokens + 1), pad_token_id, dtype=torch.long, device=device)
    trash = max_new_tokens  # column that absorbs writes past a row's end

    tout = target.prefill(input_ids, attention_mask, model_inputs, max_new_tokens, drafter.max_draft_nodes)
    stats.prefill_calls = 1
    roots = rule.sample(process_logits(tout.logits[:, -1], sampling), generator)
    t_draft = time.perf_counter()
    drafter.prefill(input_ids, attention_mask, tout, model_inputs, max_new_tokens)
    stats.draft_seconds += time.perf_counter() - t_draft
    out_buf[:, 0] = roots
    written_dev = torch.ones(B, dtype=torch.long, device=device)
    distortion_sum = torch.zeros((), dtype=torch.float64, device=device)
    eos_t = torch.tensor(eos, dtype=torch.long, device=device)
    # SYNC: once after prefill, to learn which rows ended with their first token.
    first_eos = torch.isin(roots, eos_t).tolist() if eos else [False] * B
    written = [1] * B
    rows_host = list(range(B))  # input row of each active row
    keep = [i for i in range(B) if not first_eos[i] and written[i] < max_new_tokens]
    rows_dev = torch.arange(B, device=device)

    def drop_finished(keep_local: list[int]):
        nonlocal roots, written_dev, rows_dev, rows_host
        idx = torch.tensor(keep_local, dtype=torch.long, device=device)
        target.select_rows(idx, keep_local)
        drafter.select_rows(idx, keep_local)
        roots, written_dev, rows_dev = roots[idx], written_dev[idx], rows_dev[idx]
        rows_host = [rows_host[i] for i in keep_local]

    if len(keep) < B:
        drop_finished(keep)

    while rows_host:
        Ba = len(rows_host)
        t0 = time.perf_counter()
        draft = drafter.propose(roots, sampling, generator)
        t1 = time.perf_counter()
        N = draft.num_nodes
        tokens = torch.cat([roots.unsqueeze(1), draft.tokens], 1)  # [Ba, N+1]
        tout = target.verify(tokens, None if draft.is_chain else draft.parents)
        probs = process_logits(tout.logits, sampling)  # [Ba, N+1, V]
        local = torch.arange(Ba, device=device)
        if draft.is_chain:
            res = verify_chain(draft.tokens, draft.draft_probs, probs, generator=generator)
            n, next_tokens, distortion = res.num_accepted, res.next_tokens, res.distortion
            path = torch.arange(N + 1, device=device).expand(Ba, N + 1)
        else:
            tres = verify_tree(rule, draft.tokens, draft.parents, probs, generator=generator)
            n, next_tokens, distortion, path = tres.num_accepted, tres.next_tokens, tres.distortion, tres.path
        # Emitted this step: the accepted path's tokens, then the recovered / bonus token.
        emitted = torch.cat([tokens.gather(1, path[:, 1:]), tokens.new_zeros(Ba, 1)], 1)  # [Ba, N+1]
        emitted[local, n] = next_tokens
        j = torch.arange(N + 1, device=device).unsqueeze(0)
        count = n + 1
        if eos:
            hit = torch.isin(emitted, eos_t) & (j < count.unsqueeze(1))
            first = torch.where(hit.any(1), hit.long().argmax(1), torch.full_like(count, N + 1))
            count = torch.minimum(count, first + 1)
        count = torch.minimum(count, max_new_tokens - written_dev)
        pos = torch.where(j < count.unsqueeze(1), written_dev.unsqueeze(1) + j, torch.full_like(j, trash))
        out_buf[rows_dev.unsqueeze(1).expand_as(pos), pos] = emitted
        written_dev = written_dev + count
        parts = [n, count, written_dev]
        if eos:
            parts.append(hit.any(1).long())
        host = torch.stack(parts).tolist()  # SYNC: the one per step (accepted counts, ends)
        n_host, count_host, written_host = host[0], host[1], host[2]
        ended = host[3] if eos else [0] * Ba
        if distortion is not None:  # summed on the device; read once at the end
            distortion_sum = distortion_sum + distortion.sum().to(torch.float64)
        accepted_tokens = torch.where(j[:, :N] < n.unsqueeze(1), emitted[:, :N], torch.full_like(emitted[:, :N], -1))
        info = CommitInfo(
            path=path, num_accepted=n, accepted_tokens=accepted_tokens, next_tokens=next_tokens,
            is_chain=draft.is_chain, num_accepted_list=n_host,
        )
        target.commit(info)
        t2 = time.perf_counter()
        drafter.commit(info, tout)
        stats.record_step(n_host, N)
        for r, c in zip(rows_host, count_host):
            stats.new_tokens[r] += c
        roots = next_tokens
        keep = [i for i in range(Ba) if not ended[i] and written_host[i] < max_new_tokens]
        t3 = time.perf_counter()
        stats.draft_seconds += (t1 - t0) + (t3 - t2)
        stats.verify_seconds += t2 - t1
        if len(keep) < Ba:
            drop_finished(keep)

    for r in range(B):
        stats.new_tokens[r] += 1  # the first token, sampled at prefill
    stats.draft_calls = getattr(drafter, "draft_calls", stats.target_calls)
    stats.distortion_total = float(distortion_sum)  # SYNC: once, after the loop
    width = max(stats.new_tokens)
    stats.total_seconds = time.perf_counter() - t_start
    return SpecOutput(torch.cat([input_ids, out_buf[:, :width]], 1), stats)
