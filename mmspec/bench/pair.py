"""A CPU-sized target/drafter pair built locally, for the core benchmark and the demo.

No model hub is reachable, so the pair is constructed, not downloaded: a ~50M-parameter
Llama target whose first decoder layer, embeddings and LM head are shared with a 1-layer
drafter, and whose other layers add a small, tunable perturbation to the residual stream.
`perturbation` sets how often the two agree (~70% greedy agreement at the default); the
agreement is measured and reported, never assumed. The trained testbed models replace this
pair in the demo once they exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PairConfig:
    vocab_size: int = 2048
    hidden_size: int = 512
    intermediate_size: int = 1536
    target_layers: int = 14
    heads: int = 8
    perturbation: float = 0.03  # scale of the upper layers' output projections
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.target_layers < 2:
            raise ValueError(f"target_layers must be >= 2 (layer 0 is shared with the drafter), got {self.target_layers}")
        if self.perturbation < 0:
            raise ValueError(f"perturbation must be >= 0, got {self.perturbation}")
        if self.hidden_size % self.heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by heads ({self.heads})")


def build_pair(config: PairConfig = PairConfig()):
    """Returns (target, drafter): transformers LlamaForCausalLM models in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def llama(layers: int):
        return LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_hidden_layers=layers,
            num_attention_heads=config.heads, num_key_value_heads=config.heads,
            max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            attn_implementation="sdpa", tie_word_embeddings=False,
        )

    torch.manual_seed(config.seed)
    target = LlamaForCausalLM(llama(config.target_layers))
    with torch.no_grad():
        # Sharper next-token distributions than a fresh init, like a trained LM.
        target.lm_head.weight.mul_(6.0)
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(config.perturbation)
            layer.mlp.down_proj.weight.mul_(config.perturbation)
    drafter = LlamaForCausalLM(llama(1))
    sd = {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    drafter.load_state_dict(sd)
    dtype = getattr(torch, config.dtype)
    return target.to(dtype).eval(), drafter.to(dtype).eval()


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def greedy_agreement(target, drafter, input_ids: torch.Tensor, steps: int = 32) -> float:
    """Fraction of positions along the target's greedy continuation where the drafter's
    argmax equals the target's (teacher-forced)."""
    seq = target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                          max_new_tokens=steps, min_new_tokens=steps, pad_token_id=0)
    L = input_ids.shape[1]
    t = target(input_ids=seq).logits[:, L - 1 : -1].argmax(-1)
    d = drafter(input_ids=seq).logits[:, L - 1 : -1].argmax(-1)
    return float((t == d).float().mean())
