"""The same greedy-losslessness check on CUDA (skipped on machines without a GPU)."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter

from conftest import left_padded, noisy_copy, tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("tree", [None, mmspec.TreeConfig(depth=3, top_k=3, num_nodes=8)], ids=["chain", "tree"])
def test_greedy_equals_generate_on_cuda(tree):
    target = tiny_llama(layers=2, seed=0).cuda()
    drafter = noisy_copy(target, 0.3).cuda()
    ids, mask = left_padded([9, 5, 7, 3])
    ids, mask = ids.cuda(), mask.cuda()
    # generate stops at the config's eos_token_id (2), which row 1 emits: give the loop the same EOS.
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0)
    out = mmspec.speculative_generate(target, (ModelDrafter(drafter, tree=tree) if tree else ModelDrafter(drafter, 4)), ids, mask, temperature=0,
                                      max_new_tokens=20, pad_token_id=0, eos_token_id=2)
    assert out.sequences.device.type == "cuda"
    assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("compile", [None, "reduce-overhead"], ids=["static", "cuda-graphs"])
@pytest.mark.parametrize("tree", [None, mmspec.TreeConfig(depth=3, top_k=3, num_nodes=8)], ids=["chain", "tree"])
def test_static_and_compiled_greedy_equals_generate_on_cuda(tree, compile):
    """The opt-in GPU path (static shapes; torch.compile with CUDA graphs) on a real GPU."""
    from mmspec.models.hf_target import HFTarget

    target = tiny_llama(layers=2, seed=0).cuda()
    drafter = noisy_copy(target, 0.3).cuda()
    ids, mask = left_padded([9, 5, 7, 3])
    ids, mask = ids.cuda(), mask.cuda()
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0)
    options = dict(static=True) if compile is None else dict(compile=compile)
    tgt = HFTarget(target, **options)
    for _ in range(2):  # the second request replays what the first one traced
        dr = ModelDrafter(drafter, tree=tree, **options) if tree else ModelDrafter(drafter, 4, **options)
        out = mmspec.speculative_generate(tgt, dr, ids, mask, temperature=0, max_new_tokens=20, pad_token_id=0,
                                          eos_token_id=2)
        assert out.sequences.device.type == "cuda"
        assert torch.equal(out.sequences, ref)



@pytest.mark.parametrize("attention", ["auto", "torch"])
def test_attention_backend_choice_keeps_greedy_output_on_cuda(attention):
    """The measured attention-backend choice (mmspec/attention_choice.py) on a real GPU: greedy
    output stays generate's under either mode, and the measurement at a 7B model's head geometry
    in bfloat16 (where cuDNN attention is eligible) runs, records its figures and restores the
    caller's backend flags."""
    import mmspec.attention_choice as ac
    from mmspec.models.hf_target import HFTarget

    target = tiny_llama(layers=2, seed=0, dtype=torch.float32).cuda()
    drafter = noisy_copy(target, 0.3).cuda()
    ids, mask = left_padded([9, 5, 7, 3])
    ids, mask = ids.cuda(), mask.cuda()
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0)
    out = mmspec.speculative_generate(HFTarget(target, attention=attention), ModelDrafter(drafter, 4, attention=attention),
                                      ids, mask, temperature=0, max_new_tokens=20, pad_token_id=0, eos_token_id=2)
    assert torch.equal(out.sequences, ref)
    if attention == "auto":
        flags = [torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()]
        choice = ac._measure(torch.device("cuda"), torch.bfloat16, 32, 32, 128)
        assert [torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()] == flags
        record = choice["record"]
        assert record["chosen"] in ("torch", "without_cudnn")
        if "fresh_shape_ms" in record:
            assert all(v > 0 for v in record["fresh_shape_ms"].values())
        print("attention choice at 32 heads x 128, bfloat16:", record)


