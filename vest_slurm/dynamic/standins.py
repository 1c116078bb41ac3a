"""Stand-ins that let an unmodified training script run on fake CUDA (dynamic analysis only).

Each patch says what a real GPU run would do and what the stand-in does instead; all are undone
when ``patched()`` exits. Private torch APIs stay in _fakecuda.py; this module patches public ones.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import multiprocessing.process
import os
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..estimate import _fakecuda as fc
from ..estimate import oneshot
from ..estimate import _shadow
from . import checkpoints, cuda_surface
from .grad_scaler import FakeCudaGradScaler, FakeGradScaler, FakeShardedGradScaler
from . import tracked
from ..estimate.workload import optimizer_name


# The run goes on past its steps, up to this many times as many, until every optimizer the script
# made has stepped: optimizers that step at different rates (WGAN's critic steps n_critic = 5 times
# per generator step, as the WGAN and WGAN-GP papers set it) keep what the later one adds (its state,
# its model's gradients) out of a run stopped at the first steps; the rest is said (unstepped_note).
WAIT_FOR_OPTIMIZERS = 4
# The steps of a model kept on the host, with nothing on the GPU, that the run follows for a move to
# the GPU before it takes the script for one that trains on the host: what scripts do on the host
# first (a tutorial's CPU sections, an overfit-one-batch check, a small helper model fitted) is some
# tens to a few hundred steps; a host loop ends the run sooner where vest's time limit comes first
HOST_STEPS = 200
# After its traced steps the run goes on to the end of the epoch, where scripts evaluate, sample and
# save (an eval batch larger than the training one, a sampling loop: often the job's peak): the
# training loader's epoch ends at once, and each loader iterated from then on yields this many
# batches (the first shows the evaluation's tensors, the second the allocator's layout with them
# cached; repeats.py replays identical calls). The next training forward, backward or optimizer
# step ends the run.
DRAIN_BATCHES = 2


def unstepped(made, stepped) -> list:
    """The optimizers among ``made`` over parameters that take gradients which are not in ``stepped``."""
    return [o for o in list(made) if o not in stepped
            and any(getattr(p, "requires_grad", False) for g in o.param_groups for p in g["params"])]


def waits_for_optimizers(steps: int, max_steps: int, made, stepped) -> bool:
    """Whether a run at ``steps`` of its ``max_steps`` goes on for an optimizer yet to step
    (WAIT_FOR_OPTIMIZERS): the estimate's rule, and the live oracle's, which counts the same steps."""
    return steps < WAIT_FOR_OPTIMIZERS * max_steps and bool(unstepped(made, stepped))


@dataclass
class ScriptState:
    tracer: object
    max_steps: int
    stop: type
    tmpdir: str
    world_size: int = 1
    steps: int = 0
    depth: int = 0
    batch_hint: int | None = None
    batch_hint_depth: int = 1 << 30   # module nesting at which batch_hint was read
    batch_hint_no_grad: bool = False   # read in a forward under no_grad: setup, until one under grad
    first_forward_done: bool = False
    optimizers: weakref.WeakSet = field(default_factory=weakref.WeakSet)   # every optimizer the script made
    # a parameter a conversion replaced (the script may still hold it) -> its replacement (_apply_overwrite)
    moved_params: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    stepped: weakref.WeakSet = field(default_factory=weakref.WeakSet)    # those that stepped
    # which optimizer ended each training step (its number in the order they first stepped; None: a
    # hand-written update): a GAN's discriminator and generator steps alternate, and hold different tensors
    step_owners: list = field(default_factory=list)
    last_stepper: int | None = None
    optimizer_numbers: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    # the training forwards of each step (an episode's, until it ends): a count that varies where
    # stand-ins were read may be theirs to decide (runner's flag)
    forwards_per_step: list = field(default_factory=list)
    step_forwards: int = 0
    # per step, the forwards before its backward that followed a stand-in read made since the
    # forward before them (forward, read, forward, read, forward: a loop run until a value says
    # stop); and the reads counted at the last forward
    steered_steps: list = field(default_factory=list)
    steered: int = 0
    reads_at_forward: int = 0
    backward_in_step: bool = False
    processes_started: list = field(default_factory=list)   # the targets of multiprocessing Processes started
    dist_backend: str | None = None   # the backend init_process_group was asked for (the group is fake)
    # the side groups new_group made with a backend of their own (a gloo group for host work), each
    # with the backend asked for: (group, backend)
    group_backends: list = field(default_factory=list)
    waited_for: str | None = None   # the optimizers that had not stepped when the run stopped (unstepped_note)
    # the end of the epoch after the traced steps (DRAIN_BATCHES)
    loader_iter: object = None      # weakref to the DataLoader iterator that gave the last training batch
    draining: bool = False          # the traced steps are done; the script runs to its epoch's end
    epoch_ended: bool = False       # a loader's epoch has ended since
    iterations_counted: bool = False  # that end stopped the script's own next() (a loop over iterations)
    drain_armed: bool = False       # and a loader was iterated anew: the next training step ends the run
    drain_extra: int = 0            # steps trained while draining, before that (a batch fetched ahead)
    drain_note: str | None = None   # what ended that early, where it was not the next training step
    stopped_between: bool = False   # vest stopped the run between two training steps, before the steps asked
    ledger: tracked.Ledger = field(default_factory=tracked.Ledger)   # values read from the device
    input_problem: str | None = None   # why the model's inputs are not the real run's (tracked.input_problem)
    first_input_shape: tuple | None = None   # of the tensor batch_hint was read from
    # what the script did, for the workload block (not the command-line defaults)
    precision: str | None = None
    compute_seen: bool = False   # the first training forward's first Linear or convolution was seen
    channels_last: bool = False  # the model's convolution weights are channels-last
    cudnn_benchmark: bool = False
    zero_grad: str | None = None       # after-step / before-backward, where the script calls it
    recomputed: bool = False           # a module's forward ran in backward: activation checkpointing
    func_transform: bool = False        # a module ran under a torch.func transform (grad, vjp, vmap)
    optimizer: dict | None = None       # the first optimizer stepped: its class and defaults (workload block)
    # optimizer (id) -> (its class, its --optimizer name, parameters frozen at its last step, their bytes)
    frozen: dict = field(default_factory=dict)
    flags: list = field(default_factory=list)   # what stand-ins accepted but do not model (the estimate says so)
    cut_at_time_limit: bool = False     # the runner's time limit ended the run after its traced steps
    in_backward: int = 0                # backward calls under way
    step_in_backward: bool = False      # an optimizer stepped from a gradient hook in the backward under way
    # the stop without torch.optim (hand-written updates, or forward passes only)
    backwards: int = 0
    backwards_at_step: int = 0          # backward passes when the last optimizer step ended
    closure_backwards: int = 0          # backward passes inside the step under way (a closure's: LBFGS, Lightning)
    grad_accum: int = 1                 # the most backward passes before one optimizer step
    compiled_transient: int = 0         # bytes a torch.compile'd call, run eagerly, allocated and freed (_compiled_region)
    forwards_under_grad: int = 0
    optimizer_steps: int = 0
    in_optimizer_step: int = 0          # nesting of optimizer.step() calls under way
    stepping: str = ""                  # the class of the optimizer whose step is under way
    step_branches: dict = field(default_factory=dict)   # optimizer class -> where a step branched on a stand-in
    forward_since_backward: bool = False
    backward_since_update: bool = False
    manual_step_pending: bool = False
    stopped_by: str = "optimizer steps"
    param_storages: set = field(default_factory=set)   # storages of the trained models' parameters
    models: weakref.WeakSet = field(default_factory=weakref.WeakSet)   # modules called as the model
    model_types: set = field(default_factory=set)   # the classes of those models' modules (they outlive the run)
    # modules with weights called on the host at the top level: a model kept on the host (a
    # CPU-only script, a forgotten .to(device)), or a transform with weights
    host_models: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    host_model_names: dict = field(default_factory=dict)   # their class names, outermost first
    device_model_calls: int = 0   # top-level calls of a model on the device
    host_steps: int = 0   # steps of a model kept on the host while nothing lived on the GPU (HOST_STEPS)
    # per trained model (id): len(events) at its forward passes under grad, while no backward yet
    forward_marks: dict = field(default_factory=dict)
    branches: object = None   # the if bodies of the user's training loops (branches.Branches)
    written: set = field(default_factory=set)   # tensors (id) and storages the script wrote outside optimizer steps
    input_shapes: dict = field(default_factory=dict)   # (model id, class) -> its training inputs' shapes, in order (shapes_note)
    shape_from: tuple | None = None   # that key, while a training forward called with keywords only awaits its input's shape
    recomputing: bool = False   # in a forward the autograd engine runs (a checkpointed block's recomputation)
    hint_top: int = 0   # id of the outermost module of the forward the batch is read in
    trainable: dict = field(default_factory=dict)      # module id -> whether it has parameters that take gradients

    # branches on GPU values (known or stand-ins) since the step's last backward: code line -> (the
    # step's training forwards at the read, whether a stand-in was read there), for note_read
    read_lines: dict = field(default_factory=dict)
    loop_read: str | None = None   # where a loop of training forwards was steered by a stand-in (file:line)

    def note_read(self, standin: bool) -> None:
        """A branch on a value of a GPU tensor (``bool()``, ``torch.equal``; ``standin``: not known
        here) at the script's current line (a number read, ``.item()``, may only be logged or kept:
        an agent's sampled action each environment step of a fixed-length episode).
        The same line read again after a training forward, before the step's backward, is a loop
        of forwards whose test reads the GPU (``while residual > tol``, ``if converged: break``:
        fixed-point and implicit layers, adaptive ODE solvers, a sampler's accept/reject); where a
        stand-in was among its reads, a stand-in decided how many forwards the step keeps: the
        first such line is ``loop_read`` (the runner's flag; a loop it never ends is refused as
        data-dependent at the time limit)."""
        if not self.models or self.tracer.frozen or self.in_backward or len(self.read_lines) > 256:
            return
        line = tracked.code_line()
        if line is None:
            return
        prev = self.read_lines.get(line)
        standin = standin or (prev is not None and prev[1])
        if prev is not None and self.step_forwards > prev[0] and standin and self.loop_read is None:
            self.loop_read = f"{line[0]}:{line[1]}"
        self.read_lines[line] = (self.step_forwards, standin)

    def _next_step(self) -> None:
        """What is counted per step starts again."""
        self.step_forwards, self.steered, self.backward_in_step = 0, 0, False
        self.read_lines.clear()

    def reread_batch(self) -> None:
        """The batch read so far was not the training's: the next forward of the model reads it."""
        self.batch_hint, self.batch_hint_depth, self.first_input_shape = None, 1 << 30, None
        self.first_forward_done = self.batch_hint_no_grad = False

    def finish(self) -> None:
        if self.manual_step_pending and not self.tracer.frozen:   # (not after the run's end: a step of the epoch's end)
            self.close_manual_step(stop=False)
        self.tracer.s.phase = "other"

    def end_step(self, stop: bool = True) -> None:
        if self.branches is not None:
            self.branches.at_step()   # the user's lines this step came from: its training loops
        tr = self.tracer
        tr.s.phase = "other"
        if self.draining:
            # a step while draining, before a loader was iterated anew: the batch a wrapper had
            # fetched ahead (accelerate's DataLoaderShard, Lightning's fetcher hold the next one),
            # trained as the job does, as part of the epoch's end (not one of the traced steps);
            # one such is the epoch's last, a second means the loop does not end with its loader
            # (and the run's end, closing a hand-written step, counts none)
            if stop:
                if self.drain_armed or self.drain_extra:
                    self.end_drain()
                self.drain_extra += 1
            return
        if self.steps == 0 and self.host_models and not self.device_model_calls and tr.s.live_bytes == 0:
            # a model kept on the host trained, and nothing is on the GPU: no step of the GPU's. A
            # script may train on the host before it moves to the GPU (a tutorial's CPU sections, a
            # check on a few batches): followed for HOST_STEPS such steps, past which it is taken
            # to train on the host (the answer then: it would leave its GPU idle)
            self.host_steps += 1
            self.last_stepper = None
            self._next_step()
            if stop and self.host_steps >= HOST_STEPS:
                raise self.stop()
            return
        self.steps += 1
        tr.s.iteration = self.steps
        tr.step_end()
        self.step_owners.append(self.last_stepper)   # (growth is read between steps of one optimizer)
        self.last_stepper = None
        self.forwards_per_step.append(self.step_forwards)
        self.steered_steps.append(self.steered)
        self._next_step()
        oneshot.settle()   # what a step leaves alive (model, optimizer state, loaders) out of the collector's scans
        if stop and self.steps >= self.max_steps:
            if self.optimizer_steps and waits_for_optimizers(self.steps, self.max_steps, self.optimizers, self.stepped):
                return   # an optimizer of the script has yet to step (a GAN's generator every n-th step)
            self.waited_for = unstepped_note(self)   # (said now: the script's objects go as it unwinds)
            if self.start_drain():
                return
            tr.freeze()   # what the script frees while it unwinds is not part of the run
            raise self.stop()

    def start_drain(self) -> bool:
        """Go on to the end of the epoch (DRAIN_BATCHES): where the training batches come from a
        DataLoader iterator the script still holds, its epoch ends now; where none (batches sliced
        from tensors, or a wrapper that read its loader to the end ahead of the steps), the run goes
        on to the next training step, which ends it (the epoch's end is traced where it comes first;
        branches.py says an iteration's end that was not reached)."""
        if self.draining:
            return False
        it = self.loader_iter() if self.loader_iter is not None else None
        self.draining, self.epoch_ended, self.drain_armed, self.drain_extra = True, False, False, 0
        if it is None:
            self.epoch_ended = self.drain_armed = True
        else:
            it._vest_end = True
        return True

    def stop_draining(self, why: str | None = None) -> None:
        """The epoch's end is over: the next training step began (``why`` None), or what the script
        did there could not go on (``why``, said with the estimate); what follows is not traced."""
        self.draining = False
        self.drain_note = why
        self.tracer.freeze()

    def end_drain(self, why: str | None = None) -> None:
        """stop_draining, and the run ends here."""
        self.stop_draining(why)
        raise self.stop()

    def close_manual_step(self, stop: bool = True) -> None:
        """A backward followed by in-place updates of the parameters (no torch.optim step) was one
        training step: it ends where the next one starts (forward or backward) or the script ends."""
        self.manual_step_pending = False
        self.stopped_by = "backward passes followed by parameter updates (no torch.optim step)"
        self.end_step(stop)


# ---- modules: .cuda() / .to() / .half() on fake parameters -----------------------------------------

_LAZY_TARGET = "_vest_moved_to"   # an uninitialized parameter's attribute: (device, dtype) it was moved to


def _lazy_target(fn, t) -> tuple:
    """(device, dtype) a conversion puts a tensor of ``t``'s dtype on (an uninitialized tensor
    refuses the conversion itself)."""
    applied = fn(torch.empty(0, dtype=t.dtype))
    return applied.device, applied.dtype


def _moved_once_made(original):
    """LazyModuleMixin._infer_parameters, the pre-forward hook that makes a lazy module's
    parameters (and buffers) from its first input: made on the host, where they stayed, then
    converted as the .cuda() / .to() before asked (on a GPU their data had moved there; having
    none, they stayed: _apply_overwrite), through Module._apply, which repoints the optimizers."""
    @functools.wraps(original)
    def infer(self, module, args, kwargs=None):
        tensors = [t for t in itertools.chain(module._parameters.values(), module._buffers.values()) if t is not None]
        where = next((getattr(t, _LAZY_TARGET) for t in tensors if hasattr(t, _LAZY_TARGET)), None)
        out = original(self, module, args, kwargs)
        if where is not None:
            device, dtype = where
            module._apply(lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else None),
                          recurse=False)
        return out

    return infer


