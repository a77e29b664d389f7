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


def test_custom_generate_invariant_sampling_does_not_depend_on_the_drafter(target, good_drafter, weak_drafter):
    """acceptance="invariant" through generate(custom_generate=...): sampled sequences for a seed are
    the same whichever drafter and K run (and differ from another seed's)."""
    ids, mask = left_padded([7, 4, 6])
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.9, top_p=0.9, max_new_tokens=12,
              pad_token_id=0, eos_token_id=None, custom_generate=speculative_decoding, acceptance="invariant")
    outs = []
    for seed, drafter in ((1, ModelDrafter(good_drafter, 3)), (1, ModelDrafter(weak_drafter, 5)), (2, ModelDrafter(good_drafter, 3))):
        torch.manual_seed(seed)  # generate's sampling draws from torch's global generator
        outs.append(target.generate(**kw, drafter=drafter))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_custom_generate_refuses_unsupported_processors(target, good_drafter):
    ids, mask = left_padded([5])
    with pytest.raises(ValueError, match=r"RepetitionPenaltyLogitsProcessor \(the generation option repetition_penalty\)"):
        target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=4, pad_token_id=0,
                        repetition_penalty=1.3, custom_generate=speculative_decoding,
                        drafter=ModelDrafter(good_drafter, 3))
    with pytest.raises(ValueError, match="drafter"):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, custom_generate=speculative_decoding)


def test_minimum_lengths_that_cannot_act_are_let_through(target, good_drafter):
    """generate builds a minimum-length processor for min_new_tokens=0 and for a min_length the
    prompt already reaches; they change nothing and were refused as unsupported. One that can act
    is still refused."""
    ids, mask = left_padded([7, 4])
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=0, eos_token_id=5)
    ref = target.generate(**kw)
    for extra in (dict(min_new_tokens=0), dict(min_length=ids.shape[1])):
        assert torch.equal(target.generate(**kw, **extra), ref)
        out = target.generate(**kw, **extra, custom_generate=speculative_decoding, drafter=ModelDrafter(good_drafter, 3))
        assert torch.equal(out, ref)
    for extra in (dict(min_new_tokens=2), dict(min_length=ids.shape[1] + 2)):
        with pytest.raises(ValueError, match=r"(MinLengthLogitsProcessor|MinNewTokensLengthLogitsProcessor) \(the "
                                             r"generation option [a-z_ /]*min_(new_tokens|length)"):
            target.generate(**kw, **extra, custom_generate=speculative_decoding, drafter=ModelDrafter(good_drafter, 3))


# ---- options generate() hands to the callable: honoured exactly, or refused by name ----------

def _gen(model, drafter_model, **kw):
    ids, mask = left_padded([7, 4, 6])
    args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    args.update(kw)
    spec = model.generate(**args, custom_generate=speculative_decoding, drafter=ModelDrafter(drafter_model, 3))
    return spec, args


@pytest.mark.parametrize(
    "kw,word",
    [
        (dict(num_beams=3), r"num_beams=3"),
        (dict(num_beams=2, do_sample=True), r"num_beams=2"),
        (dict(max_time=5.0), r"max_time"),
        (dict(return_dict_in_generate=True, output_scores=True), r"output_scores=True"),
        (dict(return_dict_in_generate=True, output_logits=True), r"output_logits=True"),
        (dict(return_dict_in_generate=True, output_hidden_states=True), r"output_hidden_states=True"),
        (dict(return_dict_in_generate=True, output_attentions=True), r"output_attentions=True"),
        (dict(penalty_alpha=0.6, top_k=4), r"contrastive_search"),
    ],
    ids=["beams", "beam-sample", "max_time", "scores", "logits", "hidden", "attentions", "contrastive"],
)
def test_custom_generate_refuses_options_it_cannot_honour(target, good_drafter, kw, word):
    with pytest.raises(ValueError, match=word):
        _gen(target, good_drafter, **kw)


def test_custom_generate_refuses_unhonoured_explicit_processors_and_criteria(target, good_drafter):
    from transformers import MaxTimeCriteria, StoppingCriteria
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with pytest.raises(ValueError, match=r"TopKLogitsWarper with greedy"):
        _gen(target, good_drafter, do_sample=False, logits_processor=[TopKLogitsWarper(2)])
    with pytest.raises(ValueError, match=r"filter_value"):
        _gen(target, good_drafter, do_sample=True, logits_processor=[TopKLogitsWarper(2, filter_value=-5.0)])
    with pytest.raises(ValueError, match=r"TopPLogitsWarper', 'TopKLogitsWarper'.*temperature, then top-k"):
        # generate appends its own TopK(50) after the explicit TopP: top-p before top-k
        _gen(target, good_drafter, do_sample=True, logits_processor=[TopPLogitsWarper(0.9)])
    with pytest.raises(ValueError, match=r"each once"):
        _gen(target, good_drafter, do_sample=True, temperature=0.7, logits_processor=[TemperatureLogitsWarper(0.5)],
             top_k=0)
    with pytest.raises(ValueError, match=r"MaxTimeCriteria"):
        _gen(target, good_drafter, stopping_criteria=[MaxTimeCriteria(5.0)])
    with pytest.raises(ValueError, match=r"Never"):
        _gen(target, good_drafter, stopping_criteria=[Never()])


