"""Stand-ins that let an unmodified training script run on fake CUDA (dynamic analysis only).

Each patch says what a real GPU run would do and what the stand-in does instead; all are undone
when ``patched()`` exits. Private torch APIs stay in _fakecuda.py; this module patches public ones.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from ..estimate import _fakecuda as fc
from . import cuda_surface
from .grad_scaler import FakeCudaGradScaler, FakeGradScaler


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
    first_forward_done: bool = False
    saved: list = field(default_factory=list)
    optimizers: weakref.WeakSet = field(default_factory=weakref.WeakSet)   # every optimizer the script made

    def finish(self) -> None:
        self.tracer.s.phase = "other"


# ---- modules: .cuda() / .to() / .half() on fake parameters -----------------------------------------

def _apply_overwrite(state: ScriptState):
    """Module._apply that puts the converted tensor in place of the old one (torch's
    overwrite_module_params_on_conversion behaviour). torch 2.14 swaps FakeTensor parameters in
    place instead, which fake tensors refuse. Tied parameters stay tied (one memo per call).

    A new Parameter object is not the one an optimizer built before the move holds (accelerate's
    ``prepare(model, optimizer)`` does exactly that; on a GPU ``.to()`` keeps the objects), so the
    optimizers made so far are pointed at the new ones when the top-level call ends."""
    memo_stack: list[dict] = []
    moved: list[tuple] = []

    def _apply(self, fn, recurse=True):
        top = not memo_stack
        if top:
            memo_stack.append({})
            moved.clear()
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
                with torch.no_grad():
                    applied = fn(p)
                if applied is p:
                    memo[id(p)] = p
                    continue
                new = nn.Parameter(applied, requires_grad=p.requires_grad)
                if p.grad is not None:
                    with torch.no_grad():
                        new.grad = fn(p.grad)
                memo[id(p)] = new
                moved.append((p, new))
                self._parameters[key] = new
            for key, b in list(self._buffers.items()):
                if b is not None:
                    if id(b) not in memo:
                        memo[id(b)] = fn(b)
                    self._buffers[key] = memo[id(b)]
            if top and moved:
                _repoint_optimizers(state.optimizers, {id(old): new for old, new in moved})
            return self
        finally:
            if top:
                memo_stack.clear()
                moved.clear()

    return _apply


def _repoint_optimizers(optimizers, new_of: dict) -> None:
    """Replace moved parameters in the optimizers' groups and state (keyed by parameter)."""
    for opt in list(optimizers):
        for group in opt.param_groups:
            group["params"] = [new_of.get(id(p), p) for p in group["params"]]
        for old_key in [k for k in opt.state if id(k) in new_of]:
            opt.state[new_of[id(old_key)]] = opt.state.pop(old_key)


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

# ---- DistributedDataParallel -----------------------------------------------------------------------

class FakeDDP(nn.Module):
    """DistributedDataParallel without communication: the wrapped module runs as is, and DDP's
    gradient buckets (one flat copy of the gradients, gradient_as_bucket_view=False) are allocated
    on the device as the real Reducer does at construction."""

    tracer = None   # set by patched(): the buckets are tagged for the estimator

    def __init__(self, module, device_ids=None, output_device=None, *args, gradient_as_bucket_view=False, **kwargs):
        super().__init__()
        self.module = module
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        if not gradient_as_bucket_view and nbytes:
            s = FakeDDP.tracer.s
            s.category, s.module_stack = "gradient", s.module_stack + ["ddp_buckets"]
            try:
                self._vest_buckets = torch.empty(nbytes, dtype=torch.uint8, device=fc.DEVICE)
            finally:
                s.category, s.module_stack = None, s.module_stack[:-1]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        yield


def _init_process_group(state: ScriptState):
    """init_process_group("nccl", ...) becomes rank 0 of a fake process group of the launch's world
    size: collectives return at once, no other rank is needed."""
    import torch.distributed as dist

    original = dist.init_process_group

    def init(backend=None, *args, **kwargs):
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            return
        original("fake", store=FakeStore(), rank=0, world_size=state.world_size)

    return init


# ---- scalars and host copies ---------------------------------------------------------------------------

def _stand_in_scalar(t):
    if t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        return 1.0
    return 1


def _item(orig):
    def item(self):
        if isinstance(self, fc.FakeTensor):
            return _stand_in_scalar(self)
        return orig(self)

    return item


def _tolist(orig):
    def tolist(self):
        if isinstance(self, fc.FakeTensor):
            v = _stand_in_scalar(self)
            out = v
            for d in reversed(self.shape):
                out = [out] * d if not isinstance(out, list) else [list(out) for _ in range(d)]
            return out
        return orig(self)

    return tolist


def _numpy(orig):
    def numpy(self, *a, **k):
        if isinstance(self, fc.FakeTensor):
            import numpy as np

            return np.zeros(tuple(self.shape), dtype=_np_dtype(self.dtype))
        return orig(self, *a, **k)

    return numpy


def _np_dtype(dtype):
    import numpy as np

    return {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
            torch.int64: np.int64, torch.int32: np.int32, torch.uint8: np.uint8, torch.bool: np.bool_}.get(dtype, np.float32)


# ---- checkpoints and compile -------------------------------------------------------------------------

def _save(state: ScriptState):
    def save(obj, f, *args, **kwargs):
        # Fake tensors have no data to serialize: write a marker into the temp dir instead.
        name = os.path.basename(f) if isinstance(f, (str, os.PathLike)) else "checkpoint"
        path = os.path.join(state.tmpdir, "checkpoints", os.fsdecode(name) or "checkpoint")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write("vest-slurm dynamic analysis: checkpoint not written (fake tensors)\n")
        state.saved.append(path)

    return save


