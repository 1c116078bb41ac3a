"""A single-GPU training run of a model with a stack of identical blocks, traced with 4 and 5 blocks
and scaled (estimate/step_scaling.py): the same run as the whole model's, event for event."""

from __future__ import annotations

from pathlib import Path

import pytest

from vest_slurm.estimate import step_scaling as ss
from vest_slurm.estimate import tracing
from vest_slurm.estimate.block_scaling import SCALED_NOTE, WHOLE_NOTE
from vest_slurm.estimate.estimator import estimate_from_trace, summarize
from vest_slurm.estimate.profiles import get_profile
from vest_slurm.estimate.tracing import trace_training
from vest_slurm.estimate.workload import parse_workload_args

H100 = get_profile("h100-80gb")
LAYERS = ss.MIN_BLOCKS + 1


@pytest.mark.parametrize("argv", [
    # autocast: each block's weight casts made in its forward, freed in its backward
    ["--model", "hf:tiny-llama", "--model-arg", f"num_hidden_layers={LAYERS}", "--optimizer", "adamw",
     "--precision", "amp-bf16"],
    # checkpointing: every block's casts dropped at once at the forward's end; recomputes in the backward
    ["--model", "hf:tiny-llama", "--model-arg", f"num_hidden_layers={LAYERS}", "--optimizer", "adamw",
     "--precision", "amp-bf16", "--gradient-checkpointing", "on"],
    # a for-loop optimizer: each tensor's temporaries freed as the next one's are made
    ["--model", "hf:tiny-llama", "--model-arg", f"num_hidden_layers={LAYERS}", "--optimizer", "adam",
     "--optimizer-impl", "for-loop"],
    # two forward and backward passes per step
    ["--model", "hf:tiny-llama", "--model-arg", f"num_hidden_layers={LAYERS}", "--optimizer", "sgd-momentum",
     "--grad-accum", "2"],
    # GradScaler; foreach temporaries dropped from the list's end (two regions meet)
    ["--model", "hf:gpt2", "--model-arg", f"n_layer={LAYERS}", "--model-arg", "n_embd=64", "--model-arg", "n_head=2",
     "--optimizer", "adamw", "--precision", "amp-fp16"],
])
def test_a_stack_of_identical_blocks_scaled_is_the_whole_run(argv):
    """The run scaled from 4 and 5 blocks and the whole model's run: every event (size, stream,
    phase, category, module, op, which allocation each free frees), the step ends and the GPU
    questions; the estimate from either is the same to the byte; the note says it was scaled."""
    spec = parse_workload_args(argv + ["--batch-size", "2", "--input", "seq64"])
    for capability in ((9, 0), (7, 0)):
        scaled = ss.trace_scaled(spec, capability, H100.total_bytes)
        whole = trace_training(spec, capability, H100.total_bytes)
        assert any(n.startswith(SCALED_NOTE) and f"{LAYERS} blocks" in n for n in scaled.notes), scaled.notes
        assert ss.canonical(scaled) == ss.canonical(whole), ss.first_difference(scaled, whole)
        assert scaled.gpu_asked == whole.gpu_asked
    a, b = estimate_from_trace(summarize(scaled, 1.0), spec, H100), estimate_from_trace(summarize(whole, 1.0), spec, H100)
    assert a.breakdown == b.breakdown and a.peak_bytes == b.peak_bytes and a.required_bytes == b.required_bytes


def test_blocks_that_differ_in_what_they_compute_are_traced_whole():
    """Blocks of the same shapes whose forward depends on their index (every third one does extra
    work): the 4-block run scaled is not the 5-block run, so the model is traced whole, the note
    says why, and the trace is the whole model's."""
    model = f"{Path(__file__).parent / 'data' / 'user_models.py'}:index_dependent_blocks"
    spec = parse_workload_args(["--model", model, "--model-arg", f"blocks={LAYERS}", "--batch-size", "4", "--input", "64",
                                "--optimizer", "adamw"])
    made = ss.trace_scaled(spec, (9, 0), H100.total_bytes)
    assert any(n.startswith(WHOLE_NOTE) and f"blocks ({LAYERS} blocks) traced whole" in n for n in made.notes), made.notes
    assert ss.canonical(made) == ss.canonical(trace_training(spec, (9, 0), H100.total_bytes))


def test_a_model_without_a_stack_of_blocks_is_built_and_traced_once(monkeypatch):
    """A CNN (no nn.ModuleList of blocks, no transformers blocks): one build, one run, no note."""
    built = []
    real = tracing.build_model
    monkeypatch.setattr(tracing, "build_model", lambda *a, **k: built.append(1) or real(*a, **k))
    spec = parse_workload_args(["--model", "torchvision:resnet18", "--batch-size", "2", "--input", "3x32x32",
                                "--optimizer", "sgd"])
    made = ss.trace_scaled(spec, (9, 0), H100.total_bytes)
    assert built == [1]
    assert not any(n.startswith((SCALED_NOTE, WHOLE_NOTE)) for n in made.notes)


def test_a_fixed_part_freeing_a_middle_block_s_tensor_is_not_periodic():
    """Pure data: a step that frees one middle block's tensor outside every block (nothing says
    which block of the n-block model it would be) is refused, not guessed."""
    from vest_slurm.estimate.trace import AllocEvent, AllocTrace

    def run(blocks: int, stray: int | None = None):
        ev, marks_f, marks_b = [], [], []
        for k in range(blocks):
            marks_f.append(len(ev))
            ev.append(AllocEvent("alloc", 100 + k, 4096, phase="forward", category="activation"))
        f_end = len(ev)
        for k in reversed(range(blocks)):
            marks_b.append(len(ev))
            ev.append(AllocEvent("alloc", 200 + k, 1024, phase="backward", category="gradient"))
            if k != stray:
                ev.append(AllocEvent("free", 100 + k, 4096, phase="backward"))
        b_end = len(ev)
        if stray is not None:   # block `stray`'s activation kept past the backward, freed by the loop
            ev.append(AllocEvent("free", 100 + stray, 4096, phase="other"))
        return (AllocTrace(tuple(ev), 1, (), (len(ev),)),
                [ss.Pass(tuple(marks_f), tuple(reversed(marks_b)), f_end, b_end)])

    assert ss.canonical(ss.scale(run(4), run(5), "blocks", 9)) == ss.canonical(run(9)[0])
    with pytest.raises(ss.NotPeriodic):
        ss.scale(run(4, 2), run(5, 2), "blocks", 9)
