"""Trace a training step on the CPU with fake CUDA tensors: the AllocTrace a GPU run would make.

``trace_training(spec)`` builds the model on the meta device, gives its parameters fake CUDA
storage, and runs ``spec.steps`` iterations of the loop a training script runs:

    for batch in loader:                      # previous batch freed, new one copied to the GPU
        out = model(x); loss = loss_fn(out, y)   # under autocast for AMP; the previous
                                                 # iteration's out/loss are dropped after this
        (loss * scale).backward()               # GradScaler for amp-fp16
        optimizer.step()                        # unscale first for amp-fp16
        optimizer.zero_grad(set_to_none=True)   # the torch >= 2.0 default; --zero-grad moves it
                                                # between forward and backward, or drops it

Every storage allocation and free is recorded with its phase, category and module
(see vest_slurm/estimate/_fakecuda.py for how fake CUDA works and its known limitations).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from . import _fakecuda as fc
from . import oneshot
from .scratch import kernel_scratch
from ..errors import EstimateError, WorkloadError
from ..units import MiB
from .models import BuiltModel, build_model
from .trace import BF16_NOTE, CAUGHT_OOM, CUDNN_RNN_NOTE, EMPTY_CACHE, AllocEvent, AllocTrace
from .workload import OPTIMIZER_TABLE, WorkloadSpec

_aten = torch.ops.aten
_ADD = _aten.add.Tensor
# Backward formulas that write into zeros they just made, in place for plain tensors and out of
# place for subclass-like ones, as every tensor is under a dispatch mode (FunctionsManual.cpp and
# ATen: index_backward, gather_backward and cummax/cummin, index_select_backward,
# masked_select_backward, value_selecting_reduction_backward for max/min/median/topk/sort).
_ZEROS_FILLED_IN_PLACE = {_aten.index_put.default, _aten.scatter_add.default, _aten.index_add.default,
                          _aten.masked_scatter.default, _aten.scatter.src, _aten.scatter.value}


_MATMULS = {_aten.mm.default, _aten.bmm.default}
# the dispatch machinery between a Python call and the tracer (_python_call looks past it)
_DISPATCH_MODULES = ("vest_slurm.", "torch._subclasses", "torch.utils._python_dispatch", "torch._ops",
                     "torch.utils._stats", "torch._compile", "torch._dynamo", "torch.overrides", "torch._prims")


def _python_call() -> tuple[int, int] | None:
    """(frame, instruction) of the Python code whose call is dispatching now: two ops with the same
    one came from one call into C++ (a composite such as linear), not from two Python expressions."""
    f = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__", "").startswith(_DISPATCH_MODULES):
        f = f.f_back
    return None if f is None else (id(f), f.f_lasti)


def _called_by_autograd_engine() -> bool:
    """Whether the op being dispatched was called by autograd's C++ engine itself (or a C++
    backward formula), not by Python code that runs during backward: the first Python frame below
    the dispatch machinery is the one that started the backward pass."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_engine_run_backward" or (
                f.f_globals.get("__name__") == "torch.autograd" and f.f_code.co_name in ("backward", "grad")):
            return True   # where torch starts the engine (older releases: in autograd.backward / grad)
        if not f.f_globals.get("__name__", "").startswith(("vest_slurm.", "torch.")):
            return False
        f = f.f_back
    return False


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class _Block:
    index: int          # position of the alloc event
    phase: str
    category: str
    module: str
    iteration: int
    node: int | None = None   # sequence number of the autograd node that allocated it (backward)


@dataclass
class _InPlace:
    """An op the GPU runs in place (Tracer._maybe_in_place), waiting for its first operand's free."""
    old: int            # block of the first operand (the buffered gradient, the formula's zeros)
    out_index: int      # position of the op's output alloc event
    peak_before: int    # s.peak_bytes before that alloc


@dataclass
class _State:
    phase: str = "setup"
    category: str | None = None    # forced category (parameter, input, optimizer_state)
    iteration: int = 0
    module_stack: list = field(default_factory=list)
    events: list = field(default_factory=list)   # [action, block, size, phase, category, module]
    ops: dict = field(default_factory=dict)       # block -> the op that allocated it (AllocEvent.op)
    blocks: dict = field(default_factory=dict)    # block -> _Block
    freed_in: dict = field(default_factory=dict)  # block -> phase of its free
    blas_threads: set = field(default_factory=set)   # threads whose cuBLAS handle has its workspace
    cudnn_found: set = field(default_factory=set)    # (thread, convolution) cuDNN's benchmark mode has timed
    next_ws: int = -1
    pending: _InPlace | None = None   # Tracer._maybe_in_place; dropped by the next op or free
    matmul: tuple | None = None      # (block, _python_call()) of the last mm/bmm output (Tracer._linear_bias)
    alias: dict = field(default_factory=dict)   # block -> the block whose storage it is on the GPU
    peak_before_alloc: int = 0
    step_ends: list = field(default_factory=list)   # len(events) at the end of each training step
    bf16: bool = False   # an op made a bfloat16 tensor on the GPU (autocast or bf16 weights)
    rnn: bool = False    # an RNN kernel ran where cuDNN would run it on the GPU (CUDNN_RNN_NOTE)
    live_bytes: int = 0    # requested bytes alive now, and their peak (torch.cuda.memory_allocated's view)
    peak_bytes: int = 0
    # what the caching allocator holds at least (torch.cuda.memory_reserved's view, before the replay):
    # the live bytes' peak since the last empty_cache, freed blocks staying cached
    held_bytes: int = 0
    region_peak: int = 0   # the live bytes' peak inside the script's torch.compile'd calls (run eagerly)
    # dynamic analysis: the GPU's room for tensors (0: unbounded). An allocation that would take the
    # live bytes past it raises CUDA out-of-memory, as the GPU would, for scripts that catch it
    # (batch-size finders); refused: its block, never recorded; oom: the first one refused
    oom_at: int = 0
    refused: set = field(default_factory=set)
    oom: tuple | None = None
    oom_pending: bool = False   # raised and not yet followed by a model call (dynamic/standins.py)


