"""Bad input gets a ValueError / TypeError whose message names the argument."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter

from conftest import left_padded, tiny_llama


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(layers=1, seed=0), tiny_llama(layers=1, seed=1)


def run(pair, **kw):
    target, drafter = pair
    ids, mask = left_padded([4, 3])
    args = dict(input_ids=ids, attention_mask=mask, temperature=0, max_new_tokens=4)
    args.update(kw)
    d = args.pop("drafter", None) or ModelDrafter(drafter, 2)
    return mmspec.speculative_generate(args.pop("target", target), d, **args)


@pytest.mark.parametrize(
    "kwargs,word",
    [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_k=0, temperature=1.0), "top_k"),
        (dict(top_p=1.5, temperature=1.0), "top_p"),
        (dict(input_ids=torch.ones(3, dtype=torch.long), attention_mask=None), "input_ids"),
        (dict(input_ids=torch.ones(2, 3)), "input_ids"),
        (dict(attention_mask=torch.ones(2, 9, dtype=torch.long)), "attention_mask"),
        (dict(attention_mask=torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])), "left-padded"),
        # -1 for padding was read as a token (a different answer, silently); 0.5 as padding
        (dict(attention_mask=torch.tensor([[-1, 1, 1, 1], [1, 1, 1, 1]])), "only 0 .padding. and 1"),
        (dict(attention_mask=torch.tensor([[0.5, 1, 1, 1], [1, 1, 1, 1]])), "e.g. 0.5"),
        (dict(attention_mask=torch.tensor([[0, 2, 2, 2], [2, 2, 2, 2]])), "e.g. 2"),
        (dict(acceptance="nope"), "acceptance"),
        (dict(eos_token_id=-3), "eos_token_id"),
        (dict(pad_token_id=-1), "pad_token_id"),
        # The greedy rule emits argmaxes: with temperature > 0 it silently decoded greedily.
        (dict(acceptance="greedy", temperature=1.0), "acceptance='greedy' decodes greedily"),
    ],
)
def test_bad_arguments_raise_value_error(pair, kwargs, word):
    with pytest.raises(ValueError, match=word):
        run(pair, **kwargs)


def test_bool_and_float_masks_of_zeros_and_ones_are_honoured(pair):
    ids, mask = left_padded([4, 3])
    ref = run(pair, attention_mask=mask).sequences
    assert torch.equal(run(pair, attention_mask=mask.bool()).sequences, ref)
    assert torch.equal(run(pair, attention_mask=mask.float()).sequences, ref)


def test_mismatched_vocabularies(pair):
    other = tiny_llama(layers=1, seed=2, vocab=41)
    with pytest.raises(ValueError, match="vocabulary"):
        run(pair, drafter=ModelDrafter(other, 2))


def test_wrong_object_types(pair):
    with pytest.raises(TypeError, match="drafter"):
        run(pair, drafter=object())
    with pytest.raises(TypeError, match="target"):
        run(pair, target=object())
    with pytest.raises(TypeError, match="acceptance"):
        run(pair, acceptance=3.5)
    with pytest.raises(TypeError, match="tree"):
        ModelDrafter(pair[1], 2, tree=(3, 3, 8))


def test_a_generator_that_is_not_one_torch_generator_is_refused_by_name(pair):
    # Before: an int failed deep in the first draw with "'int' object has no attribute
    # 'device'"; a list (diffusers' one generator per image) the same way.
    with pytest.raises(TypeError, match="generator must be None or a torch.Generator, got int"):
        run(pair, temperature=1.0, generator=3)
    with pytest.raises(ValueError, match="list of 2 generators"):
        run(pair, temperature=1.0, generator=[torch.Generator(), torch.Generator()])
    out = run(pair, temperature=1.0, generator=torch.Generator().manual_seed(0))  # one generator: fine
    assert out.sequences.shape[0] == 2


@pytest.mark.parametrize(
    "kwargs,word",
    [(dict(depth=0), "depth"), (dict(top_k=0), "top_k"), (dict(num_nodes=0), "num_nodes"),
     (dict(depth=2, top_k=2, num_nodes=50), "num_nodes")],
)
def test_tree_config_validation(kwargs, word):
    with pytest.raises(ValueError, match=word):
        mmspec.TreeConfig(**kwargs)


def test_num_draft_tokens_validation(pair):
    with pytest.raises(ValueError, match="num_draft_tokens"):
        ModelDrafter(pair[1], -1)


def test_rule_shape_errors_name_the_argument():
    from mmspec.acceptance import ExactAcceptance

    rule = ExactAcceptance()
    p = torch.full((2, 4, 5), 0.2)
    with pytest.raises(ValueError, match="target_probs"):
        rule.verify(torch.zeros(2, 4, dtype=torch.long), None, p)
    with pytest.raises(ValueError, match="draft_probs"):
        rule.verify(torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3, 4), 0.25), p)
    with pytest.raises(ValueError, match="draft_tokens"):
        rule.verify(torch.full((2, 3), 7, dtype=torch.long), None, p)


def test_degenerate_residual_never_nan():
    from mmspec.acceptance import ExactAcceptance

    rule = ExactAcceptance()
    p = torch.softmax(torch.randn(64, 4, 6, generator=torch.Generator().manual_seed(0)), -1)
    q = p[:, :3].clone()
    x = torch.multinomial(q.reshape(-1, 6), 1).view(64, 3)
    res = rule.verify(x, q, p, generator=torch.Generator().manual_seed(1))
    assert (res.num_accepted == 3).all()  # p == q: always accepted
    resid = rule.residual(x[:, 0], p[:, 0], q[:, 0])
    assert torch.isfinite(resid).all() and torch.allclose(resid.sum(-1), torch.ones(64))


def test_continuous_rule_is_refused_for_discrete_tokens(pair):
    with pytest.raises(ValueError, match="continuous tokens"):
        run(pair, acceptance="continuous")
    from mmspec.acceptance import ContinuousAcceptance

    with pytest.raises(TypeError, match="discrete"):
        run(pair, acceptance=ContinuousAcceptance())


def test_mrope_models_are_refused_by_the_generic_adapter():
    from mmspec.models import HFTarget

    class MRopeLike(torch.nn.Module):
        config = type("Cfg", (), {"vocab_size": 10})()

        def forward(self, input_ids=None, image_grid_thw=None):
            raise AssertionError("never called")

    with pytest.raises(ValueError, match="M-RoPE"):
        HFTarget(MRopeLike())


def test_learned_position_tables_bound_the_request():
    """GPT-2 / OPT / CTRL index a position table: a request whose drafts could run past it
    failed deep in the forward (IndexError; on CUDA a device-side assert), also where plain
    decoding fits. Now a chain drafter is held to the room left before the table's end, step by
    step (whatever plain decoding can do, speculation does, and equals it); a drafter whose
    shape is fixed (a tree, static shapes) is refused up front by name."""
    from transformers import CTRLConfig, CTRLLMHeadModel, GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

    from mmspec.models.hf_spec import learned_position_limit

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2)).eval()
    opt = OPTForCausalLM(OPTConfig(vocab_size=50, max_position_embeddings=16, hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, ffn_dim=64, word_embed_proj_dim=32)).eval()
    ctrl = CTRLLMHeadModel(CTRLConfig(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2, dff=64)).eval()
    ids = torch.randint(3, 50, (2, 10))
    for model in (gpt2, opt, ctrl):
        assert learned_position_limit(model) == 16  # OPT's table has 18 rows, offset 2; CTRL's is a sinusoid buffer
        # 10 + 4 new tokens + 2 draft positions = 16: fits, and equals plain greedy decoding
        out = mmspec.speculative_generate(model, ModelDrafter(model, 2), ids, max_new_tokens=4, temperature=0)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             pad_token_id=0)
        assert torch.equal(out.sequences, ref)
        # 10 + 7 - 1 = 16 positions, the whole table, for plain decoding; K = 3 drafts reached 18
        # (an IndexError in the drafter's forward before): chains are now capped near the end
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=7, do_sample=False,
                             pad_token_id=0)
        fixed = ModelDrafter(model, 3)
        for drafter in (fixed, ModelDrafter(model), fixed):  # K = 3, "auto", and K = 3 reused
            out = mmspec.speculative_generate(model, drafter, ids, max_new_tokens=7, temperature=0)
            assert torch.equal(out.sequences, ref)
            assert out.stats.nodes_per_step[-1] < 3 or drafter is not fixed  # the last steps drafted fewer
        assert out.stats.nodes_per_step[0] == 3  # a new request starts uncapped
        sampled = mmspec.speculative_generate(model, ModelDrafter(model, 3), ids, max_new_tokens=7, temperature=1.0,
                                              generator=torch.Generator().manual_seed(0))  # exact sampling, capped too
        assert sampled.sequences.shape == ref.shape and sampled.stats.nodes_per_step[-1] < 3
        tree = ModelDrafter(model, tree=mmspec.TreeConfig(depth=2, top_k=2, num_nodes=3))  # a fixed shape
        with pytest.raises(ValueError, match=r"up to 2 draft positions may need 18 positions, more than the target's "
                                             r"position table holds \(16\); draft fewer tokens \(a shallower tree or "
                                             r"chain\) or lower max_new_tokens to 5"):  # a tree reaches its depth
            mmspec.speculative_generate(model, tree, ids, max_new_tokens=7, temperature=0)
        with pytest.raises(ValueError, match="needs 17 positions.*lower max_new_tokens to 7"):  # plain cannot either
            mmspec.speculative_generate(model, ModelDrafter(model, 1), ids, max_new_tokens=8, temperature=0)
    wide = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=1, n_head=2)).eval()
    assert learned_position_limit(wide) == 64
    assert learned_position_limit(tiny_llama(layers=1)) is None  # RoPE: no table
    with pytest.raises(ValueError, match="the prompt's 20 positions are more than the drafter's"):
        mmspec.speculative_generate(wide, ModelDrafter(gpt2, 2), torch.randint(3, 50, (1, 20)), max_new_tokens=2,
                                    temperature=0)


def test_a_target_with_active_dropout_is_refused():
    """A target left in training mode with dropout decoded at random (a fresh mask per forward):
    neither its plain decoding nor speculation reproduced anything. Refused by name now; training
    mode without active dropout, and a drafter with dropout (verification keeps the output
    exact), run and equal eval-mode greedy decoding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mmspec.models.eval_mode import active_dropout

    def llama(dropout: float):
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, attention_dropout=dropout,
                                            attn_implementation="sdpa")).double()

    ids, mask = left_padded([5, 3])
    reference = llama(0.3).eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                           pad_token_id=0)
    noisy = llama(0.3).train()
    assert active_dropout(noisy) == "model.layers.0.self_attn.attention_dropout (p=0.3)"
    assert active_dropout(noisy.eval()) is None
    noisy.train()
    with pytest.raises(ValueError, match=r"the target model \(LlamaForCausalLM\) is in training mode with active "
                                         r"dropout at model.layers.0.self_attn.attention_dropout.*call model.eval\(\)"):
        mmspec.speculative_generate(noisy, ModelDrafter(llama(0.0).eval(), 2), ids, mask, max_new_tokens=8,
                                    temperature=0)
    wrapped = mmspec.models.HFTarget(llama(0.3).eval())  # built once, reused across calls ...
    mmspec.speculative_generate(wrapped, ModelDrafter(llama(0.0).eval(), 2), ids, mask, max_new_tokens=2, temperature=0)
    wrapped.model.train()  # ... and switched to training in between: the next request is refused
    with pytest.raises(ValueError, match="in training mode with active dropout"):
        mmspec.speculative_generate(wrapped, ModelDrafter(llama(0.0).eval(), 2), ids, mask, max_new_tokens=2,
                                    temperature=0)
    still = llama(0.0).train()  # training mode, nothing dropped: the same numbers as eval mode
    assert active_dropout(still) is None
    for target, drafter in ((still, llama(0.0).eval()), (llama(0.3).eval(), noisy)):
        out = mmspec.speculative_generate(target, ModelDrafter(drafter, 3), ids, mask, max_new_tokens=8,
                                          temperature=0, pad_token_id=0)
        assert torch.equal(out.sequences, reference)