def test_custom_generate_refuses_inputs_embeds(target, good_drafter):
    ids, mask = left_padded([5, 5])
    with pytest.raises(ValueError, match="inputs_embeds"):
        target.generate(inputs_embeds=target.get_input_embeddings()(ids), attention_mask=mask, max_new_tokens=4,
                        pad_token_id=0, custom_generate=speculative_decoding, drafter=ModelDrafter(good_drafter, 3))


def test_custom_generate_refuses_a_filled_cache_and_synced_gpus(target, good_drafter):
    from transformers import DynamicCache

    ids, mask = left_padded([5, 5])
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=ids[:, :3], attention_mask=mask[:, :3], past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 3
    with pytest.raises(ValueError, match="(past_key_values|cache) already holds 3 cached tokens"):
        target.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, pad_token_id=0,
                        custom_generate=speculative_decoding, drafter=ModelDrafter(good_drafter, 3))
    with pytest.raises(ValueError, match="synced_gpus"):
        speculative_decoding(target, ids, generation_config=target.generation_config, synced_gpus=True,
                             drafter=ModelDrafter(good_drafter, 3), attention_mask=mask)
    # An empty cache (what a caller may hand over for generate to fill) is not a refusal.
    out = target.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=target.config),
                          do_sample=False, max_new_tokens=4, pad_token_id=0, custom_generate=speculative_decoding,
                          drafter=ModelDrafter(good_drafter, 3))
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=4, pad_token_id=0)
    assert torch.equal(out, ref)


def test_custom_generate_honours_explicit_stopping_criteria(target, good_drafter):
    """A MaxLengthCriteria / EosTokenCriteria passed explicitly replaces generate's own; the
    speculative output equals transformers' own decoding with the same list."""
    from transformers import EosTokenCriteria, MaxLengthCriteria

    plain, args = _gen(target, good_drafter, do_sample=False, eos_token_id=None)
    eos = int(plain[0, 7 + 4])  # a token row 0 emits mid-way: stopping there must matter
    for crit in ([MaxLengthCriteria(11)], [EosTokenCriteria(eos)]):
        spec, args = _gen(target, good_drafter, do_sample=False, stopping_criteria=crit)
        ref = target.generate(**args)
        assert torch.equal(spec, ref), (crit, spec[:, 7:], ref[:, 7:])
        assert spec.shape[1] < plain.shape[1] or (spec == 0).sum() > (plain == 0).sum()  # it did stop earlier


def test_custom_generate_honours_explicit_warpers(target, good_drafter):
    """logits_processor=[TopKLogitsWarper(1)] with do_sample=True replaces generate's
    TopK(50): sampling from the top-1 set is deterministic, so the output must equal
    transformers' own decoding with the same list token for token."""
    from transformers.generation.logits_process import TopKLogitsWarper

    spec, args = _gen(target, good_drafter, do_sample=True, logits_processor=[TopKLogitsWarper(1)])
    torch.manual_seed(0)
    ref = target.generate(**args)
    assert torch.equal(spec, ref)


def test_custom_generate_return_dict_and_num_return_sequences(target, good_drafter):
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    out, args = _gen(target, good_drafter, do_sample=False, return_dict_in_generate=True)
    ref = target.generate(**args)
    assert isinstance(out, GenerateDecoderOnlyOutput) and torch.equal(out.sequences, ref.sequences)
    assert out.scores is None and out.logits is None
    out, stats = target.generate(**args, custom_generate=speculative_decoding, drafter=ModelDrafter(good_drafter, 3),
                                 return_stats=True)
    assert torch.equal(out.sequences, ref.sequences) and isinstance(stats, mmspec.SpecStats)
    # num_return_sequences with sampling: generate repeats each prompt; top_k=1 makes every copy
    # deterministic, so each must equal transformers' own output row for row.
    spec, args = _gen(target, good_drafter, do_sample=True, top_k=1, num_return_sequences=2)
    ref = target.generate(**args)
    assert spec.shape == ref.shape == (6, 7 + 12) and torch.equal(spec, ref)


