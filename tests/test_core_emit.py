"""The loop's output bookkeeping (`_Emitter`): the host version used on the CPU and the tensor
version used on other devices record the same tokens, counts, row ends and commit info."""

from __future__ import annotations

import random

import pytest
import torch

from mmspec.engine import _Emitter
from mmspec.types import Verdict

V = 8  # a small vocabulary, so EOS ids come up often


def _pair(B, max_new, eos):
    host = _Emitter(B, max_new, eos, 0, torch.device("cpu"))
    dev = _Emitter(B, max_new, eos, 0, torch.device("cpu"))
    assert host.on_host
    dev.on_host = False  # the tensor version, as on CUDA
    return host, dev


def _step(rng: random.Random, Ba: int, N: int, tree: bool):
    tokens = torch.tensor([[rng.randrange(V) for _ in range(N + 1)] for _ in range(Ba)])
    n = torch.tensor([rng.randrange(N + 1) for _ in range(Ba)])
    if tree:  # any node order along the path (a tree's accepted path is not arange)
        path = torch.tensor([[0] + [rng.randrange(1, N + 1) for _ in range(N)] for _ in range(Ba)])
    else:
        path = torch.arange(N + 1).expand(Ba, N + 1)
    verdict = Verdict(path=path, num_accepted=n, next_tokens=torch.tensor([rng.randrange(V) for _ in range(Ba)]))
    return tokens, verdict


@pytest.mark.parametrize("eos", [[], [3], [3, 5]])
@pytest.mark.parametrize("tree", [False, True])
def test_host_and_tensor_bookkeeping_agree(eos, tree):
    rng = random.Random(len(eos) * 2 + tree)
    steps_with_drops = 0
    for trial in range(60):
        B, N, max_new = rng.randrange(1, 6), rng.randrange(0, 6), rng.randrange(1, 14)
        host, dev = _pair(B, max_new, eos)
        roots = torch.tensor([rng.randrange(V) for _ in range(B)])
        keep = host.first(roots)
        assert keep == dev.first(roots)
        host.select(keep), dev.select(keep)
        finite = torch.tensor([True, True])
        while host.rows_host:
            if rng.random() < 0.3:  # a K = 0 step (plain decoding, or the adaptive controller's choice)
                roots = torch.tensor([rng.randrange(V) for _ in host.rows_host])
                a_info, *a = host.emit_root(roots, torch.tensor(True))
                b_info, *b = dev.emit_root(roots, torch.tensor(True))
            else:
                tokens, verdict = _step(rng, len(host.rows_host), N, tree)
                a_info, *a = host.emit(tokens, verdict, finite, chain=not tree)
                b_info, *b = dev.emit(tokens, verdict, finite)
            assert a == b  # accepted counts, emitted counts, rows that go on
            for field in ("path", "num_accepted", "accepted_tokens", "next_tokens"):
                assert torch.equal(getattr(a_info, field), getattr(b_info, field)), field
            assert a_info.num_accepted_list == b_info.num_accepted_list
            assert host.written_host == dev.written.tolist()  # (the host path keeps `written` on the host only)
            steps_with_drops += len(a[2]) < len(a[0])
            host.select(a[2]), dev.select(a[2])
        ids = torch.zeros(B, 2, dtype=torch.long)
        assert torch.equal(host.sequences(ids), dev.sequences(ids))
        assert host.new_tokens == dev.new_tokens
        assert all(c <= max_new for c in host.new_tokens)
    assert steps_with_drops > 20  # rows ended mid-batch (EOS or the length limit) many times


@pytest.mark.parametrize("culprit", [0, 1])
def test_host_bookkeeping_refuses_non_finite_steps(culprit):
    host, dev = _pair(2, 10, [3])
    rng = random.Random(0)
    tokens, verdict = _step(rng, 2, 3, False)
    finite = torch.tensor([culprit != 0, culprit != 1])
    name = "target" if culprit == 0 else "drafter"
    for emitter in (host, dev):
        with pytest.raises(ValueError, match=f"non-finite probabilities .* {name} distribution"):
            emitter.emit(tokens, verdict, finite)
        if culprit == 0:  # K = 0 steps check the target alone
            with pytest.raises(ValueError, match="non-finite probabilities .* target distribution"):
                emitter.emit_root(tokens[:, 0], torch.tensor(False))
