"""`vest estimate` end to end: output contract, and bad input without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

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
    notes = [line for line in r.stdout.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "t4-16gb" in notes[0] and "emulated" in notes[0] and "amp-fp16" in notes[0]


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