def test_cpu_generator_drives_rules_on_cuda():
    """diffusers' convention: a CPU generator with a CUDA model. The exact rule's draws are made on
    the generator's device and moved, so the same seed gives the same verdict on CPU and CUDA
    tensors (the draws are identical; the arithmetic on them is exact comparisons)."""
    from mmspec.acceptance import ExactAcceptance

    g = torch.Generator().manual_seed(0)
    B, K, V = 3, 4, 11
    p = torch.rand(B, K + 1, V, generator=g, dtype=torch.float64).softmax(-1)
    q = torch.rand(B, K, V, generator=g, dtype=torch.float64).softmax(-1)
    x = torch.randint(V, (B, K), generator=g)
    rule = ExactAcceptance()
    on_cpu = rule.verify(x, q, p, generator=torch.Generator().manual_seed(7))
    on_gpu = rule.verify(x.cuda(), q.cuda(), p.cuda(), generator=torch.Generator().manual_seed(7))
    assert on_gpu.next_tokens.device.type == "cuda"
    assert torch.equal(on_cpu.num_accepted, on_gpu.num_accepted.cpu())
    assert torch.equal(on_cpu.next_tokens, on_gpu.next_tokens.cpu())


def test_invariant_sampling_on_cuda_matches_plain_and_the_cpu_for_a_cpu_generator():
    """acceptance="invariant" on a CUDA model: speculative output equals plain output for a seed
    with a CPU and with a CUDA generator; with a CPU generator also the CPU model's output."""
    from mmspec.drafters import NullDrafter

    target = tiny_llama(layers=2, seed=0)
    small = noisy_copy(target, 0.3)
    ids, mask = left_padded([5, 9, 3, 7])
    kw = dict(acceptance="invariant", temperature=1.0, max_new_tokens=20, pad_token_id=0)

    def run(model, drafter, gen, device):
        return mmspec.speculative_generate(model, drafter, ids.to(device), mask.to(device), generator=gen, **kw).sequences

    cpu = run(target, NullDrafter(40), torch.Generator().manual_seed(3), "cpu")
    target_c, small_c = target.cuda(), small.cuda()
    for gen in (torch.Generator().manual_seed(3), torch.Generator(device="cuda").manual_seed(3)):
        seed = gen.initial_seed()
        plain = run(target_c, NullDrafter(40), gen.manual_seed(seed), "cuda")
        spec = run(target_c, ModelDrafter(small_c, 3), gen.manual_seed(seed), "cuda")
        assert torch.equal(plain, spec)
        if gen.device.type == "cpu":
            assert torch.equal(plain.cpu(), cpu)


def test_cpu_generator_drives_mar_noise_on_cuda():
    """The MAR sampler's noise (orders, x_T, per-step and final noise) with a CPU generator and a
    CUDA model: drawn on the CPU and moved, so the seed gives the numbers of a CPU run."""
    from mmspec.pipelines.cspd import draw_noise

    cpu = draw_noise(2, 5, 3, 4, torch.Generator().manual_seed(3), "cpu", torch.float32)
    gpu = draw_noise(2, 5, 3, 4, torch.Generator().manual_seed(3), "cuda", torch.float32)
    for name in ("orders", "init", "steps", "final"):
        assert getattr(gpu, name).device.type == "cuda"
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name))


def test_cli_runs_the_bundled_pipelines_on_cuda(tmp_path, capsys):
    """`--device cuda` moves the bundled generator and VLM to the GPU (seeds stay on the CPU):
    images are written, and the VLM's speculative captions equal its plain ones there."""
    import json
    from pathlib import Path

    from mmspec.cli import main

    root = Path(__file__).resolve().parents[1]  # models named explicitly: the package may be installed elsewhere
    out = tmp_path / "img"
    assert main(["generate", "--model", str(root / "assets" / "testbed" / "imagegen"), "--class", "1", "2",
                 "--out", str(out), "--device", "cuda", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["files"]) == 2
    images = [str(root / "assets" / "testbed" / "images" / f"scene_0{i}.png") for i in range(3)]
    assert main(["caption", *images, "--model", str(root / "assets" / "testbed" / "vlm"), "--device", "cuda",
                 "--compare", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical_to_plain"] is True
