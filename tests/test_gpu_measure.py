"""The GPU measurement runs the estimator's own training loop on real tensors; here on the CPU."""

import os
import subprocess
import sys

import pytest
import torch

from vest_slurm.gpu.measure import DevicePoller, measure
from vest_slurm.estimate.workload import parse_workload_args


def test_loop_runs_for_real_on_cpu():
    spec = parse_workload_args(["--model", "torchvision:resnet18", "--batch-size", "2", "--input", "3x32x32",
                                "--optimizer", "adam"])
    m = measure(spec, device="cpu", steps=2)
    assert m.device == "cpu" and m.max_reserved_mib is None and m.device_peak_used_mib is None
    assert m.workload["model"] == "torchvision:resnet18" and m.seconds > 0


@pytest.mark.parametrize("extra", [[], ["--gradient-checkpointing", "on", "--optimizer", "rmsprop-momentum"]])
def test_hf_loop_runs_for_real_on_cpu(extra):
    spec = parse_workload_args(["--model", "hf:tiny-llama", "--input", "seq16", "--batch-size", "2",
                                "--precision", "amp-bf16", "--optimizer", "adamw", *extra])
    m = measure(spec, device="cpu", steps=1)
    assert m.seconds > 0 and m.workload["gradient_checkpointing"] == spec.gradient_checkpointing


def test_poller_samples_only_where_a_gpu_answers():
    import time

    with DevicePoller(interval_s=0.01) as p:
        deadline = time.monotonic() + 60   # the first sample, not a fixed sleep; no reader, no thread
        while p.available and p.samples == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    if torch.cuda.is_available():
        assert p.available and p.samples > 0 and p.max_used_bytes > 0
    else:
        assert not p.available and p.samples == 0 and p.max_used_bytes == 0


def test_calibrate_without_gpu_says_where_to_run():
    # no GPU visible to the process (CUDA_VISIBLE_DEVICES empty), on any machine, GPU or not
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "vest_slurm.cli", "calibrate", "--gres-type", "a100"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr and "srun --gres=gpu:1" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_jobs_cudnn_settings_hold_while_its_loop_runs_and_are_restored():
    from vest_slurm.estimate.tracing import cudnn_flags

    before = torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark
    spec = parse_workload_args(["--model", "torchvision:resnet18", "--batch-size", "2", "--input", "3x32x32",
                                "--cudnn-tf32", "off", "--cudnn-benchmark", "on"])
    with pytest.raises(RuntimeError):
        with cudnn_flags(spec):
            assert (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark) == (False, True)
            raise RuntimeError("the loop failed")
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark) == before
    measure(spec, device="cpu", steps=1)
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark) == before


def test_built_in_gpu_workloads_parse_and_settle():
    # scripts/measure_gpu.py's workloads are what a lent GPU runs: each must parse as written,
    # run 8 steps (the replay's settled state), and the benchmark-mode one must pair with a run
    # of the same workload without it
    import importlib.util
    import os
    import shlex

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "measure_gpu.py")
    mod_spec = importlib.util.spec_from_file_location("measure_gpu_script", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    specs = [parse_workload_args(shlex.split(w)) for w in mod.DEFAULT_WORKLOADS]
    assert all(s.steps == 8 for s in specs)
    bench = [s for s in specs if s.cudnn_benchmark == "on"]
    assert bench and all(s.with_(cudnn_benchmark="off") in specs for s in bench)
    assert {"hf:WhisperForAudioClassification", "hf:t5-small", "torchvision:convnext_large",
            "torchvision:resnet152"} <= {s.model for s in specs}


def test_real_model_keeps_the_buffers_its_constructor_makes():
    """A model measured on a device is built there: BERT's position ids and Llama's rotary
    frequencies are the constructor's values, not the garbage of a meta model moved with to_empty
    (BERT then indexed its position embeddings out of bounds)."""
    from vest_slurm.estimate.tracing import build_real_model

    bert, _ = build_real_model(parse_workload_args(["--model", "hf:BertForMaskedLM", "--model-arg", "hidden_size=64",
                                                    "--model-arg", "num_hidden_layers=1", "--model-arg",
                                                    "num_attention_heads=2", "--model-arg", "intermediate_size=128",
                                                    "--input", "seq32", "--batch-size", "2"]), "cpu")
    ids = bert.bert.embeddings.position_ids
    assert torch.equal(ids, torch.arange(ids.shape[-1]).expand_as(ids))
    assert not bert.bert.embeddings.token_type_ids.any()
    llama, _ = build_real_model(parse_workload_args(["--model", "hf:tiny-llama", "--input", "seq16", "--batch-size", "2"]),
                                "cpu")
    inv_freq = [b for n, b in llama.named_buffers() if n.endswith("inv_freq")]
    assert inv_freq and all(torch.isfinite(b).all() and (b > 0).all() and (b <= 1).all() for b in inv_freq)


def test_calibration_floor_is_the_median_of_its_jobs():
    from vest_slurm.gpu.calibrate import JOBS, JobResult, floor_mib, site_lines
    from vest_slurm.errors import VestError

    def result(name, mib):
        return JobResult(name, mib, "NVIDIA H100 80GB HBM3", 81559.0, "2.6.0+cu126", "12.6", 3.0)

    results = [result(name, mib) for (name, _), mib in zip(JOBS, (1180.0, 1342.0, 1398.0, 1510.0))]
    assert floor_mib(results) == 1370
    lines = site_lines(results, "h100", "h100-80gb")
    assert lines.startswith('[gpu.h100]\nprofile = "h100-80gb"\ncontext_mib = 1370    # median of 4 jobs')
    assert "gemm fp32 1180" in lines and "attention amp 1510" in lines and "torch 2.6.0+cu126" in lines
    with pytest.raises(VestError, match="could not be read"):
        floor_mib([*results[:3], result("attention amp", None)])


def test_calibrate_dry_run_runs_every_job_on_the_cpu():
    r = subprocess.run([sys.executable, "-m", "vest_slurm.cli", "calibrate", "--gres-type", "a100", "--dry-run"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    from vest_slurm.gpu.calibrate import JOBS

    assert f"the {len(JOBS)} calibration jobs ran on the CPU" in r.stdout
    assert all(name in r.stdout for name, _ in JOBS)
