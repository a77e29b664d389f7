"""Drafters declare the target features they read (`FeatureRequest`); the target returns
exactly those at prefill and at every verify, equal to the model's own hidden states, and
nothing when nothing is asked."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter

from conftest import left_padded


class Recording(ModelDrafter):
    """A ModelDrafter that asks for features and keeps what the target hands it."""

    def __init__(self, model, features):
        super().__init__(model, 2)
        self.features = features
        self.seen = []

    def prefill(self, input_ids, attention_mask, target_out, model_inputs, max_new_tokens):
        self.seen.append(target_out)
        super().prefill(input_ids, attention_mask, target_out, model_inputs, max_new_tokens)

    def commit(self, info, target_out):
        self.seen.append(target_out)
        super().commit(info, target_out)


@torch.no_grad()
def test_requested_layers_equal_the_models_hidden_states(target, good_drafter):
    ids, mask = left_padded([6, 4])
    req = mmspec.FeatureRequest(hidden_layers=(0, -1), last_hidden=True, positions=True)
    drafter = Recording(good_drafter, req)
    out = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=6)
    pre = drafter.seen[0]
    ref = target(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    valid = mask.bool()
    # Decoder layer i's output is hidden_states[i + 1]; the final normed state is hidden_states[-1].
    torch.testing.assert_close(pre.layer_states[0][valid], ref.hidden_states[1][valid])
    # The last decoder layer's output, put through the final norm, is the final hidden state.
    torch.testing.assert_close(target.model.norm(pre.layer_states[-1])[valid], ref.hidden_states[-1][valid])
    torch.testing.assert_close(pre.hidden_states[valid], ref.hidden_states[-1][valid])
    assert pre.positions.shape == ids.shape
    # At verify: the features of every verified token, consistent with a plain forward.
    step = drafter.seen[1]
    assert step.hidden_states.shape[:2] == step.logits.shape[:2] and set(step.layer_states) == {0, -1}
    seq = out.sequences
    n_first = ids.shape[1] + 1  # prompt + the prefill token (the first verify's root)
    full = target(input_ids=seq[:, :n_first], attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1),
                  output_hidden_states=True)
    torch.testing.assert_close(step.hidden_states[:, 0], full.hidden_states[-1][:, -1])


def test_nothing_is_computed_when_nothing_is_asked(target, good_drafter):
    ids, mask = left_padded([3, 5])
    drafter = Recording(good_drafter, mmspec.FeatureRequest())
    mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=4)
    for out in drafter.seen:
        assert out.hidden_states is None and out.layer_states == {} and out.positions is None


def test_a_target_without_features_is_refused(good_drafter):
    class Bare:
        vocab_size = 40

        def prefill(self, *a):  # pragma: no cover - never reached
            raise AssertionError

        verify = commit = select_rows = prefill

    drafter = Recording(good_drafter, mmspec.FeatureRequest(last_hidden=True))
    ids, mask = left_padded([3])
    with pytest.raises(TypeError, match="supports_features"):
        mmspec.speculative_generate(Bare(), drafter, ids, mask, temperature=0, max_new_tokens=4)
    with pytest.raises(TypeError, match="tuple of ints"):
        mmspec.FeatureRequest(hidden_layers=[1])
