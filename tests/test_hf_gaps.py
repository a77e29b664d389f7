"""transformers models and options that the loop cannot decode exactly are refused by name:
attention types it cannot mask (Llama-4's chunked layers), RoPE whose frequencies change with
the largest position in a forward (dynamic NTK, LongRoPE) once a request could cross that
switch, token_type_ids that GPT-2-style models embed at every token, and custom_generate's
position_ids; within what is accepted, output equals transformers' own greedy decoding."""

from __future__ import annotations

import pytest
import torch

import mmspec
from conftest import VOCAB, left_padded, noisy_copy
from mmspec.drafters import ModelDrafter
from mmspec.drafters.null_drafter import NullDrafter
from mmspec.models.hf_generate import speculative_decoding


def sharpened(model, factor: float):
    """Scale q/k so that a random model's attention depends visibly on the rotary phase."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ("q_proj", "k_proj", "qkv_proj")):
                p.mul_(factor)
    return model


def dynamic_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0,
                      rope_parameters={"rope_type": "dynamic", "factor": 16.0, "rope_theta": 10000.0})
    return sharpened(LlamaForCausalLM(cfg).double().eval(), 8.0)


def longrope_phi3(seed: int = 0):
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
            "long_factor": [4.0, 8.0, 16.0, 32.0], "original_max_position_embeddings": 16}
    cfg = Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     original_max_position_embeddings=16, pad_token_id=0, rope_parameters=rope, sliding_window=None)
    return sharpened(Phi3ForCausalLM(cfg).double().eval(), 4.0)


def greedy(model, ids, mask, n):
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=0,
                          eos_token_id=None)


def test_llama4_chunked_attention_is_refused():
    """Llama-4's chunked layers (no sliding ones) went through as full attention: drafted
    verify forwards dropped the chunk limit and the output differed from generate."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
                           max_position_embeddings=256, attention_chunk_size=4, no_rope_layer_interval=2)
    model = Llama4ForCausalLM(cfg).eval()
    assert "chunked_attention" in model.config.layer_types
    with pytest.raises(ValueError, match=r"attention types \['chunked_attention'\] that mmspec cannot mask"):
        mmspec.speculative_generate(model, NullDrafter(VOCAB), torch.tensor([[5, 9, 13]]), max_new_tokens=4)


@pytest.mark.parametrize("make", [dynamic_llama, longrope_phi3], ids=["dynamic", "longrope"])
def test_position_dependent_rope_is_exact_before_its_switch_and_refused_across_it(make):
    ids, mask = left_padded([9, 5, 8], seed=1)  # longest prompt 9; the switch is at 16 positions
    model, drafter = make(), ModelDrafter(noisy_copy(make(), 0.05), 3)
    out = mmspec.speculative_generate(model, drafter, ids, mask, temperature=0, max_new_tokens=5)  # reaches 9+4+3
    assert torch.equal(out.sequences, greedy(model, ids, mask, 5))
    with pytest.raises(ValueError, match=r"RoPE, whose frequencies change once a forward sees more than 16 positions; "
                                         r"this request may reach 23 .* lower max_new_tokens to 5"):
        mmspec.speculative_generate(model, drafter, ids, mask, temperature=0, max_new_tokens=12)
    # across the switch the speculative output did differ from generate (the reason for the refusal)
    from mmspec.models import hf_target

    real = hf_target.check_rope_switch
    hf_target.check_rope_switch = lambda *a: None
    try:
        diverged = any(
            not torch.equal(mmspec.speculative_generate(model, drafter, ids, mask, temperature=0,
                                                        max_new_tokens=24).sequences, greedy(model, ids, mask, 24))
            for model, drafter, ids, mask in [(make(s), ModelDrafter(noisy_copy(make(s), 0.05), 4),
                                               *left_padded([9, 5, 8, 3], seed=s)) for s in range(3)])
    finally:
        hf_target.check_rope_switch = real
    assert diverged


def test_longrope_prompts_all_past_the_switch_run_on_the_long_factor_as_generate_does():
    model = longrope_phi3()
    drafter = ModelDrafter(noisy_copy(longrope_phi3(), 0.05), 3)
    ids, mask = left_padded([20, 18], seed=2)
    out = mmspec.speculative_generate(model, drafter, ids, mask, temperature=0, max_new_tokens=12)
    assert torch.equal(out.sequences, greedy(model, ids, mask, 12))
    ids, mask = left_padded([20, 12], seed=2)  # one row starts before the switch
    with pytest.raises(ValueError, match="or give every row a prompt longer than 16 tokens"):
        mmspec.speculative_generate(model, drafter, ids, mask, temperature=0, max_new_tokens=12)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)).double().eval()


def test_gpt2_token_type_ids_are_refused_where_generate_embeds_them_at_every_token():
    """They reached the prompt's prefill only; generate extends them to every generated token."""
    model = gpt2()
    ids, mask = left_padded([6, 4], seed=3)
    types = torch.zeros_like(ids)
    types[:, -2:] = 3
    assert not torch.equal(model.generate(input_ids=ids, attention_mask=mask, token_type_ids=types, do_sample=False,
                                          max_new_tokens=6, pad_token_id=0), greedy(model, ids, mask, 6))
    with pytest.raises(ValueError, match="GPT2LMHeadModel adds a token type embedding to every token"):
        mmspec.speculative_generate(model, NullDrafter(VOCAB), ids, mask, max_new_tokens=6, token_type_ids=types)
    with pytest.raises(ValueError, match="drop token_type_ids"):
        model.generate(input_ids=ids, attention_mask=mask, token_type_ids=types, do_sample=False, max_new_tokens=6,
                       pad_token_id=0, custom_generate=speculative_decoding, drafter=NullDrafter(VOCAB))