def _apply_overwrite(state: ScriptState):
    """Module._apply that puts the converted tensor in place of the old one (torch's
    overwrite_module_params_on_conversion behaviour). torch 2.14 swaps FakeTensor parameters in
    place instead, which fake tensors refuse. Tied parameters stay tied (one memo per call).

    A new Parameter object is not the one the script may hold from before the move (on a GPU
    ``.to()`` keeps the objects): the optimizers made so far are pointed at the new ones when the
    top-level call ends (accelerate's ``prepare(model, optimizer)``), one made later from parameters
    listed before the move is pointed there when it is made (``state.moved_params``, opt_init: its
    state and the gradients were missing from the estimate), and gradient hooks registered on the
    old object are the new one's."""
    memo_stack: list[dict] = []
    moved: list[tuple] = []

    def _apply(self, fn, recurse=True):
        top = not memo_stack
        if top:
            memo_stack.append({})
            moved.clear()
            # what a conversion allocates on the device is the model's weights and buffers, whichever
            # method asked (.cuda(), .to(), .half(), .to(memory_format=...)); an RNN's flat buffer,
            # made after its _apply, by the methods' own wrappers (_as_parameters)
            prev, state.tracer.s.category = state.tracer.s.category, "parameter"
        memo = memo_stack[0]
        try:
            if recurse:
                for m in self.children():
                    m._apply(fn)
            for key, p in list(self._parameters.items()):
                if p is None:
                    continue
                if id(p) in memo:
                    self._parameters[key] = memo[id(p)]
                    continue
                if isinstance(p, nn.parameter.UninitializedTensorMixin):
                    # nn.Lazy* modules' parameter, which has no shape yet: it stays, is made at its
                    # first forward, and then goes where the conversion put it (_moved_once_made)
                    setattr(p, _LAZY_TARGET, _lazy_target(fn, p))
                    memo[id(p)] = p
                    continue
                with torch.no_grad():
                    applied = fn(p)
                if applied is p:
                    memo[id(p)] = p
                    continue
                if isinstance(applied, nn.Parameter):
                    # a Parameter subclass's own conversion made the new one (bitsandbytes'
                    # Params4bit.to() of a quantized weight: a Params4bit with its quant_state);
                    # wrapping it again asks torch's subclass path for a detach of its own type
                    new = applied
                    new.requires_grad_(p.requires_grad)
                else:
                    new = nn.Parameter(applied, requires_grad=p.requires_grad)
                if p.grad is not None:
                    with torch.no_grad():
                        new.grad = fn(p.grad)
                _carry_hooks(p, new)
                fc.release_moved(p, new)
                memo[id(p)] = new
                moved.append((p, new))
                state.moved_params[p] = new
                self._parameters[key] = new
            for key, b in list(self._buffers.items()):
                if b is not None:
                    if isinstance(b, nn.parameter.UninitializedTensorMixin):   # (as a parameter's)
                        setattr(b, _LAZY_TARGET, _lazy_target(fn, b))
                        continue
                    if id(b) not in memo:
                        memo[id(b)] = fn(b)
                    self._buffers[key] = memo[id(b)]
            if top and moved:
                _repoint_holders(moved)   # (the optimizers' param_groups and state among them)
            return self
        finally:
            if top:
                memo_stack.clear()
                moved.clear()
                state.tracer.s.category = prev

    return _apply


def _carry_hooks(old: torch.Tensor, new: torch.Tensor) -> None:
    """The gradient hooks registered on a parameter (``register_hook``,
    ``register_post_accumulate_grad_hook``: the optimizer-in-backward recipe) go with it to its
    replacement (assigning the dicts registers them with autograd, as torch's own setters do)."""
    for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(old, name, None)
        if hooks and getattr(new, name, None) is None:
            setattr(new, name, hooks)


def moved(state, p):
    """The parameter that replaced ``p`` (through every move since), or ``p``."""
    seen = 0
    while p in state.moved_params and seen < 64:
        p, seen = state.moved_params[p], seen + 1
    return p


def _optimizer_number(state, opt) -> int:
    """The optimizer's number, in the order the script first stepped them."""
    return state.optimizer_numbers.setdefault(opt, len(state.optimizer_numbers))


def _repoint_optimizers(optimizers, new_of: dict) -> None:
    """Replace moved parameters in the optimizers' groups and state (keyed by parameter)."""
    for opt in list(optimizers):
        for group in opt.param_groups:
            group["params"] = [new_of.get(id(p), p) for p in group["params"]]
        for old_key in [k for k in opt.state if id(k) in new_of]:
            opt.state[new_of[id(old_key)]] = opt.state.pop(old_key)


