"""The CUDA attention-backend choice (mmspec/attention_choice.py): its decision logic with the
timings replaced (the real measurement needs a GPU; tests/test_core_cuda.py runs it there),
its refusals, and that nothing is measured or changed on CPU."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

import mmspec.attention_choice as ac
from mmspec.drafters import ModelDrafter
from mmspec.models.hf_target import HFTarget

from conftest import tiny_llama


def _fake_timing(monkeypatch, cudnn_ms: float, other_ms: float):
    """Per fresh-shape call: `cudnn_ms` while cuDNN attention is enabled, else `other_ms`."""
    calls = []

    def fresh(device, dtype, heads, kv_heads, head_dim):
        on = torch.backends.cuda.cudnn_sdp_enabled()
        calls.append(on)
        return (cudnn_ms if on else other_ms) / 1e3
    monkeypatch.setattr(ac, "_fresh_step_seconds", fresh)
    return calls


def test_cudnn_left_out_when_its_fresh_shapes_are_dearer(monkeypatch):
    calls = _fake_timing(monkeypatch, cudnn_ms=30.0, other_ms=1.0)
    choice = ac._measure("cuda", torch.bfloat16, 32, 32, 128)
    assert SDPBackend.CUDNN_ATTENTION not in choice["backends"]
    assert SDPBackend.CUDNN_ATTENTION in [getattr(SDPBackend, n) for n in choice["record"]["torch"]]
    assert choice["record"]["chosen"] == "without_cudnn"
    assert choice["record"]["fresh_shape_ms"] == {"torch": 30.0, "without_cudnn": 1.0}
    assert calls.count(True) == calls.count(False) == ac.SAMPLES + 1  # a warm-up each, then alternating rounds
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the caller's settings are restored


def test_torch_choice_kept_within_the_margin(monkeypatch):
    _fake_timing(monkeypatch, cudnn_ms=1.0, other_ms=0.95)  # 5% faster: under the 10% margin
    choice = ac._measure("cuda", torch.bfloat16, 32, 32, 128)
    assert choice["backends"] is None and choice["record"]["chosen"] == "torch"


def _measure_with_disabled(enable) -> dict:
    """`_measure` while one backend is switched off by its `torch.backends.cuda.enable_*` flag."""
    enable(False)
    try:
        return ac._measure("cuda", torch.bfloat16, 32, 32, 128)
    finally:
        enable(True)


def test_nothing_to_choose_when_cudnn_is_off(monkeypatch):
    calls = _fake_timing(monkeypatch, cudnn_ms=30.0, other_ms=1.0)
    choice = _measure_with_disabled(torch.backends.cuda.enable_cudnn_sdp)
    assert choice["backends"] is None and "not enabled" in choice["record"]["why"] and not calls


def test_an_expensive_candidate_stops_at_the_time_cap(monkeypatch):
    calls = _fake_timing(monkeypatch, cudnn_ms=1500.0, other_ms=1.0)
    ac._measure("cuda", torch.bfloat16, 32, 32, 128)
    assert calls.count(True) == 1 + 2  # warm-up, then two samples of 1.5 s pass the 2 s cap
    assert calls.count(False) == 1 + ac.SAMPLES


def test_cpu_is_never_measured_and_geometry_comes_from_the_config(monkeypatch):
    calls = _fake_timing(monkeypatch, cudnn_ms=30.0, other_ms=1.0)
    target = HFTarget(tiny_llama(layers=1, seed=0))
    assert ac.backends_for(target.spec, "cpu", torch.float32) is None and not calls
    assert ac.geometry(target.spec) == (4, 2, 8)  # conftest's tiny Llama: width 32, 4 heads, 2 KV heads
    assert ac.geometry(object()) == (32, 32, 128)


def test_unknown_attention_modes_are_refused():
    model = tiny_llama(layers=1, seed=0)
    with pytest.raises(ValueError, match="attention must be one of"):
        HFTarget(model, attention="cudnn")
    with pytest.raises(ValueError, match="attention must be one of"):
        ModelDrafter(model, 3, attention=None)
    assert HFTarget(model, attention="torch").runner.attention == "torch"


def test_eagle_head_asks_for_its_own_geometry_on_cuda_only(monkeypatch):
    """The EAGLE head runs its own attention: on CUDA it asks for the measured backends at its
    head geometry and enters them (restored afterwards); on CPU, or with attention="torch", it
    asks for nothing."""
    from types import SimpleNamespace

    from mmspec.drafters.eagle_head import EagleHead, EagleHeadConfig

    asked = []
    monkeypatch.setattr(ac, "backends_for_geometry",
                        lambda *a: asked.append(a) or [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    cfg = EagleHeadConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    head = EagleHead(cfg).double()
    x = torch.randn(1, 3, 32, dtype=torch.float64)
    head.decode(x, torch.arange(3).unsqueeze(0), torch.ones(1, 3, 3, dtype=torch.bool).tril())
    assert not asked
    on_cuda = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)
    with ac.step_attention(on_cuda, cfg):
        assert not torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    assert asked == [(torch.device("cuda"), torch.bfloat16, 4, 2, 8)]
    assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    with ac.step_attention(on_cuda, cfg, "torch"):
        assert torch.backends.cuda.cudnn_sdp_enabled()
    assert len(asked) == 1
    head.attention = "cudnn"  # not a mode: refused by name, not silently treated as "torch"
    with pytest.raises(ValueError, match="attention must be one of"):
        head.decode(x, torch.arange(3).unsqueeze(0), torch.ones(1, 3, 3, dtype=torch.bool).tril())


def test_geometry_reads_llamagen_configs():
    """LlamaGen's GPT names its heads n_head / n_kv_head / dim: the measurement uses its own geometry."""
    from mmspec.models.llamagen_gpt import LlamaGenGPT
    from mmspec.models.llamagen_spec import LlamaGenSpec

    gpt = LlamaGenGPT(dim=64, n_layer=1, n_head=4, n_kv_head=2, vocab_size=32, num_classes=4, block_size=16)
    assert ac.geometry(LlamaGenSpec(gpt, prepack=False)) == (4, 2, 16)


def test_no_choice_without_the_math_fallback_or_when_a_set_fails(monkeypatch):
    """The set without cuDNN is only taken when it keeps the math backend (a kernel for every
    input), and a set that raises while measured leaves torch's choice in place (reported)."""
    calls = _fake_timing(monkeypatch, cudnn_ms=30.0, other_ms=1.0)
    choice = _measure_with_disabled(torch.backends.cuda.enable_math_sdp)
    assert choice["backends"] is None and "math" in choice["record"]["why"] and not calls

    def failing(device, dtype, heads, kv_heads, head_dim):
        if not torch.backends.cuda.cudnn_sdp_enabled():
            raise RuntimeError("No available kernel. Aborting execution.")
        return 0.03
    monkeypatch.setattr(ac, "_fresh_step_seconds", failing)
    choice = ac._measure("cuda", torch.bfloat16, 32, 32, 128)
    assert choice["backends"] is None and "No available kernel" in choice["record"]["why"]
    assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
