"""No silent wrong answers: sliding windows, prefix-LM masks, swallowed keyword arguments,
truthful stats, memory that follows the tokens generated, NaN, refused model families.
Each test fails on the core before the forward-spec rewrite (9945993)."""

from __future__ import annotations

import copy

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter

from conftest import left_padded

COMMON = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, attn_implementation="sdpa", pad_token_id=0, bos_token_id=1, eos_token_id=2)


@torch.no_grad()
def plain_greedy(model, ids, mask, n, **inputs):
    """The model's own greedy decoding, row by row, cache-free (a full forward per token)."""
    rows = []
    for b in range(ids.shape[0]):
        seq = ids[b][mask[b].bool()].unsqueeze(0)
        for _ in range(n):
            seq = torch.cat([seq, model(input_ids=seq, **inputs).logits[:, -1].argmax(-1, keepdim=True)], 1)
        rows.append(seq[0, -n:])
    return torch.stack(rows)


def windowed(name):
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig,
                              MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    torch.manual_seed(0)
    build = {
        "mistral": lambda w: MistralForCausalLM(MistralConfig(sliding_window=w, **COMMON)),
        "qwen2": lambda w: Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, sliding_window=w, max_window_layers=1,
                                                        **COMMON)),
        "gemma2": lambda w: Gemma2ForCausalLM(Gemma2Config(sliding_window=w, head_dim=8,
                                                           **{**COMMON, "attn_implementation": "eager"})),
        "gemma3": lambda w: Gemma3ForCausalLM(Gemma3TextConfig(sliding_window=w, head_dim=8, **COMMON)),
        "phi3": lambda w: Phi3ForCausalLM(Phi3Config(sliding_window=w, **COMMON)),
    }[name]
    return build(4).double().eval()


@pytest.mark.parametrize("tree", [None, mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6)], ids=["chain", "tree"])
@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma2", "gemma3", "phi3"])
def test_sliding_window_models_equal_their_own_decoding(name, tree):
    model = windowed(name)
    ids, mask = left_padded([9, 5, 7, 3])
    n = 12
    ref = plain_greedy(model, ids, mask, n)
    out = mmspec.speculative_generate(model, ModelDrafter(model, tree=tree) if tree else ModelDrafter(model, 3), ids, mask, temperature=0,
                                      max_new_tokens=n)
    assert torch.equal(out.sequences[:, ids.shape[1]:], ref)
    if name == "mistral":  # the window changes the output, so ignoring it would fail this test
        wide = windowed(name)
        wide.config.sliding_window = None
        assert not torch.equal(plain_greedy(wide, ids, mask, n), ref)