def _compile(model=None, *args, **kwargs):
    """torch.compile runs eagerly here: the compiled graph's memory is close to eager's (at most
    lower), so the estimate stays on the safe side."""
    if model is None:
        return lambda m: m
    return model


# ---- phases and the stop -----------------------------------------------------------------------------

@contextlib.contextmanager
def patched(state: ScriptState):
    tr = state.tracer
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def pre_forward(mod, args):
        if state.depth == 0:
            tr.s.phase = "forward"
        if not state.first_forward_done and state.depth < state.batch_hint_depth:
            # the batch: the first dimension of the first tensor given to the model; a model called
            # with keyword arguments only (which global hooks do not see: transformers, peft
            # wrappers) shows its input to the shallowest submodule that takes one positionally
            # (the token embedding). Read in the first forward only.
            first = next((a for a in (args or ()) if isinstance(a, torch.Tensor) and a.dim() > 0), None)
            if first is not None:
                state.batch_hint, state.batch_hint_depth = int(first.shape[0]), state.depth
        state.depth += 1

    def post_forward(mod, args, out):
        state.depth = max(0, state.depth - 1)
        if state.depth == 0:
            tr.s.phase = "other"
            state.first_forward_done = True

    def pre_step(opt, args, kwargs):
        tr.mark([p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None], "gradient")
        tr.s.phase = "optimizer"

    def post_step(opt, args, kwargs):
        tr.mark([v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)], "optimizer_state")
        tr.s.phase = "other"
        state.steps += 1
        tr.s.iteration = state.steps
        tr.step_end()
        if state.steps >= state.max_steps:
            tr.freeze()   # what the script frees while it unwinds is not part of the run
            raise state.stop()

    orig_backward = torch.autograd.backward

    def backward(*a, **k):
        tr.s.phase = "backward"
        try:
            return orig_backward(*a, **k)
        finally:
            tr.s.phase = "other"

    orig_zero_grad = torch.optim.Optimizer.zero_grad

    def zero_grad(self, set_to_none=True):
        tr.s.phase = "zero_grad"
        try:
            return orig_zero_grad(self, set_to_none)
        finally:
            tr.s.phase = "other"

    orig_opt_init = torch.optim.Optimizer.__init__

    def opt_init(self, *a, **k):
        orig_opt_init(self, *a, **k)
        state.optimizers.add(self)

    orig_dl_init = torch.utils.data.DataLoader.__init__

    def dl_init(self, *a, **k):
        # Workers would fork copies of the process; one process reads only the batches used.
        k["num_workers"] = 0
        k.pop("prefetch_factor", None)
        k["persistent_workers"] = False
        k["pin_memory"] = False
        return orig_dl_init(self, *a, **k)

    import torch.distributed as dist
    import torch.nn.parallel as par

    patches = [
        (nn.Module, "_apply", _apply_overwrite(state)),
        (nn.Module, "cuda", _as_parameters(state, nn.Module.cuda, lambda *a, **k: True)),
        (nn.Module, "to", _as_parameters(state, nn.Module.to, _to_cuda)),
        (torch.autograd, "backward", backward),
        (torch.optim.Optimizer, "zero_grad", zero_grad),
        (torch.optim.Optimizer, "__init__", opt_init),
        (torch.utils.data.DataLoader, "__init__", dl_init),
        (torch.Tensor, "item", _item(torch.Tensor.item)),
        (torch.Tensor, "tolist", _tolist(torch.Tensor.tolist)),
        (torch.Tensor, "numpy", _numpy(torch.Tensor.numpy)),
        (torch.amp, "GradScaler", FakeGradScaler),
        (torch.cuda.amp, "GradScaler", FakeCudaGradScaler),
        (torch, "compile", _compile),
        (torch, "save", _save(state)),
        # torch.cuda's lazy init would look for a driver; every public CUDA API is decided in cuda_surface
        (torch.cuda, "_lazy_init", lambda: None),
        (dist, "init_process_group", _init_process_group(state)),
        (par, "DistributedDataParallel", FakeDDP),
        (nn.parallel, "DistributedDataParallel", FakeDDP),
    ]
    patches += cuda_surface.patches(cuda_surface.Answers(lambda: tr.s.live_bytes, lambda: tr.s.peak_bytes))
    patches += fc.gpu_optimizer_defaults()
    from . import fake_dist   # fully_shard / init_device_mesh stand-ins (FSDP2 scripts)

    patches += fake_dist.patches(state)
    saved = [(obj, attr, getattr(obj, attr, None)) for obj, attr, _ in patches]
    hooks = [
        nn.modules.module.register_module_forward_pre_hook(pre_forward),
        nn.modules.module.register_module_forward_hook(post_forward),
        register_optimizer_step_pre_hook(pre_step),
        register_optimizer_step_post_hook(post_step),
    ]
    import torch.nn.parallel.distributed as ddp_mod

    patches.append((ddp_mod, "DistributedDataParallel", FakeDDP))
    saved.append((ddp_mod, "DistributedDataParallel", ddp_mod.DistributedDataParallel))
    FakeDDP.tracer = tr
    try:
        for obj, attr, new in patches:
            setattr(obj, attr, new)
        yield state
    finally:
        for h in hooks:
            h.remove()
        for obj, attr, old in saved:
            if old is not None:
                setattr(obj, attr, old)
