"""`mmspec.cli.main` called in-process puts back what its commands set for the process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import mmspec.cli
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

    def command(argv):  # what a bench does: seed the global generator, set threads; then fail
        torch.manual_seed(123)
        torch.set_num_threads(other)
        raise SystemExit("mmspec bench: failed")

    monkeypatch.setattr(mmspec.cli, "_main", command)
    with pytest.raises(SystemExit):
        main(["bench"])
    assert torch.equal(torch.random.get_rng_state(), state) and torch.get_num_threads() == threads
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # a value the caller set is kept as it was
    with pytest.raises(SystemExit):
        main(["caption", "/nonexistent.png", "--model", "/nonexistent"])
    assert os.environ["HF_HUB_OFFLINE"] == "0"


@pytest.mark.parametrize("env, offline", [({}, "False"), ({"TRANSFORMERS_OFFLINE": "1"}, "True")])
def test_huggingface_hub_first_imported_inside_main_is_left_as_the_environment_says(env, offline):
    """huggingface_hub reads HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) once, at import: imported by
    a command that main ran offline, it stayed offline for the rest of the process."""
    code = ("import sys\n"
            "from mmspec.cli import main\n"
            "assert 'huggingface_hub' not in sys.modules\n"
            "try:\n    main(['caption', '/nonexistent.png', '--model', '/nonexistent'])\nexcept SystemExit:\n    pass\n"
            "import huggingface_hub\nassert 'huggingface_hub' in sys.modules\nprint(huggingface_hub.is_offline_mode())")
    base = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**base, **env}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == offline