def test_prefix_lm_token_type_ids_are_honoured():
    from transformers import GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(0)
    text = GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, pad_token_id=0, initializer_range=0.3)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                image_size=16, patch_size=8)
    model = PaliGemmaForConditionalGeneration(PaliGemmaConfig(
        vision_config=vision, text_config=text, image_token_index=60, projection_dim=32, initializer_range=0.3,
    )).double().eval()
    ids = torch.tensor([[60, 60, 60, 60, 1, 5, 7, 9, 11]])
    px = torch.randn(1, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    results = {}
    for kind, tt in {"prefix": [0] * 9, "causal": [1] * 9}.items():
        tt = torch.tensor([tt])
        seq, t = ids, tt
        with torch.no_grad():
            for _ in range(8):
                nxt = model(input_ids=seq, pixel_values=px, token_type_ids=t).logits[:, -1].argmax(-1, keepdim=True)
                seq, t = torch.cat([seq, nxt], 1), torch.cat([t, torch.ones_like(nxt)], 1)
        out = mmspec.speculative_generate(model, ModelDrafter(model, 3), ids, temperature=0, max_new_tokens=8,
                                          pixel_values=px, token_type_ids=tt)
        assert out.sequences[0, -8:].tolist() == seq[0, -8:].tolist(), kind
        results[kind] = seq[0, -8:].tolist()
    assert results["prefix"] != results["causal"]  # the bidirectional prefix matters here


@pytest.mark.parametrize("bad", [{"do_sample": False}, {"temprature": 0}, {"max_length": 10},
                                 {"pixel_values": torch.zeros(1, 3, 8, 8)}, {"past_key_values": None},
                                 {"cache": None}, {"labels": torch.zeros(2, 5, dtype=torch.long)}])
def test_unknown_or_reserved_keyword_arguments_are_refused(target, weak_drafter, bad):
    ids, mask = left_padded([4, 3])
    with pytest.raises(ValueError, match=next(iter(bad))):
        mmspec.speculative_generate(target, ModelDrafter(weak_drafter, 2), ids, mask, max_new_tokens=4, **bad)


def test_numpy_integers_are_taken_as_the_ints_they_hold(target, weak_drafter):
    import numpy as np

    ids, mask = left_padded([5, 3])
    kw = dict(temperature=0, max_new_tokens=6, eos_token_id=7, pad_token_id=0)
    ref = mmspec.speculative_generate(target, ModelDrafter(weak_drafter, 2), ids, mask, **kw).sequences
    out = mmspec.speculative_generate(target, ModelDrafter(weak_drafter, 2), ids, mask, temperature=0,
                                      max_new_tokens=np.int64(6), eos_token_id=[np.int32(7)], pad_token_id=np.int64(0))
    assert torch.equal(out.sequences, ref)


def test_stats_count_only_emitted_tokens(target):
    ids, mask = left_padded([5, 4])
    # A tree keeps its shape to the end (a chain is held to what can be emitted: below)
    tree = mmspec.TreeConfig(depth=6, top_k=1, num_nodes=6)
    out = mmspec.speculative_generate(target, ModelDrafter(target, tree=tree), ids, mask, temperature=0,
                                      max_new_tokens=3)
    s = out.stats
    assert s.new_tokens == [3, 3]
    # One verify step: 2 tokens emitted per row (the drafter proposed 6 and all were accepted).
    assert s.target_calls == 1 and s.mean_accepted_length == 2.0 and s.accepted_drafts == 4
    assert s.verified_accepted == 12 and s.acceptance_cumulative == [1.0, 1.0]  # 2 of 6 drafts were emitted
    # The chain drafts only the one token that can be emitted before the step's own (then the bonus)
    out = mmspec.speculative_generate(target, ModelDrafter(target, 8), ids, mask, temperature=0, max_new_tokens=3)
    s = out.stats
    assert s.new_tokens == [3, 3] and s.nodes_per_step == [1]
    assert s.target_calls == 1 and s.mean_accepted_length == 2.0 and s.accepted_drafts == 2
    assert s.verified_accepted == 2 and s.acceptance_cumulative == [1.0]


def test_summary_reports_distortion_of_lossy_rules(target, weak_drafter):
    ids, mask = left_padded([5, 4])
    out = mmspec.speculative_generate(target, ModelDrafter(weak_drafter, 3), ids, mask, temperature=1.0,
                                      max_new_tokens=8, acceptance="typical", generator=torch.Generator().manual_seed(0))
    assert not out.stats.lossless and "distortion" in out.stats.summary()
    exact = mmspec.speculative_generate(target, ModelDrafter(weak_drafter, 3), ids, mask, temperature=1.0,
                                        max_new_tokens=8, generator=torch.Generator().manual_seed(0))
    assert "distortion" not in exact.stats.summary()


def test_cache_memory_follows_the_tokens_generated(target):
    ids, mask = left_padded([5, 4])
    ref = plain_greedy(target, ids, mask, 6)
    eos = [int(ref[0, 3]), int(ref[1, 3])]  # both rows end by their 4th token
    from mmspec.models import HFTarget

    t = HFTarget(target)
    out = mmspec.speculative_generate(t, ModelDrafter(target, 3), ids, mask, temperature=0, max_new_tokens=300_000,
                                      eos_token_id=eos)
    assert max(out.stats.new_tokens) <= 4
    # Buffers start at the prompt plus one chunk: nothing near 300k slots was allocated.
    assert t.runner.kv.capacity <= ids.shape[1] + 64 + 8 and t.runner.kv.max_slots > 300_000


def test_cache_grows_in_chunks_and_stays_exact(target):
    from mmspec import ragged

    ids, mask = left_padded([5, 4])
    ref = plain_greedy(target, ids, mask, 150)
    out = mmspec.speculative_generate(target, ModelDrafter(target, 3), ids, mask, temperature=0, max_new_tokens=150)
    assert torch.equal(out.sequences[:, ids.shape[1]:], ref)  # crossed ragged.GROWTH_CHUNK twice
    assert 150 > 2 * ragged.GROWTH_CHUNK


def test_per_position_acceptance_counts_only_positions_proposed(target):
    """Steps that drafted fewer positions (K = 0 under "auto", a shorter K) counted their missing
    positions as rejections: a drafter whose every draft was accepted reported [0.56, 1, 1, 1]."""

    class Alternate:  # the adaptive hook, forced: K = 4, 0, 4, 0, ...
        def __init__(self):
            self.calls = 0

        def choose(self, rows, remaining):
            self.calls += 1
            return 4 if self.calls % 2 else 0

        def observe(self, *args, **kwargs):
            pass

        def skip_draft_cost_once(self):
            pass

    ids, mask = left_padded([9, 5, 7, 3])
    drafter = ModelDrafter(target)  # the target drafts for itself: every draft is accepted
    drafter.controller = Alternate()
    s = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=30).stats
    assert 0 in s.nodes_per_step and 4 in s.nodes_per_step and s.verified_accepted == s.drafted_nodes
    assert s.acceptance_rate_per_position == [1.0] * 4 and s.acceptance_cumulative == [1.0] * 4
    assert s.offer_counts[0] < s.row_steps  # the K = 0 row-steps offered nothing
    # against an independent count from a weaker drafter: accepted / judged at each position
    weak = copy.deepcopy(target)
    with torch.no_grad():
        for p in weak.parameters():
            p.add_(0.3 * torch.randn_like(p))
    s = mmspec.speculative_generate(target, ModelDrafter(weak, 3), ids, mask, temperature=0, max_new_tokens=30).stats
    rates = s.acceptance_rate_per_position
    accepted = s.accept_counts + [0] * (len(s.offer_counts) - len(s.accept_counts))
    assert 0 < rates[0] < 1 and rates == [accepted[i] / s.offer_counts[i] for i in range(len(rates))]
    # every row-step that drafted offered position 0 (the last steps, with one token left, draft nothing)
    drafting = sum(n for n, k in zip(s.active_rows, s.nodes_per_step) if k > 0)
    assert 0 in s.nodes_per_step and s.offer_counts[0] == drafting
    assert all(a >= b for a, b in zip(s.offer_counts, s.offer_counts[1:]))
    full = mmspec.TreeConfig(depth=3, top_k=2, num_nodes=10)  # every candidate kept: the best paths reach depth 3
    tree = mmspec.speculative_generate(target, ModelDrafter(target, tree=full), ids, mask, temperature=0,
                                       max_new_tokens=30).stats
    rates = tree.acceptance_rate_per_position  # the path of the target's own greedy tokens: accepted wherever
    assert rates[:2] == [1.0, 1.0] and 0.9 < rates[2] <= 1.0  # drafted (EAGLE-2 expands a level's best 2 only)