def test_an_image_target_with_active_dropout_is_refused():
    from _llamagen_helpers import tiny_gpt

    from mmspec.models.llamagen_spec import LlamaGenTarget

    gpt = tiny_gpt(0).train()  # LlamaGen's defaults: resid / ffn / token dropout 0.1
    with pytest.raises(ValueError, match=r"LlamaGenGPT\) is in training mode with active dropout"):
        LlamaGenTarget(gpt)
    LlamaGenTarget(gpt.eval())


def test_guided_unconditional_prompts_are_bounded_by_the_position_table():
    """CFG over GPT-2: unconditional prompts longer than the conditional ones reach further into
    the position table than the loop's check (made on the conditional prompt) sees; a request
    whose unconditional rows could run past it failed with an IndexError at its last steps."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2)).double().eval()
    ids = torch.randint(3, 50, (1, 10))
    short = mmspec.GuidedTarget(gpt2, 2.0, uncond_input_ids=torch.randint(3, 50, (1, 8)))
    out = mmspec.speculative_generate(short, ModelDrafter(gpt2, 2), ids, max_new_tokens=5, temperature=0)
    assert out.sequences.shape == (1, 15)
    long = mmspec.GuidedTarget(gpt2, 2.0, uncond_input_ids=torch.randint(3, 50, (1, 12)))
    with pytest.raises(ValueError, match=r"the unconditional prompts \(12 tokens\) \+ max_new_tokens 5 \+ up to 2 draft "
                                         r"positions may need 18 positions, more than the target's position table"):
        mmspec.speculative_generate(long, ModelDrafter(gpt2, 2), ids, max_new_tokens=5, temperature=0)


def test_a_rule_needing_a_table_names_the_object_to_pass(pair):
    """The advice was acceptance_kwargs=..., which the VLM pipeline's call does not take; the rule
    object works everywhere, so it comes first."""
    with pytest.raises(ValueError, match=r"acceptance= \(e.g. LanternAcceptance\(codebook=\.\.\.\)\), or to "
                                         r"speculative_generate acceptance_kwargs"):
        run(pair, acceptance="lantern", temperature=1.0)
