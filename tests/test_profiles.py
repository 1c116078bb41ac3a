"""Device profiles: nvidia-smi names map to the right board, and every profile is usable."""

import pytest

from vest_slurm.errors import WorkloadError
from vest_slurm.estimate.profiles import PROFILES, get_profile, profile_for_device_name
from vest_slurm.site.config import parse_site_config

# (nvidia-smi name, memory.total MiB, expected profile)
NAMES = [
    ("NVIDIA A100-SXM4-40GB", 40960, "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", 81920, "a100-80gb"),
    ("NVIDIA A100-PCIE-40GB", 40960, "a100-40gb"),
    ("NVIDIA H100 80GB HBM3", 81559, "h100-80gb"),
    ("NVIDIA H100 PCIe", 81559, "h100-pcie-80gb"),
    ("NVIDIA H100 NVL", 95830, "h100-nvl-94gb"),
    ("NVIDIA H200", 143771, "h200-141gb"),
    ("NVIDIA H200 NVL", 143771, "h200-141gb"),
    ("NVIDIA GH200 480GB", 97871, "gh200-96gb"),      # not an H200: the superchip's whole memory
    ("NVIDIA GH200 120GB", 97871, "gh200-96gb"),
    ("NVIDIA GH200 144G HBM3e", 146831, "gh200-144gb"),
    ("NVIDIA B200", 183359, "b200-180gb"),
    ("NVIDIA L40S", 46068, "l40s-48gb"),
    ("NVIDIA L40", 46068, "l40-48gb"),        # not an L4
    ("NVIDIA L4", 23034, "l4-24gb"),
    ("NVIDIA A10", 23028, "a10-24gb"),
    ("NVIDIA A10G", 23028, "a10-24gb"),
    ("NVIDIA A30", 24576, "a30-24gb"),
    ("NVIDIA A40", 46068, "a40-48gb"),
    ("NVIDIA RTX A6000", 49140, "rtx-a6000-48gb"),
    ("NVIDIA RTX 6000 Ada Generation", 49140, "rtx-6000ada-48gb"),
    ("NVIDIA GeForce RTX 4090", 24564, "rtx-4090-24gb"),
    ("NVIDIA GeForce RTX 3090", 24576, "rtx-3090-24gb"),
    ("Tesla T4", 15360, "t4-16gb"),
    ("Tesla V100-SXM2-16GB", 16160, "v100-16gb"),
    ("Tesla V100S-PCIE-32GB", 32768, "v100-32gb"),
]


@pytest.mark.parametrize("name,total,key", NAMES)
def test_device_names_map_to_their_board(name, total, key):
    assert profile_for_device_name(name, total).key == key


def test_unknown_boards_have_no_profile():
    assert profile_for_device_name("AMD Instinct MI325X", 262144) is None
    assert profile_for_device_name("NVIDIA GB10", 122880) is None


def test_every_profile_is_consistent_and_reachable():
    for key, p in PROFILES.items():
        assert get_profile(key) is p and p.name and p.total_mib > p.reserved_mib > 0
        assert p.sm_count > 0 and p.context_mib > 0
        # a profile's own nvidia-smi name maps back to it
        assert profile_for_device_name(p.name, p.total_mib) is p, key
        # PyTorch's default cuBLAS workspace: 32 MiB on sm90 only, 8.125 MiB elsewhere (Blackwell too)
        assert p.cublas_workspace_bytes == (32 * 2**20 if p.capability == (9, 0) else 8 * 2**20 + 128 * 2**10)
    assert get_profile("L40").key == "l40-48gb" and get_profile("a6000").key == "rtx-a6000-48gb"
    with pytest.raises(WorkloadError, match="unknown GPU type"):
        get_profile("rtx-9090")


def test_site_config_accepts_every_profile():
    for key in PROFILES:
        c = parse_site_config(f'[gpu.g]\nprofile = "{key}"\n[partition.p]\ngpu_types = ["g"]\ngpus_per_node = 4\n')
        assert c.gpu("g").profile == key


# ---------------------------------------------------------------- default floors (issue 25, item 1)

from vest_slurm.estimate.profiles import (MEASURED_FLOORS, calibrated, default_floor_mib,  # noqa: E402
                                          eager_loading_note, local_memory_mib)


def test_local_memory_is_every_resident_threads_stack():
    # SMs x max resident threads per SM (CUDA programming guide) x the 1 KiB default stack
    assert local_memory_mib((8, 0), 108) == 108 * 2048 // 1024
    assert local_memory_mib((8, 9), 142) == -(-142 * 1536 // 1024)
    assert local_memory_mib((7, 5), 40) == 40


def test_uncalibrated_floors_bound_every_measured_stack():
    """Each built-in profile ships the default; on every measured stack's board it is at least that
    stack's measured floor (it errs high), and a site calibration replaces it and says so."""
    for key, measured in MEASURED_FLOORS.items():
        p = PROFILES[key]
        assert p.floor == "default" and p.context_mib >= measured
    for p in PROFILES.values():
        assert p.context_mib == default_floor_mib(p.capability, p.sm_count) > local_memory_mib(p.capability, p.sm_count)
    c = calibrated(PROFILES["a100-40gb"], 524)
    assert c.floor == "calibrated" and c.context_mib == 524
    assert PROFILES["a100-40gb"].with_overrides(context_mib=600).floor == "calibrated"
    assert PROFILES["a100-40gb"].with_overrides(cudnn_mib=10).floor == "default"


def test_a_floor_built_without_a_stack_differs_by_board_not_by_fit():
    # the bound kept without the H200's stack is the H100's remainder; the A100 then gets its own term 1
    kept = {k: f for k, f in MEASURED_FLOORS.items() if k != "h200-141gb"}
    assert default_floor_mib((8, 0), 108, kept) == 216 + (MEASURED_FLOORS["h100-80gb"] - 264)


def test_eager_module_loading_is_said():
    assert eager_loading_note({}) == ""
    assert "EAGER" in eager_loading_note({"CUDA_MODULE_LOADING": "eager"})