def _thread() -> str:
    """The thread a GPU op runs on: autograd's device thread during backward, else the main one."""
    return "autograd" if fc.current_autograd_node() is not None else "main"


class Tracer:
    """Owns the trace state; the fake-CUDA mode only calls back into it."""

    def __init__(self, capability: tuple[int, int] = (8, 0)):
        self.s = _State()
        self.frozen = False
        self.capability = capability
        self.recorder = fc.Recorder(on_alloc=self._alloc, on_free=self._free, on_op=self._op)
        self._rnn_hook = None
        self._online_alloc = None   # the caching allocator run along (_online), for a run with s.oom_at

    # ``with tracer:`` around the traced region: the global module hook that sees RNNs lives only
    # there, so a trace that raises leaves no hook behind in a long-lived process (the bridge's worker)
    def __enter__(self) -> "Tracer":
        self._rnn_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._see_rnn)
        return self

    def __exit__(self, *_exc) -> None:
        if self._rnn_hook is not None:
            self._rnn_hook.remove()
            self._rnn_hook = None

    def _see_rnn(self, mod, _args) -> None:
        # an nn.LSTM/GRU/RNN on the (fake) GPU with cuDNN on: the GPU runs cuDNN's RNN, traced here
        # through ATen's CPU RNN kernels (CUDNN_RNN_NOTE)
        if (not self.s.rnn and not self.frozen and isinstance(mod, torch.nn.RNNBase) and torch.backends.cudnn.enabled
                and any(fc._is_fake_cuda(p) for p in mod.parameters())):
            self.s.rnn = True

    def freeze(self) -> None:
        """Stop recording: the run being traced is over."""
        self.frozen = True

    def step_end(self) -> None:
        """A training step (iteration) ends here: AllocTrace.step_ends, which steady.py reads."""
        self.s.step_ends.append(len(self.s.events))

    # -- callbacks from the dispatch mode
    def _alloc(self, block: int, nbytes: int, storage) -> None:
        if self.frozen:
            return
        s = self.s
        if s.oom_at:
            self._online_malloc(block, nbytes)
        module = s.module_stack[-1] if s.module_stack else ""
        phase = s.phase
        node = fc.current_autograd_node()
        if node is not None:
            phase = "backward"
        category = "weight_copy" if fc.CASTING_WEIGHT[0] else (s.category or "")
        s.blocks[block] = _Block(len(s.events), phase, category, module, s.iteration,
                                 node._sequence_nr() if node is not None else None)
        s.ops[block] = _op_name(node)
        s.events.append(["alloc", block, nbytes, phase, category, module])
        s.live_bytes += nbytes
        s.peak_before_alloc = s.peak_bytes
        s.peak_bytes = max(s.peak_bytes, s.live_bytes)
        s.held_bytes = max(s.held_bytes, s.live_bytes)
        if fc.COMPILED[0]:
            s.region_peak = max(s.region_peak, s.live_bytes)

    # -- a script that catches CUDA out-of-memory (tracer.s.oom_at: the GPU's room for tensors): the
    # caching allocator runs along with the trace, and the fake GPU runs out where it would, at
    # its reserved bytes (segments, rounding, the cache it releases before it gives up), not at
    # the tensors' bytes alone
    def _online(self):
        if self._online_alloc is None:
            from .allocator import CachingAllocator

            self._online_alloc = CachingAllocator(capacity_bytes=self.s.oom_at)
        return self._online_alloc

    def _online_malloc(self, block: int, nbytes: int, raise_oom: bool = True) -> None:
        from .allocator import OutOfMemory

        try:
            self._online().malloc(block, nbytes)
        except OutOfMemory:
            if raise_oom:
                self._out_of_memory(block, nbytes)
        except ValueError:
            pass   # an id the allocator holds already (a recorded call's block again): nothing new

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache() (the script's): marked in the trace (trace.EMPTY_CACHE), where
        the replay releases the cached segments, and done on the allocator run along, if any."""
        if self.frozen:
            return
        self.append_free(self.append_alloc(None, 0, self.s.phase, "other", EMPTY_CACHE, "", ""))
        self.s.held_bytes = self.s.live_bytes
        if self.s.oom_at:
            self._online().empty_cache()

    def _online_free(self, block: int) -> None:
        if self.s.oom_at:
            try:
                self._online().free(block)
            except KeyError:
                pass   # refused, or made before the room was set

    def _out_of_memory(self, block: int, nbytes: int) -> None:
        """What the caching allocator raises when the GPU has no room left (its message's words)."""
        s = self.s
        s.refused.add(block)
        where = s.module_stack[-1] if s.module_stack else ""
        if s.oom is None:
            s.oom = (s.live_bytes, nbytes, where)
        s.oom_pending = True
        self.append_free(self.append_alloc(None, 0, s.phase, "other", CAUGHT_OOM, "", ""))   # where it was raised
        fc.asked("out_of_memory", s.oom_at, None)   # the run depends on this GPU's capacity: its class only
        raise torch.cuda.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {nbytes / MiB:.2f} MiB. GPU 0 has {s.oom_at / MiB:.0f} MiB "
            f"for tensors, of which {s.live_bytes / MiB:.2f} MiB are allocated by PyTorch (vest's fake GPU)")

    def _free(self, block: int) -> None:
        if self.frozen:
            return
        s = self.s
        if block in s.refused:   # an allocation refused for want of memory: never made
            s.refused.discard(block)
            return
        pending, s.pending = s.pending, None
        if pending is not None and block == pending.old and len(s.events) == pending.out_index + 1:
            self._fold_in_place(pending)
            return
        block = s.alias.pop(block, block)
        self._online_free(block)
        phase = "backward" if fc.current_autograd_node() is not None else s.phase
        s.freed_in[block] = phase
        info = s.blocks.get(block)
        size = info and s.events[info.index][2] or 0
        s.events.append(["free", block, size, phase, "", ""])
        s.live_bytes -= size

    def _op(self, func, args, out) -> None:
        if self.frozen:
            return
        s = self.s
        s.pending = None
        if not s.bf16 and getattr(out, "dtype", None) is torch.bfloat16:
            s.bf16 = True
        if func in _MATMULS:
            s.matmul = (self.block_of(out), _python_call())
        elif func is _ADD and self._linear_bias(args, out):
            pass
        elif func is _ADD or func in _ZEROS_FILLED_IN_PLACE:
            self._maybe_in_place(func, args, out)
        if not _on_the_gpu(args, out):
            return   # a model kept on the host: no CUDA library runs it
        if func in fc.BLAS_OPS:
            # First cuBLAS call of a thread on the stream: the thread's handle gets a workspace from
            # the caching allocator, kept for the life of the process (CublasHandlePool.cpp
            # getCurrentCUDABlasHandle: handles are reserved per thread, workspaces are keyed by
            # handle and stream). Backward runs on autograd's device thread, so a training step
            # holds two: the main thread's (forward) and autograd's (backward).
            thread = _thread()
            if thread not in s.blas_threads:
                s.blas_threads.add(thread)
                self._workspace("cublas")
        if func in fc.CONV_OPS:
            # cuDNN takes a transient workspace per convolution (forward; backward-data, then
            # backward-filter); its size depends on the GPU (cudnn_ws.py, estimator.py).
            thread = _thread()
            for key in fc.conv_workspace_keys(func, args):
                if torch.backends.cudnn.benchmark and (thread, key) not in s.cudnn_found:
                    # Benchmark mode (Conv_v8.cpp get_plans_from_find): the first time a shape
                    # runs, one workspace as large as the largest engine's is allocated, every
                    # engine is timed in it, and it is freed; then the fastest plan runs with its
                    # own. The benchmark cache is thread_local: each shape is timed once per
                    # thread (the forward's on the main thread, the backward's on autograd's).
                    s.cudnn_found.add((thread, key))
                    self.append_free(self._workspace("cudnn_find", detail=key))
                self.append_free(self._workspace("cudnn", detail=key))
        scratch = kernel_scratch(func, args)
        if scratch is not None:
            # buffers the CUDA kernel allocates for itself and frees before returning (scratch.py)
            name, sizes = scratch
            blocks = [self._workspace(name, nbytes=n) for n in sizes]
            for block in reversed(blocks):
                self.append_free(block)

    def _maybe_in_place(self, func, args, out) -> None:
        """Where the GPU run writes in place and the traced one allocates, because under a dispatch
        mode every tensor is "subclass-like" (at::isTensorSubclassLike):
        - Autograd sums the gradients of a tensor used more than once (a residual connection,
          q/k/v from one input) in the pending node's InputBuffer (input_buffer.cpp
          ``accumulate``): on the GPU, with grad mode off, in place into the buffered gradient,
          ``old_var.add_(var)``, when the buffer holds the last reference to it and it is a plain
          dense tensor; here ``old_var + var``. That ``add``'s first operand is a gradient an
          earlier node made.
        - A few backward formulas fill zeros they just made (_ZEROS_FILLED_IN_PLACE): in place on
          the GPU, ``zeros.scatter_add(...)`` here. The first operand is the current node's own.
        Either way the op was called by the engine or a C++ formula (Python code in backward, a
        hook or a custom Function, allocates on the GPU too), and the first operand is dropped
        right after it: _free then makes the result live in the first operand's storage."""
        s = self.s
        if torch.is_grad_enabled() or len(args) < 2 or not isinstance(out, torch.Tensor):
            return
        old = args[0]
        node = fc.current_autograd_node()
        if node is None or not fc._is_fake_cuda(old):
            return
        if func is _ADD and not (len(args) == 2 and fc._is_fake_cuda(args[1])):
            return
        if old.shape != out.shape or old.dtype != out.dtype or not fc.is_dense(old):
            return
        old_block = self.recorder.live_block(old)
        info = s.blocks.get(old_block)
        same_node = info is not None and info.node == node._sequence_nr()
        if info is None or info.phase != "backward" or same_node != (func is not _ADD):
            return
        if not _called_by_autograd_engine():
            return   # Python code in backward (a tensor hook, a custom Function): out of place there too
        out_block = self.block_of(out)
        if not s.events or s.events[-1][:2] != ["alloc", out_block]:
            return   # not a new storage just allocated for the result
        s.pending = _InPlace(old_block, len(s.events) - 1, s.peak_before_alloc)

    def _linear_bias(self, args, out) -> bool:
        """nn.functional.linear's bias on its matmul's output (an input addmm does not take whole: a
        3-D one that is not contiguous, as nn.MultiheadAttention's in-projection of a batch_first
        input, or one of more dims): on the GPU ``output.add_(bias)`` (Linear.cpp), here ``add``,
        as the bias is "subclass-like" under the fake mode. It is that sum where a 1-D tensor is
        added along the last dimension of the last matmul's output within the same Python call
        (one C++ call made both: ``x @ w + b`` in a script is two, and allocates on the GPU too);
        where that output is dropped right after, _free makes the sum live in its storage."""
        s = self.s
        old, bias = (args[0], args[1]) if len(args) == 2 else (None, None)
        if s.matmul is None or not (isinstance(out, torch.Tensor) and fc._is_fake_cuda(old) and isinstance(bias, torch.Tensor)
                                    and bias.dim() == 1 and old.shape == out.shape and old.dtype == out.dtype
                                    and bias.shape[-1] == out.shape[-1] and fc.is_dense(old)):
            return False
        old_block, out_block = self.recorder.live_block(old), self.block_of(out)
        if s.matmul != (old_block, _python_call()) or not s.events or s.events[-1][:2] != ["alloc", out_block]:
            return False
        s.pending = _InPlace(old_block, len(s.events) - 1, s.peak_before_alloc)
        return True

    def _fold_in_place(self, acc: _InPlace) -> None:
        """The op's output is its first operand's storage on the GPU: undo its allocation."""
        s = self.s
        _, out_block, out_size, *_ = s.events.pop(acc.out_index)
        self._online_free(out_block)
        s.alias[out_block] = s.alias.pop(acc.old, acc.old)
        s.live_bytes -= out_size
        s.peak_bytes = acc.peak_before

    def _workspace(self, name: str, nbytes: int = 0, detail: str = "") -> int:
        """Allocate a workspace block (freed by the caller with append_free, or kept)."""
        node = fc.current_autograd_node()
        phase = "backward" if node is not None else self.s.phase
        return self.append_alloc(None, nbytes, phase, "workspace", name, detail, _op_name(node))

    # -- appended as given: workspaces, and a recorded call again (vest_slurm/dynamic/repeats.py)
    def append_alloc(self, block: int | None, nbytes: int, phase: str, category: str, module: str,
                     detail: str, op: str) -> int:
        """Append an allocation in the given phase, category and module; ``block`` None takes a
        new workspace id. Returns the block."""
        s = self.s
        if block is None:
            block = s.next_ws
            s.next_ws -= 1
        s.blocks[block] = _Block(len(s.events), phase, category, module, s.iteration)
        s.ops[block] = op
        if s.oom_at and module not in (CAUGHT_OOM, EMPTY_CACHE):   # (a workspace that does not fit: cuDNN takes a smaller one)
            self._online_malloc(block, nbytes, raise_oom=False)
        s.events.append(["alloc", block, nbytes, phase, category, module, detail])
        s.live_bytes += nbytes
        s.peak_bytes = max(s.peak_bytes, s.live_bytes)
        s.held_bytes = max(s.held_bytes, s.live_bytes)
        return block

    def append_free(self, block: int) -> None:
        """Append the free of a block append_alloc appended, in the phase it was allocated in."""
        s = self.s
        info = s.blocks[block]
        self._online_free(block)
        s.freed_in[block] = info.phase
        size = s.events[info.index][2]
        s.events.append(["free", block, size, info.phase, "", ""])
        s.live_bytes -= size

    # -- helpers used by the loop
    def block_of(self, t: torch.Tensor) -> int | None:
        """The live block behind a fake CUDA tensor (None for anything else)."""
        if not fc._is_fake_cuda(t):
            return None
        return self.recorder.live_block(t)

    def mark(self, tensors, category: str, unset_only: bool = False) -> None:
        """Give the blocks of ``tensors`` a category; ``unset_only``: only those without one."""
        for t in tensors:
            b = self.block_of(t)
            if b is not None and b in self.s.blocks and not (unset_only and self.s.blocks[b].category):
                self.s.blocks[b].category = category

    def finish(self, iterations: int, notes=(), gpu_asked: tuple | None = None) -> AllocTrace:
        s = self.s
        out = []
        for action, block, size, phase, _cat, module, *detail in s.events:
            info = s.blocks.get(block)
            if action == "alloc":
                cat = info.category or self._lifetime_category(block, info)
                out.append(AllocEvent("alloc", block, size, 0, phase, cat, module, detail[0] if detail else "",
                                      s.ops.get(block, "")))
            else:
                out.append(AllocEvent("free", block, size, 0, phase, info.category if info else "", ""))
        notes = tuple(notes) + ((BF16_NOTE,) if s.bf16 else ()) + ((CUDNN_RNN_NOTE,) if s.rnn else ())
        return AllocTrace(tuple(out), iterations, notes, tuple(s.step_ends), gpu_asked)

    def _lifetime_category(self, block: int, info: _Block) -> str:
        freed = self.s.freed_in.get(block)
        if info.phase == "forward":
            return "temporary" if freed == "forward" else "activation"
        if info.phase == "setup":
            return "other"
        return "temporary"


def _on_the_gpu(args, out) -> bool:
    """Whether an op ran on the fake GPU: a fake CUDA tensor among its outputs or arguments."""
    leaves = (out,) if isinstance(out, torch.Tensor) else torch.utils._pytree.tree_leaves(out)
    return any(fc._is_fake_cuda(t) for t in leaves) or any(fc._is_fake_cuda(t) for t in torch.utils._pytree.tree_leaves(args))


def _op_name(node) -> str:
    """The aten op being recorded (fc.CURRENT_OP), with the autograd node in backward
    (``ConvolutionBackward0/convolution_backward``): what a snapshot's frames and the timeline's
    peak name."""
    op = fc.CURRENT_OP[0]
    if node is None:
        return op
    return f"{node.name()}/{op}" if op else node.name()


def _module_hooks(tracer: Tracer, model: nn.Module):
    names = {m: n for n, m in model.named_modules()}

    def pre(mod, _inp):
        tracer.s.module_stack.append(names.get(mod, type(mod).__name__) or type(mod).__name__)

    def post(mod, _inp, _out):
        if tracer.s.module_stack:
            tracer.s.module_stack.pop()

    # always_call: the post hook runs where the forward raised too, as activation checkpointing's
    # recompute does to stop early (torch.utils.checkpoint's _StopRecomputationError): without it
    # the recomputed modules stayed on the stack and named every later event of the run
    return [m.register_forward_pre_hook(pre) for m in model.modules()] + \
           [m.register_forward_hook(post, always_call=True) for m in model.modules()]


# torch's fused CUDA optimizers whose kernels (_fused_sgd_, _fused_adam_, _fused_adamw_) have
# fake-tensor implementations; fused Adagrad's has none and would run on a real device.
_FUSED_TRACEABLE = ("SGD", "Adam", "AdamW")


def make_optimizer(spec: WorkloadSpec, params):
    impl = {"auto": {"foreach": True}, "foreach": {"foreach": True}, "fused": {"fused": True},
            "for-loop": {"foreach": False}}[spec.optimizer_impl]
    # "auto": on CUDA tensors PyTorch's _default_to_fused_or_foreach picks foreach (fused stays
    # opt-in); fake tensors would defeat that check, so the choice is made explicitly here.
    wd = {} if spec.weight_decay is None else {"weight_decay": spec.weight_decay}
    cls_name, kwargs, _ = OPTIMIZER_TABLE[spec.optimizer]
    if ":" in cls_name:
        return _library_optimizer(spec, cls_name)(params, **kwargs, **wd)
    if spec.optimizer_impl == "fused" and cls_name not in _FUSED_TRACEABLE:
        raise WorkloadError(f"--optimizer-impl fused is traced for SGD, Adam and AdamW, not {cls_name} (torch has "
                            "no fused kernel for it on CUDA, or none that runs on fake tensors)",
                            "use --optimizer-impl foreach (the default) or for-loop")
    return getattr(torch.optim, cls_name)(params, **kwargs, **impl, **wd)


def _library_optimizer(spec: WorkloadSpec, path: str):
    """An optimizer class from another library ("module:Class"): it runs its own kernels, so
    --optimizer-impl does not apply."""
    module, cls_name = path.split(":")
    package = module.split(".")[0]
    if spec.optimizer_impl != "auto":
        raise WorkloadError(f"--optimizer {spec.optimizer} runs {module}'s own kernels: --optimizer-impl "
                            f"{spec.optimizer_impl} does not apply", "leave --optimizer-impl at auto")
    try:
        return getattr(importlib.import_module(module), cls_name)
    except ImportError as e:
        raise WorkloadError(f"--optimizer {spec.optimizer} needs {package}, which is not installed here ({e})",
                            f"pip install {package} (as the job's environment has it)") from None


def _model_computes_loss(spec: WorkloadSpec, built: BuiltModel) -> bool:
    """The model's own loss (``--loss model``; an HF model's by default) rather than one the job
    computes on its output (``--loss cross-entropy`` / ``mse``: an HF model then gets no labels)."""
    return spec.loss == "model" or (built.family == "hf" and spec.loss == "auto")


def _make_batch(built: BuiltModel, spec: WorkloadSpec, float_dtype: torch.dtype, dev: torch.device):
    """A batch as the data loader would put it on the GPU; returns (forward kwargs or args, target)."""
    b = spec.batch_size
    inp = built.input
    if built.family == "hf":
        if built.hf_main_input == "input_ids":
            ids = torch.zeros((b, inp.shape[0]), dtype=torch.long, device=dev)   # valid token ids on a real GPU
            kwargs = {"input_ids": ids}
        else:
            kwargs = {built.hf_main_input: torch.empty((b,) + inp.shape, dtype=float_dtype, device=dev)}
        if not _model_computes_loss(spec, built):
            return kwargs, None   # the job computes its own loss on the scores: no labels to the model
        if built.hf_labels == "tokens":
            kwargs["labels"] = torch.zeros((b, inp.shape[0]), dtype=torch.long, device=dev)
        elif built.hf_labels == "class":
            kwargs["labels"] = torch.zeros((b,), dtype=torch.long, device=dev)
        elif built.hf_labels == "decoder":
            dec = int(spec.model_kwargs.get("decoder_seq", 448 if built.hf_main_input == "input_features" else 128))
            kwargs["labels"] = torch.zeros((b, dec), dtype=torch.long, device=dev)
        return kwargs, None
    if inp.kind == "tokens":
        # token sequences are integer ids whatever built the model (an embedding takes Long/Int
        # indices); zeros are below any vocabulary's size, on a real GPU as on fake CUDA
        return torch.zeros((b,) + inp.shape, dtype=torch.long, device=dev), "tokens"
    fmt = torch.channels_last if (spec.channels_last and len(inp.shape) == 3) else torch.contiguous_format
    x = torch.empty((b,) + inp.shape, dtype=float_dtype, device=dev, memory_format=fmt)
    return x, "target"


def _loss(spec: WorkloadSpec, built: BuiltModel, out, target_kind, device: torch.device):
    if _model_computes_loss(spec, built):
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, Mapping):   # {"loss": ...}
            loss = out.get("loss")
        if loss is None and isinstance(out, (tuple, list)) and out:   # (loss, logits, ...)
            out = out[0]
        if loss is None and isinstance(out, torch.Tensor) and out.numel() == 1:   # the loss itself
            loss = out
        if loss is None:
            raise EstimateError(f"{spec.model} returned no loss (--loss model takes an output's .loss or ['loss'], a "
                                "one-element tensor, or one first in a tuple)",
                                "use --loss cross-entropy (on the model's output scores) or a model class with a head "
                                "that computes a loss (e.g. ...ForMaskedLM)")
        return loss
    if built.family == "hf":   # a loss of the job's own on the model's scores
        out = getattr(out, "logits", None)
        if not isinstance(out, torch.Tensor):
            raise EstimateError(f"{spec.model} returned no logits", "use --loss model")
    if isinstance(out, Mapping):   # torchvision segmentation: {"out": ..., "aux": ...}
        out = tuple(out.values())
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    if not outs:
        raise EstimateError(f"{spec.model} returned no tensor", "make the model's forward return its output tensor")
    mode = spec.loss
    if target_kind == "tokens" and mode in ("auto", "cross-entropy") and outs[0].dim() >= 2 \
            and outs[0].is_floating_point():
        # a language model's scores [batch, seq, vocab]: next-token cross-entropy over the last dim
        o = outs[0]
        flat = o.reshape(-1, o.shape[-1])
        return nn.functional.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=device))
    if mode == "auto":
        mode = "cross-entropy" if (outs[0].dim() == 2 and outs[0].is_floating_point()) else "mse"
    total = None
    for i, o in enumerate(outs):
        if mode == "cross-entropy":
            if o.dim() < 2:
                raise EstimateError(f"cross-entropy needs class scores [batch, classes], the model gave {tuple(o.shape)}", "use --loss mse")
            target = torch.zeros((o.shape[0],) + tuple(o.shape[2:]), dtype=torch.long, device=device)
            part = nn.functional.cross_entropy(o, target)
        else:
            target = torch.zeros(o.shape, dtype=o.dtype, device=device)
            part = nn.functional.mse_loss(o, target)
        part = part if i == 0 else part * 0.4   # auxiliary heads (inception, googlenet, segmentation aux), as in the reference recipes
        total = part if total is None else total + part
    return total


