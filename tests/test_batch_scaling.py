"""A workload's trace at another batch size from a line through its traces at two (batch_scaling.py),
used by the Prober only once a third real trace equals the line's: the batch search then traces
three batches per GPU class, and every answer is the one the traces would give."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch  # noqa: F401

from vest_slurm.estimate.batch_scaling import BatchLine, NotAffine, run_notes, same
from vest_slurm.estimate.profiles import get_profile
from vest_slurm.estimate.trace import AllocEvent, AllocTrace
from vest_slurm.estimate.workload import parse_workload_args
from vest_slurm.site.advice import Prober, search_largest_batch

DATA = Path(__file__).parent / "data"
A100 = get_profile("a100-40gb")


def _conv(n: int) -> str:
    return f'["fwd",[{n},3,32,32],[16,3,3,3],[1,1],[1,1],[1,1],"float32",false,true]'


def _trace(n: int) -> AllocTrace:
    """Weights (no batch), an activation (4 KiB per sample), a cuDNN workspace keyed by the input."""
    return AllocTrace((
        AllocEvent("alloc", 1, 1728, 0, "setup", "parameter", "", "", "randn"),
        AllocEvent("alloc", 2, 4096 * n + 512, 0, "forward", "activation", "", "", "convolution"),
        AllocEvent("alloc", 3, 1000, 0, "forward", "workspace", "cudnn", _conv(n), "convolution"),
        AllocEvent("free", 3, 0, 0, "forward", "workspace", "cudnn", "", ""),
        AllocEvent("free", 2, 0, 0, "backward", "activation", "", "", ""),
    ), iterations=1, notes=("computes in bfloat16",), step_ends=(5,), gpu_asked=(("sdpa", (n, 8), True),))


def test_a_line_through_two_traces_gives_the_trace_at_any_batch():
    line = BatchLine(_trace(8), 8, _trace(4), 4)   # either order
    assert (line.b0, line.b1) == (4, 8)
    for n in (1, 4, 12, 100, 4096):
        assert same(line.at(n), _trace(n)), n


@pytest.mark.parametrize("change, why", [
    (lambda t: AllocTrace(t.events[:-1], 1, t.notes, t.step_ends, t.gpu_asked), "events"),
    (lambda t: AllocTrace(t.events[:1] + (AllocEvent("alloc", 2, 4096 * 8 + 512, 1, "forward", "activation", "", "",
                                                     "convolution"),) + t.events[2:], 1, t.notes, t.step_ends,
                          t.gpu_asked), "stream"),
    (lambda t: AllocTrace(t.events[:1] + (AllocEvent("alloc", 2, 4096 * 8 + 514, 0, "forward", "activation", "", "",
                                                     "convolution"),) + t.events[2:], 1, t.notes, t.step_ends,
                          t.gpu_asked), "no integer line"),
    (lambda t: AllocTrace(t.events, 1, ("other",), t.step_ends, t.gpu_asked), "notes"),
    (lambda t: AllocTrace(t.events, 1, t.notes, (4,), t.gpu_asked), "steps"),
])
def test_two_traces_that_differ_in_more_than_numbers_on_a_line_make_none(change, why):
    # 4 -> 8: the activation's slope is 4096 per sample; 514 extra bytes over 4 samples is no integer slope
    with pytest.raises(NotAffine, match=why):
        BatchLine(_trace(4), 4, change(_trace(8)), 8)


def test_a_line_never_gives_a_negative_size():
    small = AllocTrace((AllocEvent("alloc", 1, 100, 0), AllocEvent("alloc", 2, 1000 - 100, 0)), step_ends=(2,))
    large = AllocTrace((AllocEvent("alloc", 1, 200, 0), AllocEvent("alloc", 2, 1000 - 200, 0)), step_ends=(2,))
    with pytest.raises(NotAffine, match="below zero"):
        BatchLine(small, 1, large, 2).at(11)


def test_how_a_trace_was_had_is_not_part_of_the_run():
    assert run_notes(("traced in 2.41 s", "computes in bfloat16", "read from the trace cache")) == (
        "computes in bfloat16",)


def _spec(model: str, inp: str, batch: int = 4):
    return parse_workload_args(["--model", model, "--input", inp, "--batch-size", str(batch), "--optimizer", "adam"])


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch):
    monkeypatch.setenv("VEST_CACHE_DIR", "off")


def test_the_prober_traces_three_batches_and_scales_the_rest_to_the_same_answers():
    spec = _spec("torchvision:resnet18", "3x32x32")
    scaled, traced = Prober({"a100": A100}), Prober({"a100": A100}, scale_batches=False)
    for b in (4, 8):
        assert scaled.needed(spec.with_(batch_size=b), "a100") == traced.needed(spec.with_(batch_size=b), "a100"), b
    # 4 and 8 make the line, not yet checked: a search that stops here makes no third trace
    (line,) = scaled._lines.values()
    assert scaled.traces_made == 2 and not line.confirmed
    for b in (20, 48, 300):
        assert scaled.needed(spec.with_(batch_size=b), "a100") == traced.needed(spec.with_(batch_size=b), "a100"), b
    # batch 20 had the top of the range traced (where live tensors alone fill the A100) and checked
    assert line.confirmed and line.top > 300
    assert (scaled.traces_made, scaled.traces_scaled, traced.traces_made) == (3, 3, 5)
    for b in (20, 48, 300):
        mine, real = scaled.summary(spec.with_(batch_size=b), A100), traced.summary(spec.with_(batch_size=b), A100)
        assert mine.scaled and not real.scaled
        assert mine.trace.events == real.trace.events and mine.trace.step_ends == real.trace.step_ends
        assert run_notes(real.trace.notes) == mine.trace.notes[:-1] and "scaled" in mine.trace.notes[-1]
    # below the line's first batch the tracer may take another path (batch 1), and above its top: traced
    scaled.needed(spec.with_(batch_size=2), "a100")
    scaled.needed(spec.with_(batch_size=line.top + 1), "a100")
    assert scaled.traces_made == 5


def test_a_workload_whose_sizes_step_with_the_batch_is_traced_at_every_batch():
    spec = _spec(f"{DATA / 'user_models.py'}:pads_the_batch", "256")
    scaled, traced = Prober({"a100": A100}), Prober({"a100": A100}, scale_batches=False)
    # padded by 4 rows at batch 4 and by 8 at batch 8: the line says 4 + (b - 4) rows, the model pads 8 - b % 8
    for b in (4, 8, 12, 30, 64):
        assert scaled.needed(spec.with_(batch_size=b), "a100") == traced.needed(spec.with_(batch_size=b), "a100"), b
    assert scaled.traces_made == 6 and scaled.traces_scaled == 0   # the five and the check at the top
    (why,) = scaled._lines.values()
    assert isinstance(why, str) and "the line through batches 4 and 8 missed batch" in why


def test_the_batch_search_answers_as_with_every_batch_traced():
    spec = _spec("torchvision:resnet18", "3x64x64", batch=16)
    small = A100.with_overrides(context_mib=500)
    from dataclasses import replace

    small = replace(small, total_mib=6000, reserved_mib=0)   # a GPU the search reaches the edge of
    answers = {}
    for scale in (True, False):
        prober = Prober({"g": small}, scale_batches=scale)
        s = search_largest_batch(lambda b: prober.needed(spec.with_(batch_size=b), "g"), prober.capacity("g"), 16)
        answers[scale] = (s.batch, s.exact, prober.traces_made, prober.traces_scaled)
    assert answers[True][:2] == answers[False][:2] and answers[True][1]
    assert answers[True][2] <= 3 < answers[False][2] and answers[True][3] >= 1
