"""`vest estimate` end to end: output contract, and bad input without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch  # noqa: F401  (vest estimate traces)

USER = "tests/data/user_models.py"


def vest(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "vest_slurm.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_json_contract():
    r = vest("estimate", "--model", f"{USER}:small_cnn", "--batch-size", "8", "--input", "3x32x32",
             "--gpu", "a100-40gb", "--gpu", "h100-80gb", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [e["gpu"] for e in doc["estimates"]] == ["a100-40gb", "h100-80gb"]
    for e in doc["estimates"]:
        assert {"gpu", "peak_mib", "required_mib", "breakdown"} <= set(e)
        assert 0 < e["required_mib"] <= e["peak_mib"]
        assert e["breakdown"]["cuda_context"] > 0
    # Hopper's default cuBLAS workspace is 32 MiB against 8.125 MiB: the H100 reserves more
    a100, h100 = doc["estimates"]
    assert h100["breakdown"]["allocator_peak_reserved"] > a100["breakdown"]["allocator_peak_reserved"]


def test_table_output():
    r = vest("estimate", "--model", f"{USER}:small_cnn", "--batch-size", "8", "--input", "3x32x32", "--gpu", "l4-24gb")
    assert r.returncode == 0, r.stderr
    assert "l4-24gb" in r.stdout and "required MiB" in r.stdout and "breakdown on l4-24gb" in r.stdout
    assert "emulated" not in r.stdout


def test_bf16_before_sm80_is_estimated_with_a_note():
    """bf16 autocast on a T4 (sm75): PyTorch emulates it, so it is estimated, and the table says it
    is slow there; the L4 (sm89) has it natively."""
    r = vest("estimate", "--model", f"{USER}:small_cnn", "--batch-size", "8", "--input", "3x32x32",
             "--precision", "amp-bf16", "--gpu", "t4-16gb", "--gpu", "l4-24gb")
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stdout.splitlines() if line.startswith("note:") and "emulated" in line]
    assert len(notes) == 1 and "t4-16gb" in notes[0] and "amp-fp16" in notes[0]


BAD = [
    (["--model", "torchvision:resnet5000", "--batch-size", "8"], "unknown torchvision model", "list_models"),
    (["--model", "resnet50", "--batch-size", "8"], "no known form", "torchvision:NAME"),
    (["--model", "torchvision:resnet18", "--batch-size", "8", "--input", "3x224xq"], "malformed input shape", "CxHxW"),
    (["--model", "torchvision:resnet18", "--batch-size", "8", "--optimizer", "lion"], "unknown optimizer 'lion'", "adamw"),
    (["--model", "torchvision:resnet18", "--batch-size", "8", "--precision", "fp8"], "unknown precision 'fp8'", "amp-bf16"),
    (["--model", "torchvision:resnet18", "--batch-size", "0"], "--batch-size 0 must be at least 1", "fix:"),
    (["--model", "torchvision:resnet18", "--batch-size", "8", "--cudnn-benchmark", "yes"], "unknown cudnn-benchmark 'yes'", "off, on"),
    (["--model", f"{USER}:raises", "--batch-size", "8", "--input", "3x32x32"], "raised RuntimeError: checkpoint file", "fix the factory"),
    (["--model", f"{USER}:not_a_module", "--batch-size", "8", "--input", "3x32x32"], "not an nn.Module", "return the model"),
    (["--model", "tests/data/missing.py:build", "--batch-size", "8", "--input", "3x32x32"], "does not exist", "fix:"),
    (["--model", f"{USER}:data_dependent", "--batch-size", "8", "--input", "8"], "depend on the data", "fix:"),
    (["--model", "torchvision:resnet18", "--batch-size", "8", "--gpu", "k80"], "unknown GPU type 'k80'", "a100-40gb"),
    (["--model", "hf:NoSuchModelForLM", "--batch-size", "8"], "unknown transformers model", "hf:BertForMaskedLM"),
]


@pytest.mark.parametrize("argv,what,fix", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_input_is_a_message_not_a_traceback(argv, what, fix):
    r = vest("estimate", *argv, "--gpu", "a100-40gb") if "--gpu" not in argv else vest("estimate", *argv)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert what in r.stderr, r.stderr
    assert fix in r.stderr, r.stderr
    assert r.stdout == ""


SITE = """
[gpu.a100]
profile = "a100-40gb"
context_mib = {context}
memory_mib = 39000

[gpu.h100]
profile = "h100-80gb"

