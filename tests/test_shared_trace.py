"""A trace made for one GPU class is taken by another only where it is the trace that class makes:
every GPU-dependent question the run asked (trace.gpu_asked) gets the same answer there."""

from __future__ import annotations

import pytest
import torch  # noqa: F401

from vest_slurm.estimate import estimator, tracecache, tracing
from vest_slurm.estimate.profiles import get_profile
from vest_slurm.estimate.trace import NOT_DERIVED, AllocTrace, holds_on
from vest_slurm.estimate.workload import parse_workload_args

V100, A100, H100 = get_profile("v100-16gb"), get_profile("a100-40gb"), get_profile("h100-80gb")


def cnn(precision):
    return parse_workload_args(["--model", "torchvision:resnet18", "--input", "3x32x32", "--batch-size", "4",
                                "--precision", precision])


@pytest.fixture
def traced(monkeypatch):
    calls = []
    real = tracing.trace_training

    def counting(spec, capability=(8, 0), total_memory_bytes=80 << 30, *rest):
        calls.append(tuple(capability))
        return real(spec, capability, total_memory_bytes, *rest)

    monkeypatch.setattr(tracing, "trace_training", counting)
    monkeypatch.setenv("VEST_TRACE_AHEAD", "0")   # counted in this process: no class traced in a child (ahead.py)
    monkeypatch.setenv("VEST_CACHE_DIR", "off")
    return calls


@pytest.mark.parametrize("precision", ["fp32", "amp-fp16", "amp-bf16"])
def test_a_trace_holds_on_another_class_exactly_when_it_is_that_class_trace(precision):
    sp = cnn(precision)
    sm80, sm70 = tracing.trace_training(sp, (8, 0)), tracing.trace_training(sp, (7, 0))
    same = sm80.events == sm70.events
    assert holds_on(sm80, (7, 0)) == holds_on(sm70, (8, 0)) == same
    assert same == (precision != "amp-bf16")   # bf16 convolutions leave cuDNN before sm80 (Convolution.cpp)
    if precision == "amp-bf16":
        assert ("conv_bf16_on_cudnn", None, True) in sm80.gpu_asked


def test_trace_classes_traces_once_where_the_trace_holds_on_both(traced):
    profiles = [V100, A100, H100]
    fp32 = estimator.trace_classes(cnn("fp32"), profiles)
    assert traced == [(7, 0)] and fp32[True] is fp32[False]
    traced.clear()
    bf16 = estimator.trace_classes(cnn("amp-bf16"), profiles)
    assert traced == [(7, 0), (8, 0)] and bf16[True] is not bf16[False]


def test_the_prober_shares_it_too(traced):
    from vest_slurm.site.advice import Prober

    prober = Prober({"v100": V100, "a100": A100})
    sp = cnn("fp32")
    a, b = prober.estimate(sp, "v100"), prober.estimate(sp, "a100")
    assert traced == [(7, 0)] and prober.traces_made == 1
    assert b == estimator.estimate_from_trace(estimator.trace_for(sp, A100), sp, A100) and a.gpu == V100.key


def test_what_was_asked_survives_the_trace_cache_and_unknown_answers_hold_nowhere(tmp_path, monkeypatch):
    monkeypatch.setenv("VEST_CACHE_DIR", str(tmp_path))
    sp = cnn("amp-bf16")
    made = estimator.trace_for(sp, A100, cache=True).trace
    read = estimator.trace_for(sp, A100, cache=True).trace
    assert read.gpu_asked == made.gpu_asked and "read from the trace cache" in read.notes[-1]
    assert holds_on(AllocTrace((), gpu_asked=()), (7, 0))
    assert not holds_on(AllocTrace(()), (7, 0))   # not recorded (dynamic analysis, sharded): its class only
    assert not holds_on(AllocTrace((), gpu_asked=(("sdpa_kernel", None, None),)), (8, 0))
    assert not holds_on(AllocTrace((), gpu_asked=(("device_properties", None, NOT_DERIVED),)), (8, 0))
    assert holds_on(AllocTrace((), gpu_asked=(("capability", None, "9.0"),)), (9, 0))
    assert not holds_on(AllocTrace((), gpu_asked=(("capability", None, "9.0"),)), (8, 0))