def test_options_generate_keeps_from_the_callable_are_refused(target, good_drafter):
    """transformers does not pass streamer / assistant_model / synced_gpus to a callable
    custom_generate: a streamer got the prompt alone and never end() (a TextIteratorStreamer
    consumer hung), an assistant model was ignored. Refused by name, read off the calling generate."""
    from transformers.generation.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    ids = torch.tensor([[5, 6, 7, 8]])
    kw = dict(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    plain = Recorder()
    target.generate(**kw, streamer=plain)
    assert plain.ended and len(plain.puts) == 7  # the reference: the prompt, then each new token
    spec = dict(custom_generate=speculative_decoding, drafter=ModelDrafter(good_drafter, 3))
    with pytest.raises(ValueError, match="streamer is not supported"):
        target.generate(**kw, streamer=Recorder(), **spec)
    with pytest.raises(ValueError, match="assistant_model= is transformers' own assisted generation"):
        target.generate(**kw, assistant_model=good_drafter, **spec)
    with pytest.raises(ValueError, match="synced_gpus=True is not supported"):
        target.generate(**kw, synced_gpus=True, **spec)
    assert torch.equal(target.generate(**kw, **spec), target.generate(**kw))  # without them it runs


def test_synced_gpus_left_to_its_default_is_refused_where_generate_would_sync(target, good_drafter, monkeypatch):
    """generate turns synced_gpus=None on under ZeRO-3 / FSDP with several processes, but only for
    its own loops: a callable custom_generate ran unsynced there (ranks would hang)."""
    from transformers.generation import utils

    kw = dict(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, do_sample=False, pad_token_id=0,
              custom_generate=speculative_decoding, drafter=ModelDrafter(good_drafter, 3))
    ref = target.generate(**kw)
    monkeypatch.setattr(utils, "is_deepspeed_zero3_enabled", lambda: True)
    monkeypatch.setattr(utils, "_get_torch_distributed_world_size", lambda: 2)
    with pytest.raises(ValueError, match="synced_gpus=True is not supported"):
        target.generate(**kw)
    assert torch.equal(target.generate(**kw, synced_gpus=False), ref)  # asked off by the caller: runs
    monkeypatch.setattr(utils, "_get_torch_distributed_world_size", lambda: 1)
    assert torch.equal(target.generate(**kw), ref)  # one process: nothing to sync


def test_no_attention_mask_takes_padding_from_pad_token_id_as_generate_does(target, good_drafter):
    """attention_mask=None with a pad_token_id that is not EOS and occurs in input_ids: transformers'
    generate masks those tokens, and so does speculative_generate (it attended to the padding: other
    tokens than generate, silently)."""
    ids, _ = left_padded([7, 3, 5, 1])  # padded with 0
    ref = target.generate(input_ids=ids, do_sample=False, max_new_tokens=8, eos_token_id=2, pad_token_id=0)
    for drafter in (ModelDrafter(good_drafter, 3), ModelDrafter(target, 2)):
        out = mmspec.speculative_generate(target, drafter, ids, None, temperature=0, max_new_tokens=8,
                                          eos_token_id=2, pad_token_id=0)
        assert torch.equal(out.sequences, ref)
    # pad_token_id equal to an EOS id (or not given): every token is real, as in generate
    ref = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                          eos_token_id=0, pad_token_id=0)
    out = mmspec.speculative_generate(target, ModelDrafter(good_drafter, 3), ids, None, temperature=0,
                                      max_new_tokens=8, eos_token_id=0, pad_token_id=0)
    assert torch.equal(out.sequences, ref)
    # a pad id inside a prompt cannot be taken for padding: refused by name, on both paths
    holed = torch.tensor([[5, 6, 0, 7, 8], [9, 10, 11, 12, 13]])
    with pytest.raises(ValueError, match=r"attention_mask=None: .* pad_token_id=0 .* occurs inside or fills a prompt"):
        mmspec.speculative_generate(target, ModelDrafter(good_drafter, 3), holed, None, max_new_tokens=4,
                                    eos_token_id=2, pad_token_id=0)
    with pytest.raises(ValueError, match=r"equals input_ids != pad_token_id=0: transformers' generate builds it"):
        target.generate(input_ids=holed, do_sample=False, max_new_tokens=4, eos_token_id=2, pad_token_id=0,
                        custom_generate=speculative_decoding, drafter=ModelDrafter(good_drafter, 3))


def test_a_right_padded_mask_is_told_to_pad_on_the_left(target, good_drafter):
    """Right padding equals input_ids != pad too, but it is no hole inside a prompt: the refusal
    says to pad on the left, as speculative_generate's does."""
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    with pytest.raises(ValueError, match=r"must be left-padded .* re-tokenize with padding_side='left'"):
        target.generate(input_ids=ids, attention_mask=(ids != 0).long(), do_sample=False, max_new_tokens=4,
                        eos_token_id=2, pad_token_id=0, custom_generate=speculative_decoding,
                        drafter=ModelDrafter(good_drafter, 3))