[partition.gpu]
gpu_types = ["a100", "h100"]
gpus_per_node = 4
"""


def _estimates(r):
    assert r.returncode == 0, r.stderr
    return {e["gpu"]: e for e in json.loads(r.stdout)["estimates"]}


def test_site_types_are_estimated_as_the_site_describes_them(tmp_path):
    """With a site config, `vest estimate` estimates the site's GPU types under their own names,
    with the site's memory and the floor it measured (`vest calibrate`), as vsbatch places them;
    a built-in profile can still be named beside them."""
    site = tmp_path / "site.toml"
    site.write_text(SITE.format(context=900))
    args = ("estimate", "--model", f"{USER}:small_cnn", "--batch-size", "8", "--input", "3x32x32", "--json")
    builtin = _estimates(vest(*args, "--gpu", "a100-40gb"))["a100-40gb"]
    doc = vest(*args, "--site-config", str(site))
    est = _estimates(doc)
    assert list(est) == ["a100", "h100"]          # the site's types, by default
    assert json.loads(doc.stdout)["site_config"] == str(site)
    a100 = est["a100"]
    assert a100["profile"] == "a100-40gb" and a100["capacity_mib"] == 39000
    assert a100["breakdown"]["cuda_context"] == 900
    assert a100["peak_mib"] - builtin["peak_mib"] == 900 - builtin["breakdown"]["cuda_context"]
    # the floor comes from the site: another calibration moves the estimate by the difference
    site.write_text(SITE.format(context=1300))
    assert _estimates(vest(*args, "--site-config", str(site), "--gpu", "a100"))["a100"]["peak_mib"] == a100["peak_mib"] + 400
    mixed = _estimates(vest(*args, "--site-config", str(site), "--gpu", "h100", "--gpu", "l4-24gb"))
    assert list(mixed) == ["h100", "l4-24gb"] and mixed["l4-24gb"]["profile"] == "l4-24gb"


def test_site_config_from_the_environment_and_its_errors(tmp_path):
    site = tmp_path / "site.toml"
    site.write_text(SITE.format(context=900))
    env_run = subprocess.run([sys.executable, "-m", "vest_slurm.cli", "estimate", "--model", f"{USER}:small_cnn",
                              "--batch-size", "8", "--input", "3x32x32"], capture_output=True, text=True, timeout=300,
                             env={**__import__("os").environ, "VEST_SITE_CONFIG": str(site)})
    assert env_run.returncode == 0, env_run.stderr
    assert f"site config {site}" in env_run.stdout and "a100 (a100-40gb)" in env_run.stdout
    assert "l4-24gb" not in env_run.stdout
    r = vest("estimate", "--model", f"{USER}:small_cnn", "--batch-size", "8", "--site-config", str(site), "--gpu", "k80")
    assert r.returncode != 0 and "unknown GPU type 'k80'" in r.stderr and "site's types (a100, h100)" in r.stderr
    r = vest("estimate", "--model", f"{USER}:small_cnn", "--batch-size", "8", "--site-config", str(tmp_path / "none.toml"))
    assert r.returncode != 0 and "file not found" in r.stderr and "Traceback" not in r.stderr
    # a file that is not there is not one to "correct": who installs it, and how to name another
    assert "correct the file" not in r.stderr and "site admins' to install" in r.stderr and "--site-config PATH" in r.stderr


def test_a_gpu_class_the_model_refuses_is_reported_and_the_others_estimated():
    r = vest("estimate", "--model", f"{USER}:needs_sm80", "--batch-size", "8", "--input", "16",
             "--gpu", "v100-16gb", "--gpu", "a100-40gb", "--json")
    assert [e["gpu"] for e in _estimates(r).values()] == ["a100-40gb"]
    assert "not estimated on v100-16gb" in r.stderr and "sm80+" in r.stderr
    r = vest("estimate", "--model", f"{USER}:needs_sm80", "--batch-size", "8", "--input", "16", "--gpu", "v100-16gb")
    assert r.returncode != 0 and "sm80+" in r.stderr and "Traceback" not in r.stderr and r.stdout == ""


def test_a_model_built_sees_the_gpu_it_is_traced_on():
    """A layer that picks its path when built (torch.cuda asked in __init__) is built for the GPU
    class it is traced on: sm80's wider projection on the A100, the plain one on the V100 (the
    question asked at construction keeps the two classes' traces apart). Before, it was built
    with the host's answer (no GPU) and failed when called on the fake one."""
    r = vest("estimate", "--model", f"{USER}:picks_its_kernel_when_built", "--batch-size", "8", "--input", "1024",
             "--gpu", "v100-16gb", "--gpu", "a100-40gb", "--json")
    assert r.returncode == 0, r.stderr
    v100, a100 = (e["breakdown"]["parameters"] for e in json.loads(r.stdout)["estimates"])
    mib = 4 / 2**20   # float32 weights and biases: (features x width + width) + (width x 10 + 10)
    assert a100 == pytest.approx((1024 * 4096 + 4096 + 4096 * 10 + 10) * mib, abs=0.05)
    assert v100 == pytest.approx((1024 * 1024 + 1024 + 1024 * 10 + 10) * mib, abs=0.05)


def test_a_declarative_failure_says_who_must_act_in_json():
    r = vest("estimate", "--model", f"{USER}:small_cnn", "--batch-size", "8", "--input", "5x32x32", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode != 0 and doc["kind"] == "script-error" and "--input" in doc["fix"]
    r = vest("estimate", "--model", f"{USER}:data_dependent", "--batch-size", "8", "--input", "16", "--json")
    doc = json.loads(r.stdout)
    line = next(i for i, text in enumerate(open(USER), 1) if "if x.sum() > 0" in text)
    assert doc["kind"] == "data-dependent" and doc["where"].endswith(f"user_models.py:{line}")