def _repoint_holders(moved: list) -> None:
    """The lists, sets and dicts (values and keys) that hold a moved parameter's old object point at
    its replacement, as they would on a GPU, where the move keeps the object: an optimizer that is
    no torch.optim one (fastai's, a research repository's plain class) made before ``model.to()``
    kept the old objects, whose gradients never come, and trained nothing ("0 steps traced", the
    script blamed); a list for clip_grad_norm_ taken before the move clipped nothing. One scan of
    the collector's referrers per top-level move (some 60 ms for a transformers process)."""
    import gc

    new_of = {id(old): new for old, new in moved}
    olds = [old for old, _ in moved]
    for holder in gc.get_referrers(*olds):
        if holder is olds:
            continue
        if isinstance(holder, list):
            for i, x in enumerate(holder):
                if id(x) in new_of:
                    holder[i] = new_of[id(x)]
        elif isinstance(holder, set):
            found = [x for x in holder if id(x) in new_of]
            holder.difference_update(found)
            holder.update(new_of[id(x)] for x in found)
        elif isinstance(holder, dict):
            for k, v in list(holder.items()):
                if id(v) in new_of and isinstance(v, torch.Tensor):
                    holder[k] = new_of[id(v)]
            for k in [k for k in holder if isinstance(k, torch.Tensor) and id(k) in new_of]:
                holder[new_of[id(k)]] = holder.pop(k)


def _as_parameters(state: ScriptState, orig, is_cuda):
    """model.cuda() / model.to('cuda'): what they allocate on the device are the model's
    parameters and buffers."""

    def method(self, *args, **kwargs):
        if not is_cuda(*args, **kwargs):
            return orig(self, *args, **kwargs)
        tr = state.tracer
        prev, tr.s.category = tr.s.category, "parameter"
        try:
            return orig(self, *args, **kwargs)
        finally:
            tr.s.category = prev

    return method


def _to_cuda(*args, **kwargs) -> bool:
    device = fc.parse_to(*args, **kwargs)[0]
    return device is not None and device.type == "cuda"


# ---- GradScaler: grad_scaler.FakeGradScaler, FakeCudaGradScaler ---------------------------------------

def _sharded_grad_scaler() -> list:
    """FSDP's ShardedGradScaler module, where this torch has it (its stand-in: FakeShardedGradScaler)."""
    try:
        import torch.distributed.fsdp.sharded_grad_scaler as sgs
    except ImportError:
        return []
    return [sgs]

# ---- DistributedDataParallel -----------------------------------------------------------------------

def _data_parallel(real):
    """nn.DataParallel over one GPU (the job's): DataParallel.forward scatters the inputs to its
    one device and calls the module itself (data_parallel.py: ``len(self.device_ids) == 1``),
    but the scatter goes through C++ CUDA copies no fake tensor can make. The same here without
    the scatter: inputs moved to the device, the module called. Over more GPUs (replicas on
    each, outputs gathered on the first) the run stops naming it: vest's gap, with the
    declarative form that models it (``--parallelism dp``)."""

    class DataParallel(real):
        def forward(self, *inputs, **kwargs):
            if len(self.device_ids) != 1:
                from .cuda_surface import NotSupportedHere

                n = len(self.device_ids)
                raise NotSupportedHere(f"nn.DataParallel over {n} GPUs", "its replicas, scatter and gather run "
                                       f"through CUDA copies the fake GPU cannot make; the declarative form models "
                                       f"it: #VEST --parallelism dp --num-gpus {n} (with the model, batch and optimizer)")
            move = lambda t: t.to(fc.DEVICE)  # noqa: E731
            inputs, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, move, (inputs, kwargs))
            return self.module(*inputs, **kwargs)

    DataParallel.__name__ = DataParallel.__qualname__ = "DataParallel"
    return DataParallel


