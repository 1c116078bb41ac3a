"""AllocTrace: the ordered allocations and frees a GPU run of the training step would make.

The record that crosses from tracing (fake CUDA on the CPU) to the allocator replay. Pure data:
no torch import, so the replay and its tests run without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("setup", "forward", "backward", "optimizer", "zero_grad", "eval", "other")
CATEGORIES = ("parameter", "gradient", "optimizer_state", "activation", "temporary", "input", "workspace",
              "weight_copy", "other")   # weight_copy: autocast's cached low-precision copy of a weight


@dataclass(frozen=True)
class AllocEvent:
    """One allocation (``action == "alloc"``) or free (``"free"``) of a device storage.

    ``block`` identifies the allocation (unique over the trace; a free names the block it frees).
    ``size_bytes`` is what the caller asked the allocator for (the storage's nbytes), before any
    rounding: the allocator replay applies PyTorch's rounding itself.
    """

    action: str
    block: int
    size_bytes: int
    stream: int = 0
    phase: str = "other"
    category: str = "other"
    module: str = ""
    detail: str = ""   # what sizes a workspace per GPU type (cuDNN: the convolution, cudnn_ws.conv_key)
    op: str = ""       # the aten op whose output (or workspace) this is; in backward, the autograd node


def with_size(e: AllocEvent, size_bytes: int) -> AllocEvent:
    """``dataclasses.replace(e, size_bytes=...)``, made by the constructor: the replay path makes
    tens of thousands of these per estimate (a GPU type's workspace sizes, the steps steady.py adds),
    and ``replace`` costs five times as much (it reads the fields and checks each by name)."""
    if size_bytes == e.size_bytes:
        return e
    return AllocEvent(e.action, e.block, size_bytes, e.stream, e.phase, e.category, e.module, e.detail, e.op)


def with_block(e: AllocEvent, block: int) -> AllocEvent:
    """``dataclasses.replace(e, block=...)``, made by the constructor (see with_size)."""
    return AllocEvent(e.action, block, e.size_bytes, e.stream, e.phase, e.category, e.module, e.detail, e.op)


# AllocTrace.notes says so when the traced run computed in bfloat16 (autocast or bf16 weights): it
# runs emulated, much slower, on GPUs before sm80 (placement takes them last).
BF16_NOTE = "computes in bfloat16"
# nn.LSTM/GRU/RNN on fake CUDA: a fake CUDA tensor is not is_cuda() to ATen's C++ (no CUDA key
# behind it), so ATen's lstm/gru/rnn pick their CPU kernels: oneDNN's LSTM layer (mkldnn_rnn_layer,
# its workspace as the fake kernel sizes it) and the CPU GRU/RNN cells (checked with a dispatch log).
# On the GPU cuDNN runs the whole RNN (aten._cudnn_rnn) with a reserve space for backward that only
# cuDNN on a GPU sizes (cudnnGetRNNTempSpaceSizes; torch's meta kernel gives it 0 bytes), and with
# cuDNN off the CUDA fused cells (_thnn_fused_lstm_cell / _gru_cell) run. The RNN's activations here
# are neither: flagged, not trusted.
CUDNN_RNN_NOTE = ("nn.LSTM/GRU/RNN traced through ATen's CPU kernels (oneDNN's LSTM layer, the CPU GRU/RNN "
                  "cells: ATen picks them for a tensor with no GPU behind it), while on the GPU cuDNN runs them "
                  "and keeps a reserve space for backward that only cuDNN on a GPU can size: the RNN's activation "
                  "memory here may be off")

# transformers >= 5 replaces layers with kernels it fetches from the Hub; the dynamic run turns that
# off (runner._child_env) and says so where it mattered (bootstrap.hub_kernels_note).
HUB_KERNELS_NOTE = ("transformers' Hub kernels were off (USE_HUB_KERNELS=0: they are fetched from the Hub, and the "
                    "estimate runs offline): PyTorch's own layers were traced where the job may load fused ones "
                    "(RMSNorm, rotary embedding, activations), which keep as much or less for the backward pass; "
                    "set USE_HUB_KERNELS=0 in the job to run what was estimated")
# Where a script's run caught CUDA out-of-memory and went on (a batch-size finder): a zero-size
# allocation of this module in the trace (tracing.Tracer._out_of_memory). The job's requirement is
# what it needs from the last one on (estimator._settled_need): each attempt before it ends in the
# out-of-memory error the script is written to catch.
CAUGHT_OOM = "caught_oom"
# torch.cuda.empty_cache() in a script's run: a zero-size allocation of this module, on which the
# allocator replay releases its cached segments (allocator._compile), as the real call does
EMPTY_CACHE = "empty_cache"
# Which Python a dynamic run took (runner.script_python): the job's own, or vest's while the job
# script loads software by means vest does not follow; said with the estimate.
JOB_PYTHON_NOTE = "the script ran in the job's Python"
JOB_SETUP_NOTE = "the job script loads software vest does not load"


@dataclass(frozen=True)
class AllocTrace:
    events: tuple[AllocEvent, ...]
    # Storages alive at the end (not freed in the trace): parameters, optimizer state, ...
    iterations: int = 0
    notes: tuple[str, ...] = field(default=())
    # Index of the event just after each completed training step (optimizer step and the loop's
    # bookkeeping): iteration k is events[step_ends[k-1]:step_ends[k]]. steady.py repeats the last one.
    step_ends: tuple[int, ...] = field(default=())
    # What the traced run asked the fake GPU whose answer depends on the GPU (_fakecuda.asked):
    # (question, argument, answer) each; None where it was not recorded (the trace holds only on
    # the GPU class it was made for). See holds_on.
    gpu_asked: tuple[tuple, ...] | None = None

    def live_peak_bytes(self, end: int | None = None) -> int:
        """Peak of the sum of live tensor sizes: what a FakeTensor / MemTracker count reports. The
        workspaces and kernel scratch the tracer adds (category ``workspace``) are not tensors
        such a count sees, so they are left out. ``end``: of the events before it only."""
        return max(self._live_after_each(end), default=0)

    def live_at_step_ends(self) -> list[int]:
        """The bytes of live tensors (as live_peak_bytes counts them) at the end of each training
        step (step_ends)."""
        ends = set(self.step_ends)
        return [0] * (0 in ends) + [live for i, live in enumerate(self._live_after_each(), 1) if i in ends]

    def kept_bytes(self, start: int, end: int, at: int) -> int:
        """The bytes of the tensors made by events[start:end] (workspaces left out) still alive after
        events[:at]."""
        made: dict[int, int] = {}
        for i in range(start, at):
            e = self.events[i]
            if e.action != "alloc":
                made.pop(e.block, None)
            elif i < end and e.category != "workspace":
                made[e.block] = e.size_bytes
        return sum(made.values())

    def _live_after_each(self, end: int | None = None):
        """The bytes of live tensors (workspaces left out) after each of the events before ``end``."""
        live = 0
        sizes: dict[int, int] = {}
        for e in self.events[:end]:
            if e.category != "workspace":
                if e.action == "alloc":
                    sizes[e.block] = e.size_bytes
                    live += e.size_bytes
                else:
                    live -= sizes.pop(e.block, 0)
            yield live


# A training loop holds the same tensors at the end of each step (the parameters, their gradients
# or none, the optimizer's state): what is left over grows with the steps only where the loop keeps
# something of each step (outputs or losses gathered in a list, a loss kept with its graph, a replay
# buffer filling). Said where the live bytes at the step ends rose at each of the last two traced
# steps, by at least this share of them a step: a job of 100 steps, shorter than most epochs, then
# holds twice what the traced steps did.
GROWTH_PER_STEP = 0.01


def growth_note(trace: "AllocTrace", owners: list | None = None) -> str | None:
    """The flag for device memory that grows from step to step (GROWTH_PER_STEP), or None.
    ``owners``: which optimizer ended each step, where the run knows; the steps compared are the
    last optimizer's (a GAN's discriminator and generator steps alternate and hold different
    tensors at their ends: compared with each other they looked like growth)."""
    ends, at = trace.live_at_step_ends(), list(trace.step_ends)
    if owners is not None and len(owners) == len(ends) and owners:
        ends, at = zip(*[(live, i) for live, i, o in zip(ends, at, owners) if o == owners[-1]]) or ((), ())
    if len(ends) < 3:
        return None
    a, b, c = ends[-3:]
    if not (min(b - a, c - b) >= GROWTH_PER_STEP * c):
        return None
    # what a step leaves is what it made that a later step did not free: a loop that holds its
    # current batch (multi-scale training draws a new image size each step) ends each step holding
    # a tensor of another size, freed by the next step; the rise of the step ends is no growth there
    if trace.kept_bytes(at[-3], at[-2], at[-1]) < GROWTH_PER_STEP * c:
        return None
    return (f"the tensors alive on the GPU at the end of each training step grew ({a / 2**20:,.1f}, {b / 2**20:,.1f}, "
            f"{c / 2**20:,.1f} MiB at the last 3 traced steps): the loop keeps something of every step on "
            "the GPU (outputs or losses gathered in a list, a loss kept with its graph, a buffer filling), so the job "
            "needs more with each step than this estimate of the first ones; keep such values on the host "
            "(.item(), .cpu()) or .detach() them, or allow for the growth over the job's steps")


def gpu_answer(question: str, arg, capability: tuple[int, int]):
    """What a GPU of ``capability`` answers to a question the tracer recorded (_fakecuda.asked),
    as the fake GPU answers it; ``NOT_DERIVED`` for a question whose answer is not re-derived here
    (the device's properties, the attention kernel chosen for given tensors)."""
    cap = tuple(capability)
    if question == "conv_bf16_on_cudnn":   # Convolution.cpp: cuDNN's bf16 convolutions need sm80
        return cap >= (8, 0)
    if question == "bf16_supported":       # torch.cuda.is_bf16_supported(including_emulation=arg)
        return cap >= (8, 0) or bool(arg)
    if question == "capability":           # torch.cuda.get_device_capability(), as "major.minor"
        return "%d.%d" % cap
    return NOT_DERIVED


NOT_DERIVED = "not re-derived"


def holds_on(trace: AllocTrace, capability: tuple[int, int]) -> bool:
    """Whether ``trace``, made on a GPU of another capability, is the trace a GPU of ``capability``
    makes: the tracer recorded every GPU-dependent question the run asked, and this GPU answers each
    alike. The run is deterministic given those answers (the model, its inputs and the fake
    device's other answers do not depend on the GPU), so it makes the same allocations."""
    if trace.gpu_asked is None:
        return False
    return all(answer != NOT_DERIVED and gpu_answer(q, arg, capability) == answer for q, arg, answer in trace.gpu_asked)
