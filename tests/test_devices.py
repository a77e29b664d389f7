"""`mmspec.devices.check_device`: device options are refused up front, by name, where this
machine cannot honour them (before: a training command rendered its data or trained its first
stage for minutes, then failed with "Torch not compiled with CUDA enabled")."""

from __future__ import annotations

import pytest
import torch

from mmspec.devices import check_device


def test_cpu_passes_and_unknown_devices_are_refused_by_name():
    check_device("cpu")
    check_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="device='tpu' is not a device"):
        check_device("tpu")
    with pytest.raises(ValueError, match="--device='meta': must be one of cpu, cuda"):
        check_device("meta", "--device")
    with pytest.raises(ValueError, match="must be one of cpu$"):
        check_device("cuda", allowed=("cpu",))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_before_any_work():
    from mmspec.pipelines.train_config import TrainDrafterConfig
    from mmspec.testbed.imagegen_train import ImageGenTrainConfig
    from mmspec.testbed.mar_train import MARTrainConfig
    from mmspec.testbed.vlm_train import VLMTrainConfig

    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        check_device("cuda:0")
    for config in (VLMTrainConfig, ImageGenTrainConfig, MARTrainConfig):
        with pytest.raises(ValueError, match="device='cuda' asked for but torch sees no CUDA device"):
            config(device="cuda")
    with pytest.raises(ValueError, match="--device='cuda' asked for"):
        TrainDrafterConfig(pipeline="p", drafter="eagle", out="o", device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("argv", [["generate", "--class", "1", "--out", "OUT"],
                                  ["caption", "assets/testbed/images/scene_00.png"]], ids=["generate", "caption"])
def test_cli_device_without_a_gpu_is_refused_by_name(argv, tmp_path):
    from mmspec.cli import main

    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    with pytest.raises(SystemExit, match="--device='cuda' asked for but torch sees no CUDA device"):
        main([*argv, "--device", "cuda"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_devices_this_machine_has_pass_and_others_do_not():
    check_device("cuda")
    check_device("cuda:0")
    with pytest.raises(ValueError, match="CUDA device"):
        check_device(f"cuda:{torch.cuda.device_count()}")