class FakeDDP(nn.Module):
    """DistributedDataParallel without communication: the wrapped module runs as is, and DDP's
    gradient buckets are allocated on the device when it is built, as the real Reducer does.

    The buckets (reducer.cpp ``initialize_buckets``: one flat ``gradients`` tensor per bucket, of
    the parameters' dtype) exist whatever ``gradient_as_bucket_view`` says; DDP's default
    (find_unused_parameters=False, distributed.py ``compute_bucket_size_limits``) puts every
    parameter of a dtype in one bucket until the second iteration rebuilds them, in the order the
    gradients came, at 25 MiB each: the same bytes, modelled as the first layout. What the flag
    changes is the gradients: with ``gradient_as_bucket_view=False`` each is a tensor of its own
    that the Reducer copies into the bucket; with True (``mark_variable_ready_dense``) a gradient
    autograd makes fresh (the first backward, and every backward after ``zero_grad(set_to_none=True)``)
    is copied into its view of the bucket and replaced by that view, so the fresh tensor is freed
    and the gradients live in the buckets alone. After a forward under ``no_sync()`` the Reducer's hooks
    do nothing (the gradients accumulate in their own tensors until a synchronised backward)."""

    def __init__(self, module, device_ids=None, output_device=None, *args, gradient_as_bucket_view=False, **kwargs):
        super().__init__()
        self.module = module
        self._vest_sync = self._vest_expect_hooks = True
        params = [p for p in module.parameters() if p.requires_grad]
        by_dtype: dict = {}
        for p in reversed(params):   # DDP lists the parameters backwards, as their gradients come
            by_dtype.setdefault(p.dtype, []).append(p)
        s = _STATE[0].tracer.s   # the buckets are tagged for the estimator
        s.category, s.module_stack = "gradient", s.module_stack + ["ddp_buckets"]
        try:
            self._vest_buckets = [torch.empty(sum(p.numel() for p in ps), dtype=dtype, device=fc.DEVICE)
                                  for dtype, ps in by_dtype.items()]
        finally:
            s.category, s.module_stack = None, s.module_stack[:-1]
        self._vest_params = list(by_dtype.values())
        self._vest_in_flight: list = []   # what a communication hook keeps until the backward ends
        if gradient_as_bucket_view:
            for bucket, ps in zip(self._vest_buckets, self._vest_params):
                offset = 0
                for p in ps:
                    view = bucket[offset:offset + p.numel()].view(p.shape)
                    offset += p.numel()
                    p.register_post_accumulate_grad_hook(self._into_bucket(view))

    def _into_bucket(self, view):
        ddp = weakref.ref(self)

        def hook(p):
            me = ddp()
            if me is None or not me._vest_expect_hooks or p.grad is None or p.grad is view:
                return
            view.copy_(p.grad)
            p.grad = view   # the fresh gradient is freed: the bucket holds it from now on

        return hook

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():   # the Reducer expects its hooks in the backward of a forward synced
            self._vest_expect_hooks = self._vest_sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        self._vest_sync = False
        try:
            yield
        finally:
            self._vest_sync = True

    def register_comm_hook(self, state, hook):
        """A communication hook for the buckets (accelerate's ``comm_hook``, a script's own). The
        default hooks' compression (default_hooks.py ``fp16_compress_hook`` / ``bf16_compress_hook``)
        allreduces a half-precision copy of each bucket, made when the bucket is ready and held by
        its future until the Reducer waits for them all at the backward's end; ``allreduce_hook``
        keeps nothing. Any other hook (PowerSGD's error feedback and low-rank factors, a script's
        own) is accepted and the estimate flagged: what it keeps is not modelled."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

        if hook is getattr(dh, "allreduce_hook", None):
            return
        half = {getattr(dh, "fp16_compress_hook", None): torch.float16,
                getattr(dh, "bf16_compress_hook", None): torch.bfloat16}.get(hook)
        if half is None:
            name = getattr(hook, "__qualname__", None) or type(hook).__name__
            _STATE[0].flags.append(f"DDP communication hook {name}: what it keeps on the GPU (PowerSGD's error "
                                   "feedback and low-rank factors, a hook's own buffers) is not modelled")
            return
        for bucket, ps in zip(self._vest_buckets, self._vest_params):
            ps[-1].register_post_accumulate_grad_hook(self._compressed(bucket, half))   # the bucket's last gradient

    def _compressed(self, bucket, dtype):
        ddp = weakref.ref(self)

        def hook(_p):
            me = ddp()
            if me is None or not me._vest_expect_hooks:
                return
            if not me._vest_in_flight:
                torch.autograd.Variable._execution_engine.queue_callback(me._vest_in_flight.clear)
            me._vest_in_flight.append(bucket.to(dtype))

        return hook

    def join(self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        return contextlib.nullcontext()   # uneven inputs: every rank of the fake group has the same

    def _set_static_graph(self):
        pass

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if hasattr(nn.parallel.DistributedDataParallel, name) and not name.startswith("_vest"):
                from ..errors import NotSupportedHere

                raise NotSupportedHere(f"DistributedDataParallel.{name}",
                                       "its stand-in (standins.FakeDDP) has no such member yet") from None
            raise


def _init_process_group(state: ScriptState):
    """init_process_group("nccl", ...) becomes rank 0 of a fake process group of the launch's world
    size: collectives return at once, no other rank is needed."""
    import torch.distributed as dist

    original = dist.init_process_group

    def init(backend=None, *args, **kwargs):
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            return
        asked = backend if backend is not None else kwargs.get("backend")
        # (init_process_group() with none: torch's default map, what get_backend() then says)
        state.dist_backend = str(asked) if asked else "cpu:gloo,cuda:nccl"
        original("fake", store=FakeStore(), rank=0, world_size=state.world_size)

    return init


def _get_backend(original, state: ScriptState):
    """dist.get_backend(): the backend the script asked for, not the fake group's ("fake"): OLMo-core
    picks its device by "nccl" in that name."""
    def get_backend(group=None):
        name = original(group)
        if name != "fake":
            return name
        asked = next((b for g, b in state.group_backends if g is group), None)
        return asked or state.dist_backend or name

    return get_backend


def _new_group(original, state: ScriptState):
    """dist.new_group(backend="gloo"), a side group for host work (barriers, object gathers; Lightning's
    rank_zero_first, detectron2's and DINOv2's gloo groups): a subgroup of the fake process group, as
    new_group() with no backend makes, which get_backend names as asked. A real gloo group met the
    fake store, where no other rank answers, and crashed the process. (new_subgroups and DeviceMesh's
    backend overrides come here too.)"""
    import inspect

    sig = inspect.signature(original)

    @functools.wraps(original)
    def new_group(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        asked = bound.arguments.pop("backend", None)
        if asked is not None:
            bound.arguments.pop("pg_options", None)   # the asked backend's options (ProcessGroupNCCL.Options)
        group = original(*bound.args, **bound.kwargs)
        if asked is not None:
            state.group_backends.append((group, str(asked)))
        return group

    return new_group


def _gathers():
    """all_gather / all_gather_into_tensor / all_gather_object on the fake process group, which
    moves no values: each rank's slot receives this rank's tensor, as every rank runs the same
    script (the estimate's model of the others). A gather of sizes, or of pickled objects (DETR's
    ``all_gather`` of any picklable: sizes gathered, then the padded bytes), then reads the values
    it sent: host data copied to the GPU keeps them (_shadow.py), and ``copy_`` allocates nothing,
    so the trace is unchanged."""
    import torch.distributed as dist

    real_gather, real_into = dist.all_gather, dist.all_gather_into_tensor

    def known(t) -> bool:   # values to carry: host data's (a model's tensors have none to copy)
        shadows = getattr(getattr(t, "fake_mode", None), "shadows", None)
        return shadows is not None and shadows.get(t) is not None

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        work = real_gather(tensor_list, tensor, group=group, async_op=async_op)
        if known(tensor):
            with torch.no_grad():
                for out in tensor_list:
                    if out.shape == tensor.shape:
                        out.copy_(tensor)
        return work

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        work = real_into(output_tensor, input_tensor, group=group, async_op=async_op)
        n = input_tensor.numel()
        if known(input_tensor) and n and output_tensor.numel() % n == 0 and output_tensor.is_contiguous():
            with torch.no_grad():
                for chunk in output_tensor.view(-1).split(n):
                    chunk.copy_(input_tensor.reshape(-1))
        return work

    def all_gather_object(object_list, obj, group=None):
        # (the real one pickles into device tensors and unpickles what comes back: nothing here)
        object_list[:] = [obj] * len(object_list)

    # the other object collectives (torch.distributed.checkpoint's coordinator gathers every rank's
    # save plan, scatters the global one and broadcasts the metadata): pickled into device tensors
    # that carry no values here, they unpickled garbage ("UnpicklingError", the script blamed)
    def is_rank(group, group_rank, rank) -> bool:
        return dist.get_rank(group) == group_rank if group_rank is not None else dist.get_rank() == (rank or 0)

    def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None, weights_only=False):
        if object_gather_list is not None and is_rank(group, group_dst, dst):
            object_gather_list[:] = [obj] * len(object_gather_list)

    def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None, weights_only=False):
        pass   # every rank holds what the source rank sends: this rank's own objects

    def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=None, group=None,
                            group_src=None, weights_only=False):
        if scatter_object_input_list is not None and scatter_object_output_list:
            scatter_object_output_list[0] = scatter_object_input_list[dist.get_rank(group)]

    return all_gather, all_gather_into_tensor, all_gather_object, gather_object, broadcast_object_list, \
        scatter_object_list


def _spawn():
    """torch.multiprocessing.spawn / start_processes(fn, args, nprocs, ...), the launcher of
    scripts that start one process per GPU themselves (pytorch/examples' imagenet, MoCo:
    ``mp.spawn(main_worker, nprocs=ngpus_per_node, args=...)``): rank 0 runs here, ``fn(0, *args)``,
    traced like the rest of the script; the other ranks run the same step on their own GPUs. A real
    spawn would start Python processes without the fake CUDA, which fail (NCCL finds no GPU) or
    compute on the CPU untraced."""
    class _Done:
        """What spawn(join=False) returns, for a rank that has already run."""

        processes = ()

        def join(self, timeout=None):
            return True

        def pids(self):
            return []

    def start_processes(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
        fn(0, *args)
        return None if join else _Done()

    def spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
        return start_processes(fn, args, nprocs, join, daemon, start_method)

    return spawn, start_processes


def _process_start(original, state=None):
    """multiprocessing's Process.start() given the model (pytorch/examples' mnist_hogwild:
    ``model.share_memory()``, then N processes train it, over CUDA IPC on the GPU or shared memory
    on the host): each process holds its own CUDA context, gradients and activations, and the trace
    is of one process; a fake tensor cannot be sent where a real one would. Said as vest's gap,
    naming the API, not as the script's failure. A process given no model is the sandbox's."""
    def start(self):
        device = _fake_tensor_device((getattr(self, "_args", ()), getattr(self, "_kwargs", {})))
        if device is not None:
            raise cuda_surface.NotSupportedHere(
                "multiprocessing.Process.start with the model's tensors",
                "the processes would share the model's tensors (" +
                ("CUDA IPC) and each take its own CUDA context and step memory on the same GPU"
                 if device == "cuda" else "host shared memory) and train it in processes of their own") +
                "; the dynamic estimate traces one process")
        if state is not None and len(state.processes_started) < 20:   # (where the run then trains none: said)
            target = getattr(self, "_target", None)
            state.processes_started.append(getattr(target, "__qualname__", None) or type(self).__name__)
        return original(self)

    return start


_INHERITED = object()   # a patched attribute the class had from a base class


def _fake_tensor_device(obj, depth: int = 0) -> str | None:
    """The device of a fake tensor in ``obj`` (a tensor, a module's weights, a container's items):
    "cuda" where there is one, else "cpu", else None."""
    if isinstance(obj, fc.FakeTensor):
        return obj.fake_device.type
    if isinstance(obj, nn.Module):
        items, depth = list(itertools.chain(obj.parameters(), obj.buffers())), 2
    elif depth < 3 and isinstance(obj, (list, tuple, set)):
        items = obj
    elif depth < 3 and isinstance(obj, dict):
        items = obj.values()
    else:
        return None
    found = {_fake_tensor_device(x, depth + 1) for x in items} - {None}
    return "cuda" if "cuda" in found else found.pop() if found else None


# ---- scalars and host copies ---------------------------------------------------------------------------

def _stand_in_scalar(t):
    if t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        return 1.0
    return 1


def _item(orig, ledger):
    def item(self):
        if isinstance(self, fc.FakeTensor):
            real = _shadow.read_of(self)
            if real is not None:
                return real.item()   # copied from the host: the real value, no stand-in
            return ledger.read("item", _stand_in_scalar(self))
        return orig(self)

    return item


def _tolist(orig, ledger):
    def tolist(self):
        if isinstance(self, fc.FakeTensor):
            real = _shadow.read_of(self)
            if real is not None:
                return real.tolist()
            v = _stand_in_scalar(self)
            out = v
            for d in reversed(self.shape):
                out = [out] * d if not isinstance(out, list) else [list(out) for _ in range(d)]
            return ledger.read("tolist", out)
        return orig(self)

    return tolist


def _read_through(orig, kind: str, ledger, state=None):
    """bool() / int() / float() / index of a fake tensor: C++ asks the fake mode, which answers a
    stand-in unless the value is known without data (_known.py); a stand-in read is listed. A
    branch (bool) read inside an optimizer's step is noted with the optimizer: LBFGS's convergence
    tests and its history update (``if ys > 1e-10``) decide how many iterations run and how much
    state it keeps, and a stand-in decides them here."""
    convert = {"bool": bool, "float": float}.get(kind, int)

    def method(self, *a):
        fake = isinstance(self, fc.FakeTensor) and getattr(self, "fake_mode", None) is not None
        standin = fake and self.fake_mode.fill_of(self) is None and _shadow.of(self) is None
        if standin:
            ledger.read(kind, None)
            if kind == "bool" and state is not None and state.in_optimizer_step and state.stepping:
                state.step_branches[state.stepping] = tracked.script_frame()
        if kind == "bool" and fake and state is not None and not state.in_optimizer_step:
            state.note_read(standin)   # (a branch on the value; a number read may only be logged or kept)
        if not fake or not torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.Python):
            return orig(self, *a)
        # called from C++ with Python dispatch off (torch.tensor([loss, n]) reads each 0-d element
        # so): the read would reach the real GPU; answer it as the fake mode would
        known = self.fake_mode.fill_of(self)
        real = _shadow.read_of(self) if known is None else None
        value = known if known is not None else real.item() if real is not None and real.numel() == 1 \
            else _stand_in_scalar(self)
        return convert(value)

    return method


def _compare(orig, ledger, state):
    """``torch.equal`` / ``torch.allclose`` (and the methods) of GPU tensors, which return a Python
    bool themselves: the fake mode refused them as data-dependent, and GPyTorch's conjugate
    gradients (``torch.equal(residual, residual)``, a NaN check) and kernels (``torch.equal(x1, x2)``)
    were refused with advice about shapes. Host copies compare their real values; a tensor against
    itself (the same view) is equal, as in a healthy run (no NaN); otherwise the value is a read of
    a stand-in, listed: the side a check that raises on the other lets through, else False."""
    import sys

    def compare(input, other, *a, **k):
        if not (isinstance(input, fc.FakeTensor) or isinstance(other, fc.FakeTensor)):
            return orig(input, other, *a, **k)
        reals = [_shadow.read_of(t) if isinstance(t, fc.FakeTensor) else t for t in (input, other)]
        if all(isinstance(r, torch.Tensor) for r in reals):
            return orig(*reals, *a, **k)
        if orig in (torch.equal, torch.Tensor.equal) and tuple(input.shape) != tuple(other.shape):
            return False   # (torch.equal compares sizes first; allclose broadcasts)
        known = isinstance(input, torch.Tensor) and isinstance(other, torch.Tensor) and fc.same_view(input, other)
        if known:
            same = True
        else:
            ledger.read("bool", None)
            passed = fc.check_passed_after_call(sys._getframe(1))
            same = passed if passed is not None else False
        state.note_read(not known)
        return same

    return compare


def _format(orig):
    """f"{loss:.4f}" and "{:6.2f}".format(val) of a 0-d device tensor: Tensor.__format__ formats
    ``item()`` only for a plain Tensor, and a fake tensor is a subclass (object.__format__ then
    refuses a format spec). The stand-in value is formatted instead."""
    def format_(self, spec):
        if isinstance(self, fc.FakeTensor) and self.dim() == 0:
            return format(self.item(), spec)
        return orig(self, spec)

    return format_


def _numpy(orig, ledger):
    """``.numpy()`` (and ``np.asarray``) of a fake tensor, after ``.cpu()``: the host values where
    they are known, else the stand-in value in every element, a read listed as ``.item()``'s is
    (not zeros, unlisted: TimesNet's FFT periods ``T // top.cpu().numpy()`` divided by zero and the
    script was blamed; a count or size read so came out empty). A numpy array keeps no mark."""
    def numpy(self, *a, **k):
        if isinstance(self, fc.FakeTensor):
            import numpy as np

            real = _shadow.read_of(self)
            if real is not None:
                return real.numpy(*a, **k).copy()
            return ledger.read("numpy", np.full(tuple(self.shape), _stand_in_scalar(self), dtype=_np_dtype(self.dtype)))
        return orig(self, *a, **k)

    return numpy


def _np_dtype(dtype):
    import numpy as np

    return {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
            torch.int64: np.int64, torch.int32: np.int32, torch.uint8: np.uint8, torch.bool: np.bool_}.get(dtype, np.float32)


# ---- Triton kernels --------------------------------------------------------------------------------------

def triton_patches(is_device, written) -> list:
    """A Triton kernel launched on fake tensors (TRL's chunked log-prob head, Liger, unsloth, a
    script's own ``@triton.jit``): on the GPU the launch allocates nothing through PyTorch's caching
    allocator (a kernel reads and writes the buffers it is given, which torch allocated before),
    so the stand-in launches nothing; what the kernel writes is unknown here, so every fake tensor
    it is given forgets what was known of its values (_known, _shadow). An autotuner's benchmark
    of its configurations times launches on the GPU: skipped the same way. Launches on real host
    tensors (none run on a CPU) are left to Triton. Nothing is patched where Triton is absent.
    ``is_device(a)``: whether an argument is a device tensor; ``written(t)`` is told of each.
    (The live oracle takes the same stand-in for its CPU-mapped device tensors.)"""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return []
    try:
        from triton.runtime import autotuner, jit
    except Exception:   # a Triton that does not import here has no kernel to launch either
        return []

    def fake_args(args, kwargs):
        return [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor) and is_device(a)]

    def launch(orig):
        def run(self, *args, **kwargs):
            fakes = fake_args(args, kwargs)
            if not fakes:
                return orig(self, *args, **kwargs)
            for t in fakes:
                written(t)
            return None
        return run

    out = [(jit.JITFunction, "run", launch(jit.JITFunction.run))]
    if hasattr(autotuner, "Autotuner"):
        out.append((autotuner.Autotuner, "run", launch(autotuner.Autotuner.run)))
    return out


# ---- checkpoints and compile -------------------------------------------------------------------------

def _compile(model=None, *args, **kwargs):
    """torch.compile runs eagerly here: the compiled graph's memory is close to eager's (at most
    lower), so the estimate stays on the safe side. A module comes back as torch.compile returns
    it, an ``OptimizedModule`` whose ``_orig_mod`` is the module (scripts unwrap it, and its
    state_dict's keys carry that prefix), made by ``torch._dynamo.disable``, which runs it eagerly;
    a function comes back as it is. Calls through a fusing backend count as compiled while they run
    (_compiled_region, _fuses): their FlexAttention is the fused kernel's."""
    if model is None:
        return lambda m: _compile(m, *args, **kwargs)
    fuses = _fuses(kwargs.get("backend"))   # (torch.compile's options are keyword-only)
    graphs = _cuda_graphs(kwargs.get("backend"), kwargs.get("mode"), kwargs.get("options"))
    if graphs and _STATE[0] is not None:
        from ..estimate import frames

        fr = frames.innermost(frames.stack())
        where = f" at {os.path.basename(fr[0])}:{fr[1]}" if fr else ""
        note = (f"torch.compile({graphs}){where} records CUDA graphs: on the GPU each captured graph keeps a "
                "private memory pool (its inputs, outputs and intermediates, apart from the caching allocator's "
                "other blocks), which this estimate, of the compiled code run eagerly, does not include; "
                "mode='max-autotune-no-cudagraphs' or the default mode runs as estimated")
        if note not in _STATE[0].flags:
            _STATE[0].flags.append(note)
    if isinstance(model, nn.Module):
        import torch._dynamo

        compiled = torch._dynamo.disable(model)
        if fuses:
            compiled.forward = _compiled_region(compiled.forward)
        return compiled
    return _compiled_region(model) if callable(model) and fuses else model


def _cuda_graphs(backend, mode, options) -> str | None:
    """How a torch.compile call asks for CUDA graphs (inductor's cudagraph trees), or None: the
    "cudagraphs" backend, mode "reduce-overhead" or "max-autotune" (torch/_inductor/__init__.py
    list_mode_options: triton.cudagraphs), options {"triton.cudagraphs": True}, or inductor's config
    set so by the script (torch._inductor.config.triton.cudagraphs) for a compile that does not
    say otherwise."""
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", "")
    if name == "cudagraphs":
        return "backend='cudagraphs'"
    if not _fuses(backend) or (backend is not None and name != "inductor"):
        return None
    if isinstance(options, dict) and "triton.cudagraphs" in options:
        return "options={'triton.cudagraphs': True}" if options["triton.cudagraphs"] else None
    if mode in ("reduce-overhead", "max-autotune"):
        return f"mode={mode!r}"
    config = sys.modules.get("torch._inductor.config")
    if mode is None and getattr(getattr(config, "triton", None), "cudagraphs", False):
        return "torch._inductor.config.triton.cudagraphs = True"
    return None


def _fuses(backend) -> bool:
    """Whether a torch.compile backend makes fused kernels: inductor (the default) and the others do;
    torch's debugging backends run the captured graph eagerly (torch/_dynamo/backends/debugging.py:
    eager, aot_eager, ...), as FlexAttention's own eager path compiles with backend "eager"."""
    if backend is None:
        return True
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", "")
    return not (name.startswith(("eager", "aot_eager"))
                or getattr(backend, "__module__", "").endswith("_dynamo.backends.debugging"))


_STATE: list = [None]   # the run's ScriptState while patched() is on (its tracer, what compiled calls left)


def _compiled_region(fn):
    """``fn`` counted as compiled while it runs (_fakecuda.COMPILED): its FlexAttention is the fused
    kernel's, as torch.compile makes it. Run eagerly, it also allocates the intermediates a compiled
    run's fused kernels may never write (create_block_mask's dense mask): the most of them alive at
    once and freed before the call returned is kept (ScriptState.compiled_transient) for the flag."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        state = _STATE[0]
        s = state.tracer.s if state is not None else None
        outer = fc.COMPILED[0] == 0 and s is not None
        if outer:
            entry, s.region_peak = s.live_bytes, s.live_bytes
        fc.COMPILED[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            fc.COMPILED[0] -= 1
            if outer:
                state.compiled_transient = max(state.compiled_transient, s.region_peak - max(entry, s.live_bytes))

    return run


# ---- phases and the stop -----------------------------------------------------------------------------

def _on_the_device(mod, args) -> bool:
    """Whether a module call is device work: a fake tensor among its positional inputs, or fake
    CUDA parameters (a model called with keyword arguments only). Not a model kept on the host:
    fake host weights (built in a constructor) on host inputs only."""
    p = next(mod.parameters(), None)
    if p is not None and isinstance(p, fc.FakeTensor):
        if p.fake_device.type == "cuda":
            return True
        host_weights = True
    else:
        host_weights = False
    for a in args or ():
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(x, fc.FakeTensor) and not (host_weights and x.fake_device.type == "cpu"):
                return True
    return False


def _autocast_precision() -> str:
    dtype = torch.get_autocast_dtype("cuda")
    return {torch.bfloat16: "amp-bf16", torch.float16: "amp-fp16"}.get(dtype, "fp32")


def _weights_dtype(mod):
    """The floating dtype that holds most of a model's weight bytes (improved-diffusion's fp16
    torso keeps its norms in fp32; the first parameter can be either), else None."""
    by: dict = {}
    for p in mod.parameters():
        if p.is_floating_point():
            by[p.dtype] = by.get(p.dtype, 0) + p.numel() * p.element_size()
    return max(by, key=by.get) if by else None


_COMPUTE = (nn.Linear, nn.modules.conv._ConvNd)


def _first_compute(state: ScriptState, mod, out) -> None:
    """Manual mixed precision: fp32 weights (the optimizer's masters) and half compute by the
    script's own casts, no autocast (nanochat's Linear casts its weight to the input's bf16): the
    first Linear or convolution of the first training forward says what the model computes in, and
    the precision is the amp one of that dtype (what it keeps: fp32 weights, half activations)."""
    if state.compute_seen or state.first_forward_done or not isinstance(mod, _COMPUTE) \
            or not isinstance(out, torch.Tensor) or not torch.is_grad_enabled():
        return
    state.compute_seen = True
    if state.precision == "fp32" and out.dtype in (torch.bfloat16, torch.float16):
        state.precision = "amp-bf16" if out.dtype == torch.bfloat16 else "amp-fp16"


def _top_level_forward(state: ScriptState, mod) -> None:
    """What a call of the training model shows: the precision it computes in (autocast's dtype,
    else its weights'), cudnn.benchmark as the script set it; forward passes under grad."""
    if torch.is_grad_enabled():
        state.forwards_under_grad += 1
        if state.precision is None:
            if torch.is_autocast_enabled("cuda"):
                state.precision = _autocast_precision()
            else:
                state.precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(_weights_dtype(mod), "fp32")
            # channels-last training (timm's --channels-last, the ImageNet example's): the model's
            # convolution weights in that memory format
            conv = next((p for p in mod.parameters() if p.dim() == 4 and p.shape[1] * p.shape[2] * p.shape[3] > 1), None)
            state.channels_last = conv is not None and not conv.is_contiguous() and \
                conv.is_contiguous(memory_format=torch.channels_last)
    state.cudnn_benchmark = state.cudnn_benchmark or bool(torch.backends.cudnn.benchmark)
    # Neither an optimizer step nor a backward pass so far: each forward pass under grad of a model
    # with weights to train may be the step. Its start is kept aside (a summary's forward before
    # training would shift the real steps' boundaries). Counted per model, and only models that
    # train: a frozen network under grad (a perceptual loss's VGG, a teacher) runs several times
    # in one step before its backward (fast_neural_style: VGG on the style image, then on the
    # output and on the input). One model may also run more than once before a backward (two
    # views, a siamese pair), so it takes 2N + 1 of its passes, still no backward, to be sure
    # there is none; the first N are the run's N steps. Not where an optimizer already holds the
    # model's weights: it steps later, after passes under grad that train nothing yet (a DQN's
    # actions chosen while its replay buffer fills, CleanRL's learning_starts), and the steps are its.
    trains = torch.is_grad_enabled() and any(p.requires_grad for p in mod.parameters())
    if state.optimizer_steps == 0 and state.backwards == 0 and trains and not _optimized(state, mod):
        tr = state.tracer
        marks = state.forward_marks.setdefault(id(mod), [])
        marks.append(len(tr.s.events))
        if len(marks) > 2 * state.max_steps:
            state.stopped_by = "forward passes of the model under grad (no backward, no optimizer step)"
            tr.s.step_ends[:] = marks[1:state.max_steps + 1]
            state.steps = state.max_steps
            tr.freeze()
            raise state.stop()


def _optimized(state: ScriptState, mod) -> bool:
    """Whether an optimizer the script made holds one of ``mod``'s weights that take gradients."""
    held = {id(p) for opt in state.optimizers for g in opt.param_groups for p in g["params"]}
    return any(id(p) in held for p in mod.parameters() if p.requires_grad)


def _note_frozen(state: ScriptState, opt) -> None:
    """The parameters an optimizer holds that are frozen (``requires_grad=False``, no gradient) at its step: a
    script training in stages (a frozen backbone, unfrozen after some epochs) steps them later, with
    their gradients and optimizer state, which the traced steps do not hold (frozen_note). Those the
    script writes itself are kept by it, not waiting to be unfrozen (_written)."""
    from . import fake_dist

    # (one whose gradient the script filled is trained: fp32 master weights kept beside a half
    # model, as Megatron's, apex O2's and fairseq's FP16 optimizers keep them, detached copies)
    frozen = {id(p): p for g in opt.param_groups for p in g["params"]
              if isinstance(p, torch.Tensor) and not p.requires_grad and p.grad is None and not _written(state, p)}
    if frozen or id(opt) in state.frozen:
        state.frozen[id(opt)] = (type(opt).__name__, optimizer_name(fake_dist.describe_optimizer(opt)), len(frozen),
                                 sum(p.numel() * p.element_size() for p in frozen.values()),
                                 sum(p.numel() for p in frozen.values()))


def _written(state: ScriptState, p) -> bool:
    """Whether the script wrote ``p`` itself outside the optimizer's steps (``p.data = ...``, an
    in-place update: MoCo's momentum encoder, a teacher's EMA): kept by the script, not waiting to
    be unfrozen."""
    return id(p) in state.written or (isinstance(p, fc.FakeTensor) and p.untyped_storage()._cdata in state.written)


# What unfreezing may add below which the flag says nothing: less than one 2 MiB segment of the
# caching allocator's small pool (kSmallBuffer), far inside any site's headroom
FROZEN_NEGLIGIBLE_BYTES = 2 << 20


def frozen_note(state: ScriptState) -> str | None:
    """The flag for parameters frozen at an optimizer's last traced step but held by it
    (_note_frozen), with what a stage that unfreezes them would add: their gradients (the
    parameters' bytes) and the optimizer's state (--optimizer's table: states per element, each of
    the parameter's dtype for torch.optim's, which keep ``zeros_like(param)``; bitsandbytes' 8-bit
    ones a fraction of fp32's whatever the parameter's dtype)."""
    from ..estimate.workload import OPTIMIZER_TABLE

    held = [f for f in state.frozen.values() if f[2]]
    if not held:
        return None
    count, nbytes = sum(f[2] for f in held), sum(f[3] for f in held)
    names = ", ".join(sorted({f[0] for f in held}))
    if all(f[1] in OPTIMIZER_TABLE for f in held):
        more = nbytes + sum(int(OPTIMIZER_TABLE[f[1]][2] * (4 * f[4] if ":" in OPTIMIZER_TABLE[f[1]][0] else f[3]))
                            for f in held)
        what = f"about {more / 2**20:,.0f} MiB more (their gradients and {names}'s state)"
    else:
        more = 4 * nbytes   # gradients and up to three states of the parameters' size (OPTIMIZER_TABLE)
        what = f"their gradients ({nbytes / 2**20:,.0f} MiB) and {names}'s state besides"
    if more < FROZEN_NEGLIGIBLE_BYTES:
        return None   # a buffer kept as a frozen parameter (random Fourier features): fixed by design
    return (f"the {names} optimizer holds {count} parameter tensor(s) ({nbytes / 2**20:,.0f} MiB) that were frozen "
            f"(requires_grad=False) in the traced steps: if the script unfreezes them later (fine-tuning in stages), "
            f"that stage needs {what}, which this estimate does not include")


def unstepped_note(state: ScriptState) -> str | None:
    """The flag for optimizers the script made that did not step in the traced steps (unstepped,
    after the run waited WAIT_FOR_OPTIMIZERS times its steps for them)."""
    waiting = unstepped(state.optimizers, state.stepped) if state.optimizer_steps else []
    if not waiting:
        return None
    params = {id(p): p for o in waiting for g in o.param_groups for p in g["params"] if isinstance(p, torch.Tensor)}
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    names = ", ".join(sorted({type(o).__name__ for o in waiting}))
    return (f"{len(waiting)} optimizer(s) the script made ({names}, over {nbytes / 2**20:,.0f} MiB of parameters) did not "
            f"step in the {state.steps} traced steps: their state and the gradients they step are not in this estimate "
            "(an optimizer stepped every n-th iteration, or one kept for later); the job may need more")


def _trains(state: ScriptState, mod) -> bool:
    """Whether ``mod`` has parameters that take gradients (asked once per module)."""
    if id(mod) not in state.trainable:
        state.trainable[id(mod)] = any(p.requires_grad for p in mod.parameters())
    return state.trainable[id(mod)]


def shapes_note(state: ScriptState) -> str | None:
    """The flag for training inputs whose shape changed from step to step (multi-scale training,
    a random resize per batch, padding to the longest sequence of each batch): the job's peak
    follows its largest input, which steps after the traced ones may bring."""
    for (_, name), seen in state.input_shapes.items():
        shapes = list(seen)
        if not shapes:
            continue
        first = shapes[0]
        # (an epoch's last, smaller batch is no larger input: not said)
        if any(len(s) != len(first) or s[1:] != first[1:] or s[0] > first[0] for s in shapes[1:]):
            largest = max(shapes, key=math.prod)
            return (f"the {name} model's training input changed shape between the traced steps "
                    f"({', '.join(map(str, shapes[:4]))}{', ...' if len(shapes) > 4 else ''}): the job's peak follows its "
                    "largest input, which later steps may bring (multi-scale training, random resizing, padding to each "
                    "batch's longest), or calls of the model under grad outside its training (samples drawn or an "
                    "evaluation without torch.no_grad(), an agent acting on one observation); this estimate is for "
                    f"the shapes traced, the largest {largest}")
    return None


def _first_input(args):
    """The first tensor of a module call's positional arguments that has a dimension, or None."""
    return next((a for a in (args or ()) if isinstance(a, torch.Tensor) and a.dim() > 0), None)


def _note_shape(state: ScriptState, key: tuple, first) -> None:
    """A training input's shape (``first``, or None: none seen) among model ``key``'s, the first 16 kept."""
    seen = state.input_shapes.setdefault(key, {})
    if first is not None and len(seen) < 16:
        seen.setdefault(tuple(int(d) for d in first.shape), None)


def _next_in_a_generator(frame) -> bool:
    """The caller of a loader's __next__ is a generator that called next() on it outside any
    try block of its own (not a for loop, which ends at a StopIteration; not accelerate's
    DataLoaderShard, which catches it): a StopIteration raised there becomes a RuntimeError
    (PEP 479). The try blocks are the code's exception table (dis._parse_exception_table; the
    entry Python 3.12 adds around a generator's body to make that RuntimeError is not one); where
    it cannot be read, False (the epoch ends as for any loader)."""
    import dis
    import inspect

    if frame is None or not frame.f_code.co_flags & inspect.CO_GENERATOR:
        return False
    code, at = frame.f_code, frame.f_lasti
    if not 0 <= at < len(code.co_code) or dis.opname[code.co_code[at]] == "FOR_ITER":
        return False
    parse = getattr(dis, "_parse_exception_table", None)
    if parse is None:
        return False
    try:
        handlers = {i.offset: i.opname for i in dis.get_instructions(code)}
        return not any(e.start <= at < e.end and handlers.get(e.target) != "CALL_INTRINSIC_1" for e in parse(code))
    except Exception:   # noqa: BLE001  (a private helper of dis: its form may change)
        return False


def drain_note(state: ScriptState) -> str | None:
    """The flag for an epoch's end that could not run to the next training step (DRAIN_BATCHES)."""
    if not state.drain_note:
        return None
    if state.iterations_counted:
        return (f"after the {state.steps} traced steps vest ended the data loader's epoch (to trace what a script "
                f"does at an epoch's end), and {state.drain_note} stopped on it: a loop that counts iterations, not "
                "epochs (Megatron-LM's), has no epoch's end there; the estimate is of the steps traced, and what the "
                "script does after its last iteration (evaluation, saving) is not in it")
    if state.stopped_between:
        return (f"vest stopped the run after {state.steps} training step(s) of the {state.max_steps} asked, in what the "
                f"script does between its steps (an evaluation every few steps, an epoch shorter than that): "
                f"{state.drain_note}; the estimate is of the steps traced, and what the script does there is not in it")
    return (f"after the {state.steps} traced steps the run went on to the end of the epoch, where the script "
            f"evaluates, samples or saves, and stopped there: {state.drain_note}; what the script does from there "
            "until the next epoch is not in this estimate")


def _parameter_storages(state: ScriptState) -> set:
    """The storages of the parameters that take gradients in the models the script called (the
    models trained), as the first backward pass starts: an in-place write to one outside an
    optimizer step is a hand-written update."""
    return {p.untyped_storage()._cdata for m in list(state.models) + list(state.host_models) for p in m.parameters()
            if isinstance(p, fc.FakeTensor) and p.requires_grad}


# in place by name, but they change a tensor's autograd flags or its shape's metadata, not its values:
# peft's disable_adapter() sets requires_grad_ on every adapter weight between micro-batches (TRL's
# DPO reference pass), which is no hand-written update
_NOT_WRITES = frozenset(("requires_grad_", "detach_", "share_memory_", "squeeze_", "unsqueeze_", "t_", "transpose_",
                         "swapdims_", "swapaxes_", "as_strided_", "rename_", "resize_", "resize_as_"))


def _in_place(name: str) -> bool:
    """A torch function that writes its first argument's values: ``add_``, ``p -= ...`` (not
    ``__get__``, nor ``requires_grad_``)."""
    return (name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES) \
        or name in ("__isub__", "__iadd__", "__imul__", "__itruediv__")


class UpdateWatch(torch.overrides.TorchFunctionMode):
    """Hand-written updates (no torch.optim): an in-place torch call outside an optimizer step
    that writes a trained parameter's storage (``p -= lr * p.grad``, ``p.data.add_(...)``,
    ``torch._foreach_add_``) after a backward pass closes a training step."""

    def __init__(self, state: ScriptState):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = self.state
        out = func(*args, **kwargs)
        if args and st.optimizer_steps and not st.in_optimizer_step:
            # tensors the script writes itself between steps (a momentum encoder's EMA; from the first
            # step on: before it, .cuda() and .to() set every parameter's data)
            if func == fc._SET_DATA:
                st.written.add(id(args[0]))
            elif _in_place(getattr(func, "__name__", "")) and isinstance(args[0], fc.FakeTensor):
                st.written.add(args[0].untyped_storage()._cdata)
        # (inside an optimizer step, a closure's forward and backward reset the phase: Lightning)
        if st.backward_since_update and st.param_storages and not st.in_optimizer_step \
                and st.tracer.s.phase == "other" and args:
            if _in_place(getattr(func, "__name__", "")):
                first = args[0]
                targets = first if isinstance(first, (list, tuple)) else (first,)
                if any(isinstance(t, fc.FakeTensor) and t.untyped_storage()._cdata in st.param_storages for t in targets):
                    st.backward_since_update = False
                    st.manual_step_pending = True
        return out


def _aliases(patches: list[tuple]) -> list[tuple]:
    """The same patches where another loaded torch module binds the original under the same name
    (``from torch.distributed.distributed_c10d import init_process_group`` in device_mesh.py,
    ``torch.distributed._tensor.device_mesh`` re-exporting init_device_mesh): a stand-in replaces
    the API wherever torch's own code or a script reaches it. Missing one made DeviceMesh call
    the real init_process_group, which waited for the other ranks until the time limit."""
    import sys
    import types

    out = []
    modules = [m for name, m in list(sys.modules.items())
               if isinstance(m, types.ModuleType) and (name == "torch" or name.startswith("torch."))]
    for obj, attr, new in patches:
        if not isinstance(obj, types.ModuleType):
            continue   # a class's attribute: one binding
        old = obj.__dict__.get(attr)
        if old is None or isinstance(old, (bool, int, float, str)):
            continue
        out.extend((m, attr, new) for m in modules if m is not obj and m.__dict__.get(attr) is old)
    return out


@contextlib.contextmanager
def patched(state: ScriptState):
    from . import fake_dist   # fully_shard / init_device_mesh stand-ins (FSDP2 scripts); the optimizer's description

    tr = state.tracer
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def pre_forward(mod, args):
        if state.draining and state.drain_armed and state.depth == 0 and mod in state.models and mod.training \
                and torch.is_grad_enabled():
            state.end_drain()   # the next epoch's training: the run is over
        if not state.recomputed and fc.current_autograd_node() is not None:
            state.recomputed = True   # torch.utils.checkpoint reruns the forward in backward
        if not state.func_transform and torch._C._functorch.maybe_current_level() is not None:
            state.func_transform = True
        if tr.s.oom_pending:
            # the first call after the fake GPU ran out of memory, caught by the script (a batch-size
            # finder): the exception skipped the forward hooks that close calls, and the batch read so
            # far was the attempt's that failed; the retry's first forward says the batch
            tr.s.oom_pending = False
            state.depth, tr.s.phase, state.recomputing = 0, "other", False
            state.reread_batch()
        if state.depth == 0 and (not _on_the_device(mod, args) or next(mod.parameters(), None) is None):
            # host code: a transform (torchvision's and timm's are modules) on real data; or a
            # module without weights on device data (normalisation, augmentation on the GPU): no
            # model trained, its input no batch (its allocations are traced as any op's). A host
            # module with weights that take gradients (here only where it was not on the device)
            # may be the model, kept on the host: its hand-written updates end steps too, and the
            # result names it (host_models)
            if any(p.requires_grad for p in mod.parameters()):
                state.host_models.add(mod)
                state.host_model_names.setdefault(type(mod).__name__, None)
            return
        if state.depth == 0 and fc.current_autograd_node() is not None:
            # a forward the autograd engine runs: torch.utils.checkpoint recomputing a block in the
            # backward pass, which it is part of (no call of the model, no input of the training)
            state.recomputing = True
            state.depth += 1
            return
        if state.depth == 0:
            state.shape_from = None
            if state.manual_step_pending:
                state.close_manual_step()
            if state.batch_hint_no_grad and torch.is_grad_enabled():
                # the batch read so far was a setup pass under no_grad (hlb-CIFAR10 initialises its
                # whitening layer on 50,000 images; a summary's dummy input): the model's training
                # forward, under grad, says the batch
                state.reread_batch()
            elif state.first_forward_done and not state.backwards and not state.optimizer_steps \
                    and state.hint_top == id(mod) and torch.is_grad_enabled() and _trains(state, mod) \
                    and _optimized(state, mod):
                # the model that said the batch called again under grad before any backward, its
                # optimizer waiting (a DQN choosing actions while its replay buffer fills): the
                # batch, and the inputs' shapes, are those of the pass the first backward follows
                # (not another module's of the same step: an embedding, then a head on a selection)
                state.reread_batch()
                state.input_shapes.clear()
            elif not state.first_forward_done:
                state.batch_hint_no_grad = not torch.is_grad_enabled()
            if not state.first_forward_done:
                state.hint_top = id(mod)
            _top_level_forward(state, mod)
            if torch.is_grad_enabled() and mod.training and not state.draining and _trains(state, mod):
                # a training forward's input (not a frozen loss network's: fast_neural_style's VGG)
                first, key = _first_input(args), (id(mod), type(mod).__name__)
                _note_shape(state, key, first)
                if state.step_forwards and not state.backward_in_step and state.ledger.count > state.reads_at_forward:
                    state.steered += 1   # another forward after a value read since the last one
                state.step_forwards += 1
                state.reads_at_forward = state.ledger.count
                if first is None:
                    # called with keywords only (`model(**batch)`, `model(input_ids=...)`: transformers,
                    # peft, TRL), which global hooks do not see: the first tensor a submodule is
                    # given positionally (the token embedding's ids) is its input's shape
                    state.shape_from = key
            if mod not in state.models:
                state.model_types.update(type(m) for m in mod.modules())
                # weights made on the device (from_pretrained with a device_map, device="cuda",
                # a torch.device context) were never moved by .to()/.cuda(), which marks the others
                tr.mark([p for p in mod.parameters() if fc._is_fake_cuda(p)], "parameter", unset_only=True)
            state.models.add(mod)
            state.device_model_calls += 1
            tr.s.phase = "forward"
            problem = tracked.input_problem(state.ledger, args)
            if problem and state.draining:
                state.end_drain(f"its model input depends on values a fake tensor does not have ({problem})")
            if problem and state.input_problem is None:
                state.input_problem = problem
                raise state.stop()
        if state.depth > 0 and not state.first_forward_done and state.precision in ("fp32", "bf16", "fp16") \
                and torch.is_grad_enabled() and torch.is_autocast_enabled("cuda"):
            # autocast entered inside the model's outermost module: a wrapper's forward (Fabric's
            # _FabricModule runs its precision plugin's forward_context there)
            state.precision = _autocast_precision()
        if state.shape_from is not None and state.depth > 0:
            first = _first_input(args)
            if first is not None:
                _note_shape(state, state.shape_from, first)
                state.shape_from = None
        if not state.first_forward_done and state.depth < state.batch_hint_depth:
            # the batch: the first dimension of the first tensor given to the model; a model called
            # with keyword arguments only (which global hooks do not see: transformers, peft
            # wrappers) shows its input to the shallowest submodule that takes one positionally
            # (the token embedding). Read in the first forward only.
            first = _first_input(args)
            if first is not None:
                state.batch_hint, state.batch_hint_depth = int(first.shape[0]), state.depth
                state.first_input_shape = tuple(int(d) for d in first.shape)
                problem = tracked.input_problem(state.ledger, (first,))
                if problem and state.input_problem is None:
                    state.input_problem = problem
                    raise state.stop()
        state.depth += 1

    def post_forward(mod, args, out):
        # (called also where the forward raised, always_call: a checkpointed block's recomputation
        # in backward stops early by raising once it has the tensors it needs, torch.utils.
        # checkpoint's _StopRecomputationError, and the modules it was inside must end too, or every
        # later forward of the model was taken for an inner call)
        if state.depth == 0:
            return   # a host module's call (pre_forward let it be)
        state.depth = max(0, state.depth - 1)
        if state.depth > 0:
            _first_compute(state, mod, out)
        if state.depth == 0 and state.recomputing:
            state.recomputing = False
            return   # (the phase stays the backward's)
        raised = out is None and sys.exc_info()[1] is not None
        if state.depth == 0:
            tr.s.phase = "other"
            if raised:
                # a training forward that a stop ended: within a step, not between two (the
                # steps before it are no estimate of the one it stopped in: bootstrap's `between`)
                state.forward_since_backward = state.forward_since_backward or torch.is_grad_enabled()
                return
            if not state.first_forward_done and not state.batch_hint_no_grad and not any(
                    isinstance(t, torch.Tensor) and t.requires_grad for t in torch.utils._pytree.tree_leaves(out)):
                # a forward that built no graph, though called under grad: a wrapper that turns
                # grad off inside (YOLOv5's AMP check through AutoShape, a profiler's dummy input):
                # setup, as under no_grad; the first forward under grad says the batch
                state.batch_hint_no_grad = True
            state.first_forward_done = True
            # (a forward under no_grad, an evaluation between steps, holds no graph the previous
            # step's gradients would live through until a backward: it places no zero_grad)
            state.forward_since_backward = state.forward_since_backward or torch.is_grad_enabled()

    def pre_step(opt, args, kwargs):
        if state.draining and state.drain_armed:
            state.end_drain()
        if state.optimizer is None:
            state.optimizer = fake_dist.describe_optimizer(opt)
        _note_frozen(state, opt)
        state.in_optimizer_step += 1
        state.stepping = type(opt).__name__
        tr.mark([p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None], "gradient")
        tr.s.phase = "optimizer"

    def post_step(opt, args, kwargs):
        state.stepped.add(opt)
        state.last_stepper = _optimizer_number(state, opt)
        tr.mark([v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)], "optimizer_state")
        state.optimizer_steps += 1
        state.in_optimizer_step = max(0, state.in_optimizer_step - 1)
        if not state.in_optimizer_step:   # micro-batches accumulated into this step (a closure's backward
            # passes are one: LBFGS re-evaluates it, Lightning runs the last micro-batch in it)
            inside = state.closure_backwards
            state.grad_accum = max(state.grad_accum, state.backwards - state.backwards_at_step - inside + min(inside, 1))
            state.backwards_at_step, state.closure_backwards = state.backwards, 0
        state.backward_since_update = False
        if state.in_backward:
            # stepped from a gradient hook (an optimizer per parameter, stepped as its gradient is
            # ready: the "optimizer step in backward" recipe): one step, which the backward's end ends
            state.step_in_backward = True
            tr.s.phase = "backward"
            return
        state.end_step()

    orig_backward = torch.autograd.backward
    orig_grad = torch.autograd.grad

    def _before_backward():
        if state.draining and state.drain_armed:
            state.end_drain()
        if state.manual_step_pending:
            state.close_manual_step()
        state.backwards += 1
        state.backward_in_step = True
        state.read_lines.clear()   # (a loop of forwards is one between two backward passes)
        state.closure_backwards += 1 if state.in_optimizer_step else 0
        state.forward_since_backward = False
        state.backward_since_update = True
        if not state.param_storages:
            state.param_storages = _parameter_storages(state)
        tr.s.phase = "backward"

    def a_backward(original):
        """torch.autograd.backward / grad: a backward pass; optimizer steps taken from its gradient
        hooks (post_step) make one training step, ended when it returns."""
        @functools.wraps(original)
        def call(*a, **k):
            # one inside a backward is part of that pass (reentrant activation checkpointing runs
            # a backward of its own per block; autograd.grad in a custom Function's backward): it
            # counted as a micro-batch each (Swin's --use-checkpoint: 18 for 2), and its end set
            # the phase of the rest of the outer pass to "other"
            nested = state.in_backward > 0
            if not nested:
                _before_backward()
            state.in_backward += 1
            try:
                out = original(*a, **k)
            finally:
                state.in_backward -= 1
                if not nested:
                    tr.s.phase = "other"
            if state.step_in_backward and not state.in_backward:
                state.step_in_backward = False
                state.end_step()
            return out

        return call

    backward, grad = a_backward(orig_backward), a_backward(orig_grad)

    def zero_grad_of(orig):
        """Optimizer.zero_grad and nn.Module.zero_grad (makemore's model.zero_grad(set_to_none=True)
        between forward and backward): where the script drops its gradients, for the workload block."""
        def zero_grad(self, set_to_none=True):
            state.zero_grad = "before-backward" if state.forward_since_backward else "after-step"
            tr.s.phase = "zero_grad"
            try:
                return orig(self, set_to_none)
            finally:
                tr.s.phase = "other"

        return zero_grad

    zero_grad = zero_grad_of(torch.optim.Optimizer.zero_grad)

    orig_opt_init = torch.optim.Optimizer.__init__

    @functools.wraps(orig_opt_init)
    def opt_init(self, *a, **k):
        orig_opt_init(self, *a, **k)
        state.optimizers.add(self)
        if len(state.moved_params):   # made from parameters listed before the model was moved
            new_of = {id(p): moved(state, p) for g in self.param_groups for p in g["params"] if p in state.moved_params}
            if new_of:
                _repoint_optimizers([self], new_of)
        if state.optimizer_steps == 0 and state.backwards > state.backwards_at_step and not state.in_backward:
            # backward passes before any optimizer existed were a phase of their own (gradients
            # estimated for an initialisation, importance scores, a dry run): the training's batch
            # and accumulation are read from its own passes, which start here
            state.backwards_at_step, state.closure_backwards = state.backwards, 0
            state.reread_batch()
            state.input_shapes.clear()   # (the shapes the training's inputs take start here too)

    orig_dl_init = torch.utils.data.DataLoader.__init__

    # (with DataLoader.__init__'s signature: frameworks that rebuild a loader with another sampler,
    # Lightning's _update_dataloader, read its arguments back by inspect.signature; with (*a, **k)
    # they lost batch_size and rebuilt it at batch 1)
    @functools.wraps(orig_dl_init)
    def dl_init(self, *a, **k):
        # Workers would fork copies of the process; one process reads only the batches used.
        k["num_workers"] = 0
        k.pop("prefetch_factor", None)
        k["persistent_workers"] = False
        k["pin_memory"] = False
        return orig_dl_init(self, *a, **k)

    import torch.distributed as dist
    import torch.multiprocessing as torch_mp
    import torch.nn.parallel as par

    spawn, start_processes = _spawn()
    loader_iter = torch.utils.data.dataloader._BaseDataLoaderIter
    orig_dl_next = loader_iter.__next__

    @functools.wraps(orig_dl_next)
    def dl_next(self):
        if state.draining:
            # the epoch's end: the training loader's epoch ends; a loader iterated anew after that
            # (the evaluation's, the next epoch's) arms the end of the run at the next training step
            # (not before: a wrapper that fetched the next batch ahead, accelerate's DataLoaderShard
            # or Lightning's fetcher, still trains on it, as the job does)
            drawn = getattr(self, "_vest_drawn", 0)
            if (getattr(self, "_vest_end", False) or drawn >= DRAIN_BATCHES) and not _next_in_a_generator(sys._getframe(1)):
                state.epoch_ended = True
                raise StopIteration   # the epoch ends (DRAIN_BATCHES)
            if getattr(self, "_vest_end", False):
                # read by next() inside a generator (YOLOv5's InfiniteDataLoader), where a
                # StopIteration becomes "generator raised StopIteration" (PEP 479): this epoch
                # cannot end early; the next training step ends the run, and an epoch's end not
                # reached by then is said (branches.py)
                self._vest_end, state.epoch_ended, state.drain_armed = False, True, True
            if drawn == 0 and state.epoch_ended:
                state.drain_armed = True
            self._vest_drawn = drawn + 1
            try:
                return orig_dl_next(self)
            except StopIteration:   # a loader shorter than that: its epoch ended too
                state.epoch_ended = True
                raise
        out = orig_dl_next(self)
        state.loader_iter = weakref.ref(self)
        return out

    patches = [
        (loader_iter, "__next__", dl_next),
        (nn.Module, "_apply", _apply_overwrite(state)),
        (nn.modules.lazy.LazyModuleMixin, "_infer_parameters",
         _moved_once_made(nn.modules.lazy.LazyModuleMixin._infer_parameters)),
        (nn.Module, "cuda", _as_parameters(state, nn.Module.cuda, lambda *a, **k: True)),
        (nn.Module, "to", _as_parameters(state, nn.Module.to, _to_cuda)),
        *((nn.Module, name, _as_parameters(state, getattr(nn.Module, name), lambda *a, **k: True))
          for name in ("half", "float", "double", "bfloat16")),
        (torch.autograd, "backward", backward),
        (torch.autograd, "grad", grad),
        (torch.optim.Optimizer, "zero_grad", zero_grad),
        (nn.Module, "zero_grad", zero_grad_of(nn.Module.zero_grad)),
        (torch.optim.Optimizer, "__init__", opt_init),
        (torch.utils.data.DataLoader, "__init__", dl_init),
        (torch.Tensor, "item", _item(torch.Tensor.item, state.ledger)),
        *((owner, name, _compare(getattr(owner, name), state.ledger, state))
          for owner in (torch, torch.Tensor) for name in ("equal", "allclose")),
        (torch.Tensor, "tolist", _tolist(torch.Tensor.tolist, state.ledger)),
        (torch.Tensor, "__bool__", _read_through(torch.Tensor.__bool__, "bool", state.ledger, state)),
        (torch.Tensor, "__int__", _read_through(torch.Tensor.__int__, "int", state.ledger)),
        (torch.Tensor, "__float__", _read_through(torch.Tensor.__float__, "float", state.ledger)),
        (torch.Tensor, "__index__", _read_through(torch.Tensor.__index__, "index", state.ledger)),
        (torch.Tensor, "numpy", _numpy(torch.Tensor.numpy, state.ledger)),
        (torch.Tensor, "__format__", _format(torch.Tensor.__format__)),
        (torch.amp, "GradScaler", FakeGradScaler),
        (torch.cuda.amp, "GradScaler", FakeCudaGradScaler),
        *((sgs, "ShardedGradScaler", FakeShardedGradScaler) for sgs in _sharded_grad_scaler()),
        (torch, "compile", _compile),
        # torch.cuda's lazy init would look for a driver; every public CUDA API is decided in cuda_surface
        (torch.cuda, "_lazy_init", lambda: None),
        (dist, "init_process_group", _init_process_group(state)),
        (dist, "get_backend", _get_backend(dist.get_backend, state)),
        (dist.distributed_c10d, "get_backend", _get_backend(dist.distributed_c10d.get_backend, state)),
        (dist.distributed_c10d, "new_group", _new_group(dist.distributed_c10d.new_group, state)),
        *zip((dist,) * 6, ("all_gather", "all_gather_into_tensor", "all_gather_object", "gather_object",
                           "broadcast_object_list", "scatter_object_list"), _gathers()),
        (torch_mp, "spawn", spawn),
        (torch_mp, "start_processes", start_processes),
        (multiprocessing.process.BaseProcess, "start", _process_start(multiprocessing.process.BaseProcess.start, state)),
        (par, "DataParallel", _data_parallel(par.DataParallel)),
        (nn, "DataParallel", _data_parallel(par.DataParallel)),
        (par, "DistributedDataParallel", FakeDDP),
        (nn.parallel, "DistributedDataParallel", FakeDDP),
    ]
    patches += cuda_surface.patches(cuda_surface.Answers(lambda: tr.s.live_bytes, lambda: tr.s.peak_bytes,
                                                        tr.empty_cache, lambda: tr.s.held_bytes))
    patches += fc.gpu_optimizer_defaults()
    patches += checkpoints.patches()   # torch.save / torch.load / safetensors of fake tensors
    patches += triton_patches(lambda a: isinstance(a, fc.FakeTensor),
                              lambda t: t.fake_mode.written_outside(t) if hasattr(t.fake_mode, "written_outside") else None)
    patches += fake_dist.patches(state)
    from . import fake_tp   # parallelize_module (tensor parallelism): one rank's shards

    patches += fake_tp.patches(state)
    patches += _aliases(patches)
    # (an attribute a class inherits is taken back by deleting the patch: _INHERITED)
    saved = [(obj, attr, _INHERITED if isinstance(obj, type) and attr not in obj.__dict__ else getattr(obj, attr, None))
             for obj, attr, _ in patches]
    hooks = [
        nn.modules.module.register_module_forward_pre_hook(pre_forward),
        nn.modules.module.register_module_forward_hook(post_forward, always_call=True),
        register_optimizer_step_pre_hook(pre_step),
        register_optimizer_step_post_hook(post_step),
    ]
    import torch.nn.parallel.distributed as ddp_mod

    patches.append((ddp_mod, "DistributedDataParallel", FakeDDP))
    saved.append((ddp_mod, "DistributedDataParallel", ddp_mod.DistributedDataParallel))
    _STATE[0] = state
    from . import post_import   # stand-ins put in place when the script imports their library

    scripted = cuda_surface.TorchScriptNames([(old, new) for (_, _, old), (_, _, new) in zip(saved, patches)])
    try:
        for obj, attr, new in patches:
            setattr(obj, attr, new)
        with post_import.installed(post_import.HOOKS):
            yield state
    finally:
        _STATE[0] = None
        for h in hooks:
            h.remove()
        for obj, attr, old in reversed(saved):
            if old is _INHERITED:
                if attr in obj.__dict__:
                    delattr(obj, attr)
            elif old is not None:
                setattr(obj, attr, old)
        scripted.undo()