class LoopHooks:
    """What the tracer wants to know about the loop; the GPU measurement passes the no-op default."""

    def phase(self, name: str) -> None:
        pass

    def category(self, name: str | None) -> None:
        pass

    def iteration(self, i: int) -> None:
        pass

    def step_end(self) -> None:
        pass

    def mark(self, tensors, category: str, unset_only: bool = False) -> None:
        pass


class _TracerHooks(LoopHooks):
    def __init__(self, tracer: Tracer, mode: "fc.FakeCudaMode"):
        self.t = tracer
        self.mode = mode
        self._stand_in = mode.scalar_stand_in

    def phase(self, name):
        self.t.s.phase = name
        # Optimizers read values only as learning-rate factors and constants (Adafactor's parameter
        # RMS and ASGD's step count through .item(), bitsandbytes' quantization map through
        # .tolist()): every state and temporary has its parameter's shape whatever the value, so
        # stand-in values trace the same allocations. Outside the optimizer (its construction and
        # its steps) a value read from the device stays data-dependent.
        self.mode.scalar_stand_in = self._stand_in or name == "optimizer"

    def category(self, name):
        self.t.s.category = name

    def iteration(self, i):
        self.t.s.iteration = i

    def step_end(self):
        self.t.step_end()

    def mark(self, tensors, category):
        self.t.mark(tensors, category)