def test_custom_generate_position_ids_are_honoured_or_refused():
    """They were dropped: generate(position_ids=offset) answered as without them."""
    model = gpt2()
    ids, mask = left_padded([6, 4], seed=3)
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6, pad_token_id=0,
              custom_generate=speculative_decoding, drafter=ModelDrafter(noisy_copy(model, 0.1), 3))
    default = (mask.cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(model.generate(**kw, position_ids=default), greedy(model, ids, mask, 6))
    with pytest.raises(ValueError, match="position_ids other than each row's 0, 1, 2"):
        model.generate(**kw, position_ids=default + 20)


def test_a_refused_streamer_is_ended():
    """generate hands the streamer the prompt before the custom loop runs: a refusal without
    end() left a TextIteratorStreamer's consumer waiting forever."""
    from transformers.generation.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def __init__(self):
            self.ended = False

        def put(self, value):
            pass

        def end(self):
            self.ended = True

    model, streamer = gpt2(), Recorder()
    with pytest.raises(ValueError, match="streamer is not supported"):
        model.generate(input_ids=torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False, pad_token_id=0,
                       streamer=streamer, custom_generate=speculative_decoding, drafter=NullDrafter(VOCAB))
    assert streamer.ended


def plain_rows(model, ids, mask, n):
    """Each row decoded alone by generate (a padded batch would feed a short row's pads positions too)."""
    rows = []
    for i in range(ids.shape[0]):
        real = ids[i][mask[i].bool()].unsqueeze(0)
        rows.append(model.generate(input_ids=real, do_sample=False, max_new_tokens=n, pad_token_id=0,
                                   eos_token_id=None)[0, real.shape[1]:])
    return rows


@pytest.mark.parametrize("static", [False, True])
def test_gpt2_decodes_up_to_its_position_table_with_rows_of_different_lengths(static):
    """A static target fed a finished (inert) row at its next position, which after capped last
    drafts could be n_positions itself: an IndexError on wpe while other rows still decoded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from mmspec.models import HFTarget

    torch.manual_seed(2)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=48,
                                       initializer_range=0.5)).double().eval()
    ids, mask = left_padded([1, 10, 5], seed=10)
    out = mmspec.speculative_generate(HFTarget(model, static=static), ModelDrafter(noisy_copy(model, 0.3), 4), ids,
                                      mask, temperature=0, max_new_tokens=39)
    for row, ref in zip(out.sequences[:, ids.shape[1]:], plain_rows(model, ids, mask, 39)):
        assert torch.equal(row, ref)


def test_position_tables_and_cacheless_models_are_found():
    """BERT-style decoders keep their table at embeddings.position_embeddings (missed: drafts ran
    past it, an index error); OpenAI-GPT has no KV cache (every request failed in attention)."""
    from transformers import BertConfig, BertLMHeadModel, OpenAIGPTConfig, OpenAIGPTLMHeadModel

    from mmspec.models import HFTarget

    torch.manual_seed(0)
    bert = BertLMHeadModel(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=40, is_decoder=True,
                                      pad_token_id=0)).double().eval()
    assert HFTarget(bert).max_positions == 40
    ids, mask = left_padded([10], seed=1)
    out = mmspec.speculative_generate(bert, ModelDrafter(noisy_copy(bert, 0.2), 3), ids, mask, temperature=0,
                                      max_new_tokens=31)  # capped at the table's end, as plain decoding fits
    assert torch.equal(out.sequences[0, 10:], plain_rows(bert, ids, mask, 31)[0])
    with pytest.raises(ValueError, match="lower max_new_tokens to 31"):
        mmspec.speculative_generate(bert, ModelDrafter(bert, 3), ids, mask, temperature=0, max_new_tokens=32)
    gpt = OpenAIGPTLMHeadModel(OpenAIGPTConfig(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=40))
    with pytest.raises(ValueError, match=r"OpenAIGPTLMHeadModel \(openai-gpt\) takes no KV cache"):
        HFTarget(gpt)


def test_the_position_check_counts_how_far_drafts_reach():
    """A tree reaches its depth past the root, not its node count, and a one-token request drafts
    nothing: both were refused near a position table's end although every forward fit."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from mmspec import TreeConfig

    torch.manual_seed(2)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=48)).double().eval()
    small = noisy_copy(model, 0.3)
    ids, mask = left_padded([10], seed=4)
    tree = ModelDrafter(small, tree=TreeConfig(depth=2, top_k=2, num_nodes=6))
    out = mmspec.speculative_generate(model, tree, ids, mask, temperature=0, max_new_tokens=37)  # deepest: 47
    assert torch.equal(out.sequences[0, 10:], plain_rows(model, ids, mask, 37)[0])
    full, full_mask = left_padded([48], seed=4)
    out = mmspec.speculative_generate(model, tree, full, full_mask, temperature=0, max_new_tokens=1)
    assert torch.equal(out.sequences[0, 48:], plain_rows(model, full, full_mask, 1)[0])
    with pytest.raises(ValueError, match="position table"):
        mmspec.speculative_generate(model, tree, ids, mask, temperature=0, max_new_tokens=38)
