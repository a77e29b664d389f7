"""A model that is not a transformers model plugs into the core through a `ForwardSpec`
(its own embedding, positions with per-row state, backbone over the ragged cache, head) and
decodes exactly like its own plain, cache-free decoding: batched, left-padded, chains and
trees, as target and as drafter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mmspec
from mmspec.drafters import ModelDrafter
from mmspec.spec import ForwardSpec

from conftest import left_padded

V = 24


class ToyLM(nn.Module):
    """A tiny pre-norm transformer with a learned absolute position table (no RoPE), written
    here so that nothing of transformers is involved."""

    def __init__(self, seed: int, layers: int = 2, dim: int = 16, heads: int = 2):
        super().__init__()
        torch.manual_seed(seed)  # biases keep nn.Linear's default init: make it reproducible
        g = torch.Generator().manual_seed(seed)
        self.heads = heads
        self.tok = nn.Embedding(V, dim)
        self.pos = nn.Embedding(256, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"qkv": nn.Linear(dim, 3 * dim), "o": nn.Linear(dim, dim), "mlp": nn.Linear(dim, dim),
                           "n1": nn.LayerNorm(dim), "n2": nn.LayerNorm(dim)})
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, V, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:  # weights; norms keep their identity init
                    fan_in = 1 if name.startswith(("tok", "pos")) else p.shape[1]
                    p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
            self.out.weight.mul_(2.0)
        self.double().eval()

    def layer(self, block, x, attend):
        """attend(q, k, v) -> attention output; q/k/v [B, H, Q, D]."""
        B, Q, C = x.shape
        q, k, v = block["qkv"](block["n1"](x)).view(B, Q, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = attend(q, k, v).transpose(1, 2).reshape(B, Q, C)
        x = x + block["o"](a)
        return x + block["mlp"](torch.tanh(block["n2"](x)))

    @torch.no_grad()
    def full_logits(self, ids, positions):
        """Cache-free causal forward over one unpadded sequence [1, T]."""
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = self.layer(block, x, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.out(self.norm(x))


class ToySpec(ForwardSpec):
    """The toy model's forward spec. Per-row position offsets (model input `offset` [B]) are
    state the spec owns and row-selects, like Qwen2-VL's rope deltas."""

    def __init__(self, model: ToyLM):
        self.model = model
        self.num_layers = len(model.blocks)
        self.vocab_size = V
        self.dtype = torch.float64
        self.offset = None

    def begin(self, input_ids, attention_mask, model_inputs):
        unknown = set(model_inputs) - {"offset"}
        if unknown:
            raise ValueError(f"ToySpec takes no model inputs {sorted(unknown)}")
        offset = model_inputs.get("offset")
        self.offset = offset if offset is not None else torch.zeros(input_ids.shape[0], dtype=torch.long)

    def select_rows(self, rows):
        self.offset = self.offset.index_select(0, rows)

    def embed(self, tokens):
        return self.model.tok(tokens)

    def positions(self, logical):
        return logical + self.offset.unsqueeze(1)

    def backbone(self, x, positions, attention, kv, features):
        x = x + self.model.pos(positions)
        mask = attention.dense().unsqueeze(1)  # [B, 1, Q, S]
        for i, block in enumerate(self.model.blocks):

            def attend(q, k, v, i=i):
                keys, values = kv.update(i, k, v)
                return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

            x = self.model.layer(block, x, attend)
        return self.model.norm(x), {}

    def head(self, hidden):
        return self.model.out(hidden)


def plain_greedy(model, ids, mask, offsets, n):
    rows = []
    for b in range(ids.shape[0]):
        seq = ids[b][mask[b].bool()].unsqueeze(0)
        for _ in range(n):
            pos = torch.arange(seq.shape[1]).unsqueeze(0) + offsets[b]
            nxt = model.full_logits(seq, pos)[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], 1)
        rows.append(seq[0, -n:])
    return torch.stack(rows)


@pytest.mark.parametrize(
    "tree", [None, mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6)], ids=["chain", "tree"]
)
@pytest.mark.parametrize("drafter_seed", [0, 7], ids=["perfect", "other"])
def test_toy_model_equals_its_own_plain_decoding(tree, drafter_seed):
    target = ToyLM(seed=0)
    drafter = ToyLM(seed=drafter_seed)
    ids, mask = left_padded([7, 3, 5, 1], vocab=V, seed=2)
    offsets = torch.tensor([0, 3, 1, 5])
    n = 14
    ref = plain_greedy(target, ids, mask, offsets, n)
    out = mmspec.speculative_generate(
        mmspec.SpecTarget(ToySpec(target)), ModelDrafter(ToySpec(drafter), tree=tree) if tree else ModelDrafter(ToySpec(drafter), 3),
        ids, mask, temperature=0, max_new_tokens=n, offset=offsets,
    )
    assert torch.equal(out.sequences[:, ids.shape[1]:], ref)
    if drafter_seed == 0:  # the target's weights (its rows without offset agree with it fully)
        assert out.stats.accepted_drafts >= n // 2
    # The reference is not degenerate: rows differ and tokens vary.
    assert len({tuple(r.tolist()) for r in ref}) >= 3 and len(set(ref.flatten().tolist())) > 4


def test_spec_refuses_inputs_it_does_not_use():
    target = ToyLM(seed=0)
    ids, mask = left_padded([3, 2], vocab=V)
    with pytest.raises(ValueError, match="pixel_values"):
        mmspec.speculative_generate(
            mmspec.SpecTarget(ToySpec(target)), ModelDrafter(ToySpec(target), 2), ids, mask,
            temperature=0, max_new_tokens=3, pixel_values=torch.zeros(2, 3),
        )