def run_training_loop(model: nn.Module, built: BuiltModel, spec: WorkloadSpec, device: torch.device,
                      hooks: LoopHooks = LoopHooks()) -> torch.optim.Optimizer:
    """The training loop of the module docstring, on ``device`` (fake or real CUDA, or the CPU).
    Returns the optimizer: its state lives as long as the caller keeps it."""
    weight_dtype = _DTYPES[spec.weight_dtype]
    amp = _DTYPES.get(spec.amp_dtype) if spec.amp_dtype else None
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    hooks.phase("optimizer")   # a constructor may read values too (bitsandbytes' quantization maps)
    opt = make_optimizer(spec, params)
    hooks.phase("setup")
    scale = None
    if spec.precision == "amp-fp16":
        hooks.category("other")
        scale = torch.full((), 65536.0, dtype=torch.float32, device=device)
        hooks.category(None)
    keep = None
    batch = None
    if spec.pre_forward != "none":
        hooks.phase("forward")
        hooks.category("input")
        batch, _ = _make_batch(built, spec, weight_dtype, device)
        hooks.category(None)
        with (torch.no_grad() if spec.pre_forward == "no-grad" else _null()):
            out = model(**batch) if isinstance(batch, dict) else model(batch)
        del out   # its graph (and the activations it saved) go with it
    for it in range(spec.steps):
        hooks.iteration(it)
        for micro in range(spec.grad_accum):
            hooks.phase("setup")
            batch = None   # the loader's next batch replaces the previous one
            hooks.category("input")
            batch, target_kind = _make_batch(built, spec, weight_dtype, device)
            hooks.category(None)
            hooks.phase("forward")
            ctx = torch.autocast(device.type, dtype=amp) if amp is not None else _null()
            with ctx:
                out = model(**batch) if isinstance(batch, dict) else model(batch)
                loss = _loss(spec, built, out, target_kind, device)
                if spec.grad_accum > 1:
                    loss = loss / spec.grad_accum
            keep = None   # the previous iteration's outputs are dropped when rebound
            if spec.zero_grad == "before-backward" and micro == 0:
                hooks.phase("zero_grad")
                opt.zero_grad(set_to_none=True)   # the previous step's gradients lived through the forward
            hooks.phase("backward")
            (loss * scale if scale is not None else loss).backward()
            hooks.phase("other")
            keep = (out, loss)
            del out, loss
        hooks.mark([p.grad for p in params if p.grad is not None], "gradient")
        hooks.phase("optimizer")
        if scale is not None:
            grads = [p.grad for p in params if p.grad is not None]
            inv = scale.double().reciprocal().float()
            torch._foreach_mul_(grads, inv)   # GradScaler.unscale_ (in place)
            del inv, grads
        opt.step()
        hooks.mark([v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)],
                   "optimizer_state")
        if spec.zero_grad == "after-step":
            hooks.phase("zero_grad")
            opt.zero_grad(set_to_none=True)
        hooks.step_end()
    hooks.phase("other")
    del keep, batch
    return opt


