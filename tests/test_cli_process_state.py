"""`mmspec.cli.main` called in-process puts back what its commands set for the process."""

from __future__ import annotations

import os

import pytest
import torch

from mmspec.cli import main


def test_main_puts_back_offline_flag_threads_and_random_state(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    threads = torch.get_num_threads()
    other = 1 if threads != 1 else 2
    state = torch.random.get_rng_state()
    with pytest.raises(SystemExit):  # fails on the missing folder, after --threads took effect
        main(["caption", "/nonexistent.png", "--model", "/nonexistent", "--threads", str(other)])
    assert "HF_HUB_OFFLINE" not in os.environ
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.random.get_rng_state(), state)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # a value the caller set is kept as it was
    with pytest.raises(SystemExit):
        main(["caption", "/nonexistent.png", "--model", "/nonexistent"])
    assert os.environ["HF_HUB_OFFLINE"] == "0"
