"""`JacobiDrafter(window="auto")` and `mmspec.adaptive_window.WindowBandit`: the window is chosen
per request from measured throughput; greedy output equals plain decoding and exact sampling is
distributed like the target whatever windows run (several requests, so several windows, with
CFG); the bandit finds the fastest window, switches speculation off where it loses, keeps
batch sizes apart, follows a change of speed and spaces its challenges out; bad settings are
refused by name; the pipeline saves and loads the setting."""

from __future__ import annotations

import json
import random

import pytest
import torch

import mmspec
from mmspec.adaptive_window import WindowBandit, candidate_windows
from mmspec.drafters import JacobiDrafter
from mmspec.models.llamagen_spec import llamagen_target

from _llamagen_helpers import LABELS, plain_greedy, tiny_gpt
from test_core_sampling import chi_square_p
from test_jacobi_drafter import SAMPLES, SCALE, V, cfg_gpt, guided_joint, sample_counts_over_requests


def run_request(bandit: WindowBandit, batch: int, rate_of, rng: random.Random, steps: int = 10, noise: float = 0.1):
    """One synthetic request: every step emits 2 tokens per row in 2 / rate(k) seconds (+-noise)."""
    bandit.begin_request()
    for _ in range(steps):
        k = bandit.choose(batch)
        seconds = 2.0 / rate_of(batch, k) * (1 + noise * (2 * rng.random() - 1))
        bandit.observe(batch, k, [1] * batch, 0.1 * seconds, 0.9 * seconds)
    return bandit.requests[-1][1]


def test_candidate_windows():
    assert candidate_windows(16) == [0, 2, 4, 8, 16]
    assert candidate_windows(12) == [0, 2, 4, 8, 12]
    assert candidate_windows(1) == [0, 1]
    assert candidate_windows(3) == [0, 2, 3]


def test_bandit_finds_the_fastest_window_and_spaces_its_challenges():
    rates = {0: 100.0, 2: 110.0, 4: 150.0, 8: 175.0, 16: 160.0}  # window 8 fastest, 16 within 10%
    bandit, rng = WindowBandit(16), random.Random(0)
    arms = [run_request(bandit, 1, lambda b, k: rates[k], rng) for _ in range(200)]
    # warm-up: the skipped cold request (16), a pass over the arms, widest first, and a second
    # pass over those within 30% of the best (not 2 and 0)
    assert arms[:10] == [16, 16, 8, 4, 2, 0, 16, 8, 4, 8]
    assert bandit.warmed_up(1) and not bandit.warmed_up(8) and not WindowBandit(16).warmed_up(1)
    late = arms[100:]
    assert late.count(8) >= 90  # exploitation
    assert 0 < sum(a != 8 for a in late) <= 8  # challenges continue, at the doubled gap
    assert bandit.best(1) == 8


def test_bandit_switches_speculation_off_where_it_loses_and_keeps_batch_sizes_apart():
    def rate(batch, k):  # batch 1: window 16 pays; batch 8: every window loses to plain
        return {1: {0: 100, 2: 110, 4: 130, 8: 150, 16: 170}, 8: {0: 400, 2: 330, 4: 300, 8: 260, 16: 200}}[batch][k]

    bandit, rng = WindowBandit(16), random.Random(1)
    arms = {1: [], 8: []}
    for i in range(240):
        b = 1 if i % 2 else 8
        arms[b].append(run_request(bandit, b, rate, rng))
    assert arms[1][-60:].count(16) >= 55
    assert arms[8][-60:].count(0) >= 55
    assert bandit.best(1) == 16 and bandit.best(8) == 0


