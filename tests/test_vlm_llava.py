"""HF VLMs are wrapped automatically: a tiny LLaVA (saved and re-loaded with
`save_pretrained` / `from_pretrained`, the real checkpoint format) decodes greedily with a
text-only drafter exactly like its own `generate`, images passed as `pixel_values`."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter

from conftest import tiny_llava_config

IMG = 60
V = 64


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(0)
    cfg = tiny_llava_config(V, IMG)
    text = cfg.text_config
    path = tmp_path_factory.mktemp("llava")
    LlavaForConditionalGeneration(cfg).save_pretrained(path)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
    return model.eval(), text


def test_llava_greedy_equals_generate(llava):
    from transformers import LlamaForCausalLM

    model, text = llava
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 50, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = 0
    mask[2, :4] = 0
    ids[2, :4] = 0
    for b, start in enumerate([1, 3, 5]):
        ids[b, start : start + 4] = IMG  # 2x2 patches -> 4 image tokens per row
    pixels = torch.randn(3, 3, 16, 16, dtype=torch.float64, generator=g)
    ref = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, do_sample=False,
                         max_new_tokens=12, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(1)
    drafter = LlamaForCausalLM(text).double().eval()
    for dm in (drafter, _text_only(model)):  # a weak text drafter, and the VLM's own language model
        out = mmspec.speculative_generate(model, ModelDrafter(dm, 3), ids, mask, temperature=0, max_new_tokens=12,
                                          pixel_values=pixels, pad_token_id=0, eos_token_id=2)
        assert torch.equal(out.sequences, ref), (out.sequences[:, 9:], ref[:, 9:])


def _text_only(model):
    """The VLM's own language model + LM head as a (perfect on text) causal-LM drafter."""
    from transformers import LlamaForCausalLM

    lm = LlamaForCausalLM(model.config.text_config).to(torch.float64).eval()
    lm.model.load_state_dict(model.model.language_model.state_dict())
    lm.lm_head.load_state_dict(model.lm_head.state_dict())
    return lm


def test_pixel_values_change_the_output(llava):
    model, _ = llava
    ids = torch.tensor([[5, IMG, IMG, IMG, IMG, 7, 9]])
    a = mmspec.speculative_generate(model, ModelDrafter(_text_only(model), 2), ids, temperature=0, max_new_tokens=8,
                                    pixel_values=torch.zeros(1, 3, 16, 16, dtype=torch.float64))
    b = mmspec.speculative_generate(model, ModelDrafter(_text_only(model), 2), ids, temperature=0, max_new_tokens=8,
                                    pixel_values=torch.ones(1, 3, 16, 16, dtype=torch.float64) * 3)
    assert not torch.equal(a.sequences, b.sequences)
