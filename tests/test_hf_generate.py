"""The speculative loop reached through transformers' generate(custom_generate=...)."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter
from mmspec.models.hf_generate import speculative_decoding

from conftest import left_padded


def test_custom_generate_greedy_equals_plain_generate(target, good_drafter):
    ids, mask = left_padded([7, 4, 6])
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=15, pad_token_id=0)
    out = target.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=15, pad_token_id=0,
        custom_generate=speculative_decoding, drafter=ModelDrafter(good_drafter, 3),
    )
    assert torch.equal(out, ref)


def test_custom_generate_maps_sampling_settings(target, good_drafter):
    ids, mask = left_padded([5, 5])
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.7, top_k=5, max_new_tokens=6,
              pad_token_id=0, eos_token_id=None)
    torch.manual_seed(0)
    seqs, stats = target.generate(**kw, custom_generate=speculative_decoding, drafter=ModelDrafter(good_drafter, 3),
                                  return_stats=True)
    assert isinstance(stats, mmspec.SpecStats) and seqs.shape == (2, 11)
    # top_k=5 reached the loop: every new token is among the target's 5 most likely at its position.
    logits = target(input_ids=seqs, attention_mask=torch.cat([mask, torch.ones(2, 6, dtype=torch.long)], 1)).logits
    top5 = logits[:, 4:-1].topk(5, -1).indices
    assert (top5 == seqs[:, 5:].unsqueeze(-1)).any(-1).all()


def test_custom_generate_refuses_unsupported_processors(target, good_drafter):
    ids, mask = left_padded([5])
    with pytest.raises(ValueError, match="RepetitionPenalty"):
        target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=4, pad_token_id=0,
                        repetition_penalty=1.3, custom_generate=speculative_decoding,
                        drafter=ModelDrafter(good_drafter, 3))
    with pytest.raises(ValueError, match="drafter"):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, custom_generate=speculative_decoding)
