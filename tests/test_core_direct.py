"""The direct step path (mmspec/models/hf_direct.py) calls a decoder-only model's own modules
without its wrappers: its logits and features must be bit-identical to the model's own forward,
for every whitelisted family, over chains and trees of a left-padded batch; it must actually be
taken (else the equality says nothing) and must step aside where it could change what runs."""

from __future__ import annotations

import pytest
import torch

from mmspec.models.hf_spec import HFSpec
from mmspec.spec import SpecRunner
from mmspec.types import FeatureRequest

from conftest import left_padded

V = 48


def family_model(family: str, dtype=torch.float32):
    import transformers

    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
    if family == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif family == "mistral":  # a sliding window shorter than the prompts: the mask must carry it
        config, cls = transformers.MistralConfig(**common, sliding_window=6), transformers.MistralForCausalLM
    elif family == "qwen2":  # q/k/v biases
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:  # qwen3: q/k norms inside attention, explicit head_dim
        config, cls = transformers.Qwen3Config(**common, head_dim=16), transformers.Qwen3ForCausalLM
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(config).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


TREE_PARENTS = [-1, 0, 0, 1, 2]  # root, two children, a grandchild under each


def tree_inputs(B: int, parents: list[int]):
    Q = len(parents)
    vis = torch.zeros(Q, Q, dtype=torch.bool)
    depth = torch.zeros(Q, dtype=torch.long)
    for q in range(Q):
        j = q
        while j >= 0:
            vis[q, j] = True
            j = parents[j]
        depth[q] = int(vis[q].sum()) - 1
    return depth.expand(B, Q).clone(), vis.expand(B, Q, Q).clone()


def run_steps(model, direct: bool, features: FeatureRequest, prompt=None, model_inputs=None):
    """Prefill a left-padded batch, verify a tree, commit a path, verify a chain; returns every
    step output."""
    spec = HFSpec(model)
    assert (spec._direct is not None), "the family is whitelisted"
    if not direct:
        spec._direct = None
    runner = SpecRunner(spec)
    ids, mask = prompt if prompt is not None else left_padded([9, 5, 7], vocab=V)
    B = ids.shape[0]
    runner.prefill(ids, mask, 64, model_inputs or {}, features)
    g = torch.Generator().manual_seed(3)
    outs = []
    depth, vis = tree_inputs(B, TREE_PARENTS)
    tokens = torch.randint(1, V, (B, len(TREE_PARENTS)), generator=g)
    outs.append(runner.forward(tokens, depth, vis, 0))
    # Keep root -> 2 -> 4 in row 0, root -> 1 in row 1, the root alone in row 2.
    path = torch.tensor([[0, 2, 4], [0, 1, 1], [0, 0, 0]])
    counts = torch.tensor([3, 2, 1])
    runner.advance(counts, counts.tolist(), path)
    depth, vis = tree_inputs(B, [-1, 0, 1])
    tokens = torch.randint(1, V, (B, 3), generator=g)
    outs.append(runner.forward(tokens, depth, vis, 0))
    runner.advance(torch.tensor([1, 3, 2]), [1, 3, 2])
    tokens = torch.randint(1, V, (B, 1), generator=g)
    outs.append(runner.forward(tokens, torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, 1, dtype=torch.bool), 0,
                               last_only=True))
    return outs


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_direct_steps_are_bit_identical_to_the_models_forward(family):
    model = family_model(family)
    features = FeatureRequest(last_hidden=True, hidden_layers=(0, -1))
    calls = {"n": 0}
    original = model.forward

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    model.forward = counting
    direct = run_steps(model, True, features)
    direct_calls = calls["n"]
    calls["n"] = 0
    plain = run_steps(model, False, features)
    assert direct_calls == 1, "only the prefill goes through the model's own forward on the direct path"
    assert calls["n"] == 4
    for a, b in zip(direct, plain):
        assert a.logits.shape == b.logits.shape
        assert torch.equal(a.logits, b.logits)
        assert torch.equal(a.hidden, b.hidden)
        assert sorted(a.layers) == sorted(b.layers) == [-1, 0]
        for i in a.layers:
            assert torch.equal(a.layers[i], b.layers[i])