def test_bandit_follows_a_change_of_speed():
    before = {0: 100.0, 2: 110.0, 4: 120.0, 8: 140.0, 16: 180.0}
    after = {0: 100.0, 2: 110.0, 4: 200.0, 8: 140.0, 16: 90.0}  # e.g. the machine's verify got dearer
    bandit, rng = WindowBandit(16), random.Random(2)
    for _ in range(100):
        run_request(bandit, 1, lambda b, k: before[k], rng)
    assert bandit.best(1) == 16
    arms = [run_request(bandit, 1, lambda b, k: after[k], rng) for _ in range(150)]
    assert arms[-40:].count(4) >= 35


def test_bandit_compares_windows_paired_so_a_drifting_machine_speed_does_not_decide():
    """The machine's speed swings by +-30% over tens of requests (as a busy VM's does): a window
    measured in a slow stretch is scored against the best window's speed of that stretch."""
    import math

    rates = {0: 100.0, 2: 110.0, 4: 150.0, 8: 175.0, 16: 160.0}
    bandit, rng = WindowBandit(16), random.Random(4)
    arms = []
    for i in range(300):
        speed = 1 + 0.3 * math.sin(i / 15)
        arms.append(run_request(bandit, 1, lambda b, k: rates[k] * speed, rng))
    assert arms[100:].count(8) >= 180
    assert bandit.best(1) == 8


def test_the_first_request_is_not_counted():
    bandit, rng = WindowBandit(4), random.Random(3)
    run_request(bandit, 1, lambda b, k: 100.0, rng)
    bandit.begin_request()  # closes the first request
    assert bandit.rate(1, 4) is None
    run_request(bandit, 1, lambda b, k: 100.0, rng)
    bandit.begin_request()
    assert bandit.rate(1, 4) == pytest.approx(100.0, rel=0.15)


def test_the_first_request_at_each_batch_size_is_not_counted():
    """A request at a batch size not met before runs at shapes not met before (on a GPU its first
    calls are dear): it is not recorded, so a cold first reading of the widest window (the
    warm-up's first arm) does not rank plain decoding or a narrower window above it."""
    rates = {1: {0: 100.0, 2: 110.0, 4: 130.0, 8: 150.0, 16: 170.0},
             8: {0: 100.0, 2: 105.0, 4: 110.0, 8: 120.0, 16: 135.0}}
    bandit, rng = WindowBandit(16), random.Random(5)
    for _ in range(20):
        run_request(bandit, 1, lambda b, k: rates[b][k], rng)
    assert bandit.best(1) == 16
    first = run_request(bandit, 8, lambda b, k: rates[b][k] / 2.5, rng)  # cold: 2.5x slower
    bandit.begin_request()
    assert first == 16 and all(bandit.rate(8, a) is None for a in bandit.arms)
    for _ in range(12):
        run_request(bandit, 8, lambda b, k: rates[b][k], rng)
    # counted, the cold reading (54 tokens/s) would have left window 16 out of the warm-up's second
    # pass (below 70% of window 8's 120) and ranked window 8 first for ~40 requests
    assert bandit.warmed_up(8) and bandit.best(8) == 16


def test_bandit_and_drafter_refusals():
    with pytest.raises(ValueError, match="max_window"):
        WindowBandit(0)
    with pytest.raises(ValueError, match="arms"):
        WindowBandit(8, arms=[0, 9])
    with pytest.raises(ValueError, match="warmup"):
        WindowBandit(8, warmup=0)
    with pytest.raises(ValueError, match="margin"):
        WindowBandit(8, margin=1.0)
    with pytest.raises(ValueError, match="max_window"):
        JacobiDrafter("auto", max_window=0)
    with pytest.raises(ValueError, match="only applies to window='auto'"):
        JacobiDrafter(8, max_window=16)
    with pytest.raises(ValueError, match="'auto'"):
        JacobiDrafter("wide")
    d = JacobiDrafter("auto", max_window=6)
    assert d.adaptive and d.max_draft_nodes == 6 and "auto" in repr(d)
    with pytest.raises(ValueError, match="0..6"):
        d.set_draft_length(7)
    assert JacobiDrafter().adaptive  # the default, as for ModelDrafter
    assert not JacobiDrafter(8).adaptive and JacobiDrafter(8).controller is None