def build_real_model(spec: WorkloadSpec, device: str):
    """The workload's model built on ``device`` (for measuring on a GPU), as its constructor makes
    it: parameters and buffers alike (BERT's position ids, rotary frequencies, batch-norm
    statistics), which a meta-built model moved with ``to_empty`` would hold as garbage."""
    built = build_model(spec, device=device)
    model = built.module
    if spec.weight_dtype != "float32":
        model = model.to(_DTYPES[spec.weight_dtype])
    if spec.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, built


@contextlib.contextmanager
def cudnn_flags(spec: WorkloadSpec):
    """The job's torch.backends.cudnn settings while its loop runs (traced or on a real GPU), and
    the caller's afterwards. Both are read at each convolution: allow_tf32 decides which engines
    fp32 convolutions may use, benchmark whether each new shape is timed first."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark
    torch.backends.cudnn.allow_tf32 = spec.cudnn_tf32 == "on"
    torch.backends.cudnn.benchmark = spec.cudnn_benchmark == "on"
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = before


@contextlib.contextmanager
def _transformers_quiet(spec: WorkloadSpec):
    """transformers' warnings while the estimator builds and steps a model from a config (an unset
    ``loss_type``, ``use_cache`` turned off for checkpointing) are about the estimator's own calls,
    not the user's job: only its errors show meanwhile (through transformers' own verbosity, which
    it resets when it first configures its logger). A script run by dynamic analysis keeps its
    own output."""
    if not spec.model.startswith("hf:") and "transformers" not in sys.modules:
        yield
        return
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def trace_training(spec: WorkloadSpec, capability: tuple[int, int] = (8, 0), total_memory_bytes: int = 80 * 2**30,
                   prepare=None, marks=None) -> AllocTrace:
    """Trace ``spec.steps`` training iterations. Raises EstimateError with the cause on failure.
    ``prepare(built)``: the built model changed before it is traced (step_scaling.py cuts its stack
    of blocks); ``marks(tracer, model)``: hooks that record where things happen, which allocate
    nothing (their ``remove()`` is called after the run)."""
    with _transformers_quiet(spec):
        return _trace_training(spec, capability, total_memory_bytes, prepare, marks)


def _trace_training(spec: WorkloadSpec, capability: tuple[int, int], total_memory_bytes: int,
                    prepare=None, marks=None) -> AllocTrace:
    t0 = time.perf_counter()
    tracer = Tracer(capability)
    mode = fc.FakeCudaMode(tracer.recorder)
    try:
        # the model is built seeing the GPU it is traced on, as in the job: a layer that picks its
        # kernels at construction (torch.cuda.is_available(), the capability: flash-attention
        # configurations) takes its GPU path, and what it asked counts for the trace (holds_on)
        with fc.cuda_answers(total_memory_bytes=total_memory_bytes, capability=capability, scalar_draws_at_the_top=True):
            built = build_model(spec)
            if prepare is not None:
                built = prepare(built)
            model = built.module
            oneshot.settle()   # the model's libraries (torchvision, transformers) imported: out of the collector's scans
            with cudnn_flags(spec), tracer, mode, fc.CudaFactoryMode():
                asked = _traced_steps(tracer, mode, model, built, spec, marks)
    except EstimateError:
        raise
    except fc.DataDependentOutputException as e:
        raise EstimateError(f"{spec.model}: the model's shapes depend on the data ({e})",
                            "the estimator cannot trace data-dependent control flow; describe a model without it or use the dynamic mode",
                            kind="data-dependent", where=_model_frame(e, spec)) from None
    except fc.DynamicOutputShapeException as e:
        raise EstimateError(f"{spec.model}: an output's size depends on the data ({e}: a boolean mask, nonzero, unique)",
                            "the estimator cannot size it without data; turn off the feature that selects by value "
                            "(e.g. SpecAugment's mask_time_prob=0) or estimate a model without it",
                            kind="data-dependent", where=_model_frame(e, spec)) from None
    except fc.UnsupportedOperatorException as e:
        raise EstimateError(f"{spec.model}: operator {e.func} cannot run on fake tensors",
                            "report it; meanwhile estimate a similar model without that operator",
                            kind="vest-unsupported", where=_model_frame(e, spec)) from None
    except (KeyboardInterrupt, SystemExit):
        raise
    except (RuntimeError, ValueError, TypeError, AttributeError, IndexError, NotImplementedError, AssertionError) as e:
        if __import__("os").environ.get("VEST_DEBUG"):
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise EstimateError(f"tracing {spec.model} failed: {type(e).__name__}: {msg}",
                            "check that --input matches the model (shape, channels, sequence length) and --loss fits its output",
                            kind="script-error", where=_model_frame(e, spec)) from None
    notes = (f"traced in {time.perf_counter() - t0:.2f} s",)
    return tracer.finish(spec.steps, notes, asked)


def _model_frame(e: BaseException, spec: WorkloadSpec) -> str | None:
    """file:line of the innermost frame in the user's model file (``--model FILE.py:FACTORY``)."""
    import os
    import traceback

    if ".py:" not in spec.model:
        return None
    path = os.path.realpath(spec.model.rsplit(":", 1)[0])
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.realpath(f.filename) == path]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def _traced_steps(tracer: Tracer, mode, model, built, spec: WorkloadSpec, marks=None):
    """The parameters materialised and the training loop run, under the trace: what the run
    asked of the GPU."""
    tracer.s.category = "parameter"
    fc.materialize(model, _DTYPES[spec.weight_dtype], spec.channels_last)
    tracer.s.category = None
    module_hooks = _module_hooks(tracer, model)
    if marks is not None:
        module_hooks.append(marks(tracer, model))
    try:
        opt = run_training_loop(model, built, spec, fc.DEVICE, _TracerHooks(tracer, mode))
        tracer.freeze()   # the run is over: what is released from here on is not part of it
        asked = fc.gpu_asked()   # what it asked of the GPU (trace.holds_on)
        del opt
    finally:
        for h in module_hooks:
            h.remove()
    return asked


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
