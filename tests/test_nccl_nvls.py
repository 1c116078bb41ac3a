"""NCCL's NVLink SHARP buffers (estimator.nvls_bytes): set up per communicator where the GPU type's
nodes have NVSwitch and the communicator has more than two GPUs on the node, sized as NCCL's
ncclNvlsBufferSetup binds them (channels x 2 x 1 MiB x local ranks); none elsewhere."""

from __future__ import annotations

import pytest

from vest_slurm.estimate.estimator import estimate, nvls_bytes
from vest_slurm.estimate.profiles import get_profile
from vest_slurm.estimate.workload import parse_workload_args
from vest_slurm.site.config import parse_site_config
from vest_slurm.units import MiB

MLP = 'mlp:[["Linear",256,256],["ReLU"],["Linear",256,10]]'


def _nvls(spec_args, gpu="h100-80gb"):
    spec = parse_workload_args(["--model", MLP, "--input", "256", "--batch-size", "8", *spec_args])
    (est,) = estimate(spec, [get_profile(gpu)])
    return dict(est.breakdown).get("nccl_nvls", 0), est


@pytest.mark.parametrize("args,expected_mib", [
    (["--num-gpus", "8"], 16 * 2 * 8),                                    # DDP over one HGX node: 256 MiB
    (["--num-gpus", "4"], 16 * 2 * 4),
    (["--num-gpus", "2"], 0),                                             # two GPUs: NCCL does not set NVLS up
    (["--num-gpus", "16", "--gpus-per-node", "8", "--parallelism", "fsdp2"], 16 * 2 * 8),   # 8 local ranks
    (["--num-gpus", "16", "--parallelism", "hsdp", "--shard-group-size", "4"], 16 * 2 * 4),  # the shard group's
    (["--num-gpus", "1"], 0),
])
def test_nvls_buffers_per_communicator_on_nvswitch_hopper(args, expected_mib):
    nvls, est = _nvls(args)
    assert nvls == expected_mib * MiB
    if nvls:   # outside the allocator, in both answers
        d = dict(est.parts())
        assert est.required_bytes == d["cuda_context"] + d["nccl"] + nvls + d["allocator_required"]


@pytest.mark.parametrize("gpu", ["a100-80gb", "h100-pcie-80gb", "h100-nvl-94gb", "l40s-48gb"])
def test_no_nvls_without_nvswitch_or_before_hopper(gpu):
    assert _nvls(["--num-gpus", "8"], gpu)[0] == 0


def test_b200_has_more_channels_and_a_site_can_say_its_nodes_have_no_nvswitch():
    assert nvls_bytes(get_profile("b200-180gb"), 8) == 32 * 2 * 8 * MiB
    site = parse_site_config('[gpu.h100]\nprofile = "h100-80gb"\nnvswitch = false\n'
                             '[partition.gpu]\ngpu_types = ["h100"]\ngpus_per_node = 8\n')
    from vest_slurm.site.advice import site_profiles

    assert site.gpus[0].nvswitch is False and site_profiles(site)["h100"].nvswitch is False
    default = parse_site_config('[gpu.h100]\nprofile = "h100-80gb"\n[partition.gpu]\ngpu_types = ["h100"]\n'
                                'gpus_per_node = 8\n')
    assert site_profiles(default)["h100"].nvswitch is True