def test_refused_model_families():
    from transformers import BloomConfig, BloomForCausalLM, LlamaConfig, LlamaModel, MambaConfig, MambaForCausalLM

    bloom = BloomForCausalLM(BloomConfig(vocab_size=40, hidden_size=32, n_layer=1, n_head=4))
    mamba = MambaForCausalLM(MambaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, state_size=4))
    headless = LlamaModel(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4))
    from transformers import (BertConfig, BertForMaskedLM, MarianConfig, MarianForCausalLM, T5Config,
                              T5ForConditionalGeneration)

    # Marian (like Bart / Pegasus / Blenderbot ForCausalLM) numbers positions from its cache length:
    # trees and padded rows decoded with wrong positions (greedy output differed from generate)
    marian = MarianForCausalLM(MarianConfig(vocab_size=40, d_model=32, decoder_layers=1, encoder_layers=1,
                                            decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=64,
                                            encoder_ffn_dim=64, pad_token_id=0, decoder_start_token_id=1))
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))
    bert = BertForMaskedLM(BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=64))
    ids = torch.tensor([[3, 4, 5]])
    for model, match in [(bloom, "ALiBi"), (mamba, "state"), (headless, "LM head"), (marian, "takes no position_ids"),
                         (t5, "encoder-decoder"), (bert, "not a generative model")]:
        with pytest.raises(ValueError, match=match):
            mmspec.speculative_generate(model, ModelDrafter(model, 2) if match != "LM head" else None, ids)
        with pytest.raises(ValueError, match=match):
            ModelDrafter(model, 2)


def test_nan_distributions_raise(target, weak_drafter):
    import copy

    ids, mask = left_padded([4, 3])
    broken = copy.deepcopy(weak_drafter)
    with torch.no_grad():
        broken.lm_head.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="drafter distribution"):
        mmspec.speculative_generate(target, ModelDrafter(broken, 2), ids, mask, temperature=1.0, max_new_tokens=6)
    for temperature in (1.0, 0.0):  # greedy: the argmax's one-hot is finite, the logits are checked
        with pytest.raises(ValueError, match="prefill"):
            mmspec.speculative_generate(broken, ModelDrafter(weak_drafter, 2), ids, mask, temperature=temperature,
                                        max_new_tokens=6)