def count_forwards(model):
    import functools

    calls = {"n": 0}
    original = model.forward

    @functools.wraps(original)  # keeps the signature the spec reads
    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    model.forward = counting
    return calls


def test_llava_steps_are_bit_identical_to_the_models_forward():
    """LLaVA: the prefill merges the image through the model's own forward; the steps after it
    (no images) run its Llama language model directly, with the same logits and features."""
    from transformers import LlavaForConditionalGeneration

    from conftest import tiny_llava_config

    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(tiny_llava_config(V, 45)).eval()
    model.config.text_config._attn_implementation = "sdpa"
    ids, mask = left_padded([11, 8, 9], vocab=40)
    for b, n in enumerate([11, 8, 9]):
        start = ids.shape[1] - n + 2
        ids[b, start : start + 4] = 45  # 2x2 patches -> 4 image tokens per row
    pixels = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    features = FeatureRequest(last_hidden=True, hidden_layers=(0, -1), image_features=True)
    calls = count_forwards(model)
    direct = run_steps(model, True, features, (ids, mask), {"pixel_values": pixels})
    assert calls["n"] == 1, "only the prefill goes through the model's own forward on the direct path"
    calls["n"] = 0
    plain = run_steps(model, False, features, (ids, mask), {"pixel_values": pixels})
    assert calls["n"] == 4
    for a, b in zip(direct, plain):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
        assert a.image_features is None and b.image_features is None  # steps carry no image
        for i in (0, -1):
            assert torch.equal(a.layers[i], b.layers[i])
    # A hook on the language model (skipped by the direct path) sends every step through the
    # model's own forward, so the hook runs.
    seen = []
    handle = model.model.language_model.register_forward_hook(lambda m, a, o: seen.append(1))
    run_steps(model, True, features, (ids, mask), {"pixel_values": pixels})
    handle.remove()
    assert len(seen) == 4


def test_the_direct_path_steps_aside_for_hooks_training_and_subclasses():
    import transformers

    model = family_model("llama")
    seen = []
    handle = model.model.register_forward_hook(lambda m, a, o: seen.append(1))
    run_steps(model, True, FeatureRequest())
    assert len(seen) == 4, "a hook on the base model runs at every forward, steps included"
    handle.remove()

    spec = HFSpec(model)
    model.train()
    assert not spec._direct.usable(model)
    model.eval()
    assert spec._direct.usable(model)

    class MyLlama(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):  # a subclass may change the forward: never bypassed
            return super().forward(*args, **kwargs)

    sub = MyLlama(model.config).eval()
    assert HFSpec(sub)._direct is None
    assert HFSpec(family_model("qwen2"))._direct is not None


def test_direct_path_refuses_an_out_of_range_feature_layer():
    model = family_model("llama")
    direct = HFSpec(model)._direct
    tokens = torch.ones(1, 1, dtype=torch.long)
    for bad in (3, -4):
        with pytest.raises(ValueError, match=f"hidden layer {bad} out of range for a 3-layer model"):
            direct.forward(model, tokens, None, torch.zeros(1, 1, dtype=torch.long), None, keep=0,
                           last_hidden=False, hidden_layers=(bad,))


def test_vlm_wrappers_take_the_direct_path_only_over_a_whitelisted_language_model():
    """LLaVA-NeXT over Llama is whitelisted; over Gemma (its embedding is scaled inside the
    model's forward, which the direct path would skip) it is not."""
    from transformers import CLIPVisionConfig, GemmaConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    from mmspec.models.hf_direct import decoder_path

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=16, patch_size=8, projection_dim=32)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    for text, expected in ((LlamaConfig(**common), ("model", "language_model")), (GemmaConfig(**common, head_dim=8), None)):
        cfg = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=45, image_grid_pinpoints=[[16, 32]])
        model = LlavaNextForConditionalGeneration(cfg)
        assert decoder_path(model) == expected
        assert (HFSpec(model)._direct is None) == (expected is None)