@pytest.mark.parametrize("cfg", [(1.0, "constant"), (3.0, "constant"), (4.0, "linear")], ids=["nocfg", "cfg", "linear"])
@pytest.mark.parametrize("coupling", [None, "maximal", "gumbel"])
def test_auto_window_greedy_equals_plain_over_many_windows(cfg, coupling):
    gpt = tiny_gpt(0)
    scale, schedule = cfg
    ref = plain_greedy(gpt, scale=scale, schedule=schedule)
    drafter = JacobiDrafter("auto", coupling, max_window=6, vocab_size=gpt.args.vocab_size)
    for _ in range(9):  # the cold request, then the warm-up passes: windows 6, 4, 2, 0, ...
        out = mmspec.speculative_generate(llamagen_target(gpt, scale, cfg_schedule=schedule, num_tokens=16), drafter,
                                          LABELS.view(-1, 1), max_new_tokens=16, temperature=0)
        assert torch.equal(out.sequences[:, 1:], ref)
    assert {a for _, a in drafter.controller.requests} == {0, 2, 4, 6}


def test_auto_window_exact_sampling_with_cfg_matches_guided_joint():
    """Ten requests of 800 rows, so the drafter runs windows 3, 2 and 0 (plain) and whatever it
    chooses after the warm-up; their pooled samples follow the guided joint."""
    gpt = cfg_gpt()
    expected, unguided = guided_joint(gpt, SCALE), guided_joint(gpt, 1.0)
    drafter = JacobiDrafter("auto", "maximal", max_window=3, vocab_size=V)
    counts, accepted = sample_counts_over_requests(gpt, drafter, 10)
    assert {a for _, a in drafter.controller.requests} >= {0, 2, 3}
    assert chi_square_p(counts, expected, SAMPLES) > 1e-4
    assert chi_square_p(counts, unguided, SAMPLES) < 1e-6  # power: guidance is visible in these samples
    assert accepted > 0


def test_pipeline_saves_and_loads_an_auto_window(tmp_path):
    from test_ar_image_pipeline import make_pipe

    from mmspec.pipelines import SpeculativeARImagePipeline

    pipe = make_pipe(torch.float32)
    pipe.drafter = JacobiDrafter("auto", "gumbel", max_window=8)
    pipe([1, 4], guidance_scale=3.0, output_type="latent", generator=torch.Generator().manual_seed(0))
    pipe.save_pretrained(tmp_path / "p")
    config = json.loads((tmp_path / "p" / "model_index.json").read_text())["drafter_config"]
    assert (config["kind"], config["window"], config["max_window"], config["coupling"]) == ("jacobi", "auto", 8, "gumbel")
    loaded = SpeculativeARImagePipeline.from_pretrained(tmp_path / "p")
    d = loaded.drafter
    assert isinstance(d, JacobiDrafter) and d.adaptive and d.max_window == 8 and d.coupling == "gumbel"
    # A pipeline drafting from its settings alone keeps one drafter across calls (it learns).
    loaded.drafter = None
    loaded.set_progress_bar_config(disable=True)
    for _ in range(3):
        loaded([0], guidance_scale=3.0, output_type="latent")
    (kept,) = loaded._config_jacobi.values()
    assert len(kept.controller.requests) == 3


def test_bench_method_names_take_auto():
    from mmspec.bench.imagegen import method_spec

    assert method_spec("lantern/jacobi-maximal@auto") == ("jacobi", "maximal", "lantern", "auto")
    assert method_spec("exact/jacobi-gumbel@16") == ("jacobi", "gumbel", "exact", 16)
    assert method_spec("exact/model@auto") == ("model", None, "exact", "auto")  # K = "auto"
    with pytest.raises(ValueError, match="@auto"):
        method_spec("exact/model@8")
    with pytest.raises(ValueError, match="@auto"):
        method_spec("plain@auto")