def test_nan_target_raises_in_greedy_decoding_too(target, weak_drafter):
    """Greedy decoding takes the argmax, whose one-hot is finite even for NaN logits: the
    loop checks the logits then. A target whose logits turn NaN after the prefill is refused
    in the first step, speculative or plain (the prefill case: test_nan_distributions_raise);
    a logit of -inf beside finite ones (a masked token) is not an error."""
    import copy

    from mmspec.drafters.null_drafter import NullDrafter

    ids, mask = left_padded([4, 3])

    def hooked(edit):
        """A copy of the target whose LM head output is edited by `edit(logits, call)`."""
        model = copy.deepcopy(target)
        calls = [0]

        def hook(module, args, output):
            calls[0] += 1
            return edit(output.clone(), calls[0])

        model.lm_head.register_forward_hook(hook)
        return model, calls

    def nan_after_prefill(logits, call):
        if call > 1:
            logits[..., 3] = float("nan")
        return logits

    def mask_token_5(logits, call):
        logits[..., 5] = float("-inf")
        return logits

    for drafter in (ModelDrafter(weak_drafter, 2), NullDrafter(target.config.vocab_size)):
        model, calls = hooked(nan_after_prefill)
        with pytest.raises(ValueError, match="non-finite.*target"):
            mmspec.speculative_generate(model, drafter, ids, mask, temperature=0, max_new_tokens=6)
        assert calls[0] == 2  # refused at the first step after the prefill
    model, _ = hooked(mask_token_5)
    out = mmspec.speculative_generate(model, ModelDrafter(weak_drafter, 2), ids, mask, temperature=0,
                                      max_new_tokens=6)
    assert out.stats.new_tokens == [6, 6] and not bool((out.sequences[:, -6:] == 5).any())


def test_named_rules_get_their_tables(target, weak_drafter):
    ids, mask = left_padded([4, 3])
    g = torch.Generator().manual_seed(0)
    out = mmspec.speculative_generate(target, ModelDrafter(weak_drafter, 2), ids, mask, acceptance="gsd",
                                      max_new_tokens=6, generator=g)
    assert out.stats.new_tokens == [6, 6] and not out.stats.lossless  # embeddings came from the target
    with pytest.raises(ValueError, match="codebook.*acceptance_kwargs"):
        mmspec.speculative_generate(target, ModelDrafter(weak_drafter, 2), ids, mask, acceptance="lantern")
    cb = torch.randn(40, 4, generator=g)
    out = mmspec.speculative_generate(target, ModelDrafter(weak_drafter, 2), ids, mask, acceptance="lantern",
                                      acceptance_kwargs={"codebook": cb, "k": 3, "delta": 0.1}, max_new_tokens=6)
    assert out.stats.new_tokens == [6, 6]


def test_protocol_gaps_are_named(target):
    class NoVocab:
        max_draft_nodes = 2

        def prefill(self, *a): ...

        propose = commit = select_rows = prefill

    with pytest.raises(TypeError, match="vocab_size"):
        mmspec.speculative_generate(target, NoVocab(), torch.tensor([[3, 4]]))
    with pytest.raises(ValueError, match="eos_token_id"):
        mmspec.speculative_generate(target, ModelDrafter(target, 2), torch.tensor([[3, 4]]), eos_token_id=True)


def test_cache_keyword_follows_the_forward_signature():
    """transformers 5.24 renamed the models' `past_key_values` argument to `cache` (the old name
    goes through a deprecation shim until 5.40): mmspec passes the cache under the name the
    forward declares, seen through decorators that keep `__wrapped__`."""
    import functools

    from mmspec.models.hf_cache import cache_argument

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False):
            return input_ids

    def shim(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if "past_key_values" in kwargs:
                kwargs["cache"] = kwargs.pop("past_key_values")
            return fn(*args, **kwargs)

        return wrapper

    class New(torch.nn.Module):
        @shim
        def forward(self, input_ids, cache=None, use_cache=False):
            return input_ids

    class Neither(torch.nn.Module):
        def forward(self, x, **kwargs):
            return x

    assert cache_argument(Old()) == "past_key_values"
    assert cache_argument(New()) == "cache"
    assert cache_argument(Neither()) == "past_key_values"
    import transformers
    from packaging.version import Version

    expected = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"
    assert cache_argument(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2))) == expected


def test_a_verdict_cut_from_the_output_counts_neither_way():
    """At the max_new_tokens / EOS cut: a rejected draft whose replacement was cut counted as
    offered (a rejection) while an accepted draft cut there did not count at all, biasing the
    per-position rates low; now neither counts, and an emitted verdict still does."""
    from mmspec import SpecStats

    rejected, accepted, kept = SpecStats(), SpecStats(), SpecStats()
    rejected.record_step([1], 2, emitted=[1])  # d0 accepted, d1 rejected, its replacement cut
    accepted.record_step([2], 2, emitted=[1])  # d0, d1 accepted, d1 and the bonus cut
    kept.record_step([1], 2, emitted=[2])  # d0 accepted, d1 rejected, the replacement emitted
    assert rejected.offer_counts == accepted.offer_counts == [1, 0]
    assert rejected.acceptance_rate_per_position == accepted.acceptance_rate_per_position == [1.0]
    assert kept.offer_counts == [1, 1] and kept.acceptance_rate_per_position == [1.0, 0.0]
