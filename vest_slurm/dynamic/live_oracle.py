"""The second oracle of the script corpus: the same training script run for real on the CPU, with
the bytes of the tensors that would have lived on the GPU counted.

    python -m vest_slurm.dynamic.live_oracle --out RESULT.json --steps 3 -- script.py ARGS
    python -m vest_slurm.dynamic.live_oracle --out RESULT.json --steps 3 --module pkg.train -- ARGS
    python -m vest_slurm.dynamic.live_oracle --out RESULT.json --steps 3 -- -m pkg.train ARGS

In: a training command (as the estimate's child gets it: a script or a module, its argv), run in the
current directory. Out: RESULT.json with ``status`` ("ok", or why not), ``live_peak_bytes`` (the peak
of the sum of the sizes of the live device storages, from the script's start to the end of its N-th
training step), ``steps`` and ``stopped_by``. It is a developer's yardstick (scripts/bench_scripts.py
compares it with ``vest estimate``'s live-tensor peak of the same command), not part of an estimate:
it runs the script's real arithmetic, so it is only for reduced sizes (a small batch, few steps).

How: the script's CUDA is mapped to the CPU. A function mode (_ToCpu) turns every ``device=cuda``
argument, ``.cuda()`` and ``.to("cuda")`` into CPU work, and marks what they make as *device*
storage; a dispatch mode (_Census) marks the outputs of every op that has a device input (the
forward, the backward the autograd engine runs, the optimizer's update), so host tensors (data
loading, index sampling, metrics) are never counted and ``.cpu()`` / ``.to("cpu")`` gives an
unmarked copy, as a GPU run's device-to-host copy would. A storage is counted once (views share it)
from the op that made it to its free (a weakref finalizer), its ``nbytes``: what the estimate's
live-tensor peak (AllocTrace.live_peak_bytes) counts, before the caching allocator's rounding.
Marked tensors report ``device`` cuda:0 and ``is_cuda`` (so ``x.to(param.device)`` and torch's own
foreach choice in torch.optim see a GPU); the GPU's identity and queries are answered by the same
stand-ins as the estimate's (cuda_surface, _fakecuda.cuda_answers). The run stops as the
estimate's does: after N optimizer steps (and every optimizer's first, standins.WAIT_FOR_OPTIMIZERS),
or, without torch.optim, at the start of the (N+1)-th backward pass (N hand-written updates done);
not on to the epoch's end (the estimate's ``live_tensor_peak_steps`` is what compares). DataLoader workers are 0 and ``torch.compile`` runs
eagerly, as in the estimate, so both run the same program.

Known limitations (where this count and a GPU's differ, and the estimate models the GPU):
- Kernels are the CPU's: an op whose CUDA kernel saves or returns other tensors than its CPU kernel
  differs (cuDNN's batch-norm reserve space, fused attention's logsumexp and RNG state), but for
  dropout, attention with dropout and rms_norm, run as CUDA runs them (_gpu_kernels). cuDNN's RNNs: the weights are
  flattened into one buffer as cuDNN's are (_fakecuda.cudnn_rnn_flatten_weight), but the CPU's LSTM /
  GRU saves its gates per time step for backward where cuDNN keeps a reserve space of its own size
  (cudnnGetRNNTempSpaceSizes, asked of a GPU), so an RNN's activations are the CPU's, not cuDNN's. Workspaces
  (cuBLAS, cuDNN) and kernel scratch are not tensors, here as in the estimate's live peak.
- While a dispatch mode is active, a few backward formulas (index, gather, max/min/sort/topk
  selections: FunctionsManual.cpp) fill their zeros out of place, as for tensor subclasses
  (isTensorSubclassLike), so this count can be above a GPU's by one transient gradient there. For
  the same reason, the gradient contributions of a weight used several times in one graph (an RNN
  cell looped in Python, tied weights, a policy run at every step of an episode) are summed out of
  place (AccumulateGrad's in-place add is for plain tensors), one extra gradient-sized tensor here.
- Legacy typed constructors of data (``torch.cuda.FloatTensor(ndarray)``, PyTorch-GAN's scripts)
  are not mapped; the estimate runs them.
- scaled_dot_product_attention runs the CPU's kernels (dropout dropped, see _gpu_kernels): what they save
  for backward (output, logsumexp) is close to, not equal to, CUDA's flash / memory-efficient kernels
  (which pad the logsumexp and add a philox seed); a mask or head size the CPU's fused kernel does
  not take falls back to the math path, which saves the L x L attention. Their output takes the
  query's layout, where CUDA's memory-efficient kernel (fp32 on sm80+) lays its output out as
  (batch, seq, heads, dim) and returns it transposed: a (batch, heads, seq, dim)-contiguous query
  whose output is transposed back and reshaped (Keras 3 on torch, any ``.contiguous()`` before
  attention) is copied here and not on the GPU, one attention output per layer above the GPU's.
- Half-precision GEMMs and convolutions (forward and backward) are computed in float32 and rounded
  to their half dtype (_half_in_fp32), as cuBLAS and cuDNN accumulate them: the CPU's own half
  kernels are scalar fallbacks without AVX512-BF16/FP16 or AMX, too slow for a GPT's three steps.
  The outputs, and so the count, are those of the half kernels.
- autocast("cuda") runs as autocast("cpu") at the same dtype, with CUDA's op lists and policies on
  the CPU's autocast key (cuda_autocast.py, read from the installed torch's autocast_mode.h; where
  torch ships no headers, the CPU's own lists, which differ: layer_norm, softmax, the losses).
- A torch function mode is off inside the torch function it handles: a ``device=cuda`` factory call
  inside torch's own Python functions (not the script's) makes an unmarked tensor (what follows from
  it with a device input is marked).
- Triton kernels (TRL's fused LM head) are not run: Triton has no CPU backend, and its interpreter
  (TRITON_INTERPRET=1) took over 170 s for one step of TRL's head at GPT-2 size without finishing
  it. A launch allocates nothing through PyTorch (a kernel writes into the buffers torch allocated
  before it), so the count is the same; the buffers keep the values they held, which steer no
  shape of the scripts in the corpus (the loss is not the real one).
- One node: torchrun of N processes runs N (run_command; a gloo group of N over a file store, rank
  0's count is the result); a launch over several nodes, a process group the script makes itself
  and nn.DataParallel over more than one GPU are refused (status "unsupported").
  ``torch.set_default_device("cuda")`` is not mapped (every factory call of the process, torch's
  own inside the functions this mode does not see, would name the GPU); ``with torch.device("cuda"):``
  is.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import runpy
import sys
import traceback
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from .cuda_autocast import CudaAutocast


class StopRun(BaseException):
    """Raised after the N-th training step (a BaseException: the script's ``except Exception`` keeps going)."""


class Unsupported(RuntimeError):
    """The script needs what this oracle cannot run in one CPU process."""


_ABSENT = object()
_CUDA = torch.device("cuda", 0)
_CPU = torch.device("cpu")


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):     # torch.empty(3, device=0), t.to(0): CUDA device 0
        return True
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


def _storages(t: torch.Tensor) -> tuple:
    """The storages that hold a tensor's data: its own (strided), or its index and value tensors'
    (sparse layouts, which have no storage of their own; on the GPU those are its allocations), or
    those of the tensor a torch.func transform's wrapper wraps."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):   # vmap's BatchedTensor, grad's wrapper: no storage
        t = functorch.get_unwrapped(t)                # of their own; the tensor they wrap holds the data
    layout = t.layout
    if layout == torch.strided:
        return (t.untyped_storage(),)
    if layout == torch.sparse_coo:
        parts = (t._indices(), t._values())
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (t.crow_indices(), t.col_indices(), t.values())
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (t.ccol_indices(), t.row_indices(), t.values())
    else:
        return ()
    return tuple(p.untyped_storage() for p in parts)


class Census:
    """The device storages alive now and the peak of their sum. ``propagate`` is off while a
    device-to-host copy is made; ``factory`` > 0 while a call that makes device tensors runs."""

    def __init__(self):
        self.live: dict[int, int] = {}   # id(storage) -> nbytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self.factory = 0
        self.propagate = True
        self.frozen = False
        self.device_rng = torch.Generator().get_state()   # the GPU's generator (_on_the_device_generator)
        self.in_kernel = 0   # > 0 while an op's kernel runs (_Census): its tensors are the CPU's there

    def is_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and any(id(s) in self.live for s in _storages(t))

    def shown_as_device(self, t) -> bool:
        """Whether the script sees ``t`` on the GPU (Tensor.device, is_cuda, get_device): a device
        tensor, but inside an op's kernel, which runs on the CPU here (a library's Python kernel
        of a custom op: bitsandbytes' quantize_4bit makes its code table with ``device=A.device``,
        a cuda no mode would map there)."""
        return not self.in_kernel and self.is_device(t)

    def mark(self, t) -> None:
        if not isinstance(t, torch.Tensor) or self.frozen or t.device.type != "cpu":
            return
        for s in _storages(t):
            self.mark_storage(s)

    def mark_storage(self, s) -> None:
        key = id(s)
        if key in self.live or self.frozen:
            return
        n = s.nbytes()
        self.live[key] = n
        weakref.finalize(s, self._freed, key)
        self.live_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def mark_all(self, out) -> None:
        for t in tree_flatten(out)[0]:
            self.mark(t)

    def _freed(self, key: int) -> None:
        n = self.live.pop(key, 0)
        if not self.frozen:
            self.live_bytes -= n


_HALF = (torch.float16, torch.bfloat16)
_aten = torch.ops.aten
# GEMMs and convolutions, forward and backward: a CPU without AVX512-BF16/FP16 or AMX runs them in
# half precision through scalar fallbacks, 15-60x slower than in float32 (a GPT of 25 M parameters
# took over 600 s for three steps under autocast)
_HALF_SLOW = frozenset((_aten.mm.default, _aten.bmm.default, _aten.addmm.default, _aten.baddbmm.default,
                        _aten.addbmm.default, _aten._addmm_activation.default, _aten.addmv.default,
                        _aten.mv.default, _aten.convolution.default, _aten.convolution_backward.default))


def _half_in_fp32(func, args, kwargs):
    """``func`` of half-precision tensors computed in float32 and rounded to the half dtype, or
    _ABSENT when its floating inputs are not all one half dtype. cuBLAS and cuDNN accumulate half
    GEMMs and convolutions in float32 and round the result, so this is the GPU's arithmetic more
    nearly than the CPU's half kernels; each output has the dtype, shape and strides the half kernel
    gives (``to`` keeps the layout), and the float32 copies are this function's own, made with the
    mode off (unmarked, never counted)."""
    flat, spec = tree_flatten((args, kwargs))
    dtypes = {t.dtype for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if len(dtypes) != 1 or (half := dtypes.pop()) not in _HALF:
        return _ABSENT
    up = [t.to(torch.float32) if isinstance(t, torch.Tensor) and t.dtype == half else t for t in flat]
    a, k = tree_unflatten(up, spec)
    out = func(*a, **k)
    return tree_map_only(torch.Tensor, lambda t: t.to(half) if t.dtype == torch.float32 else t, out)


# GEMMs with an output dtype of their own (torch >= 2.8: ``torch.addmm(acc, a, b, out_dtype=torch.float32)``,
# TRL's chunked log-prob head accumulating bf16 products in fp32) have CUDA kernels only
_OUT_DTYPE_GEMMS = {getattr(getattr(_aten, name), overload): getattr(_aten, name).default
                    for name in ("addmm", "mm", "bmm", "baddbmm") for overload in ("dtype", "dtype_out")
                    if hasattr(getattr(_aten, name), overload)}


def _out_dtype_gemm(func, args, kwargs):
    """``func`` (an _OUT_DTYPE_GEMMS overload) as the CPU can run it: the plain GEMM of its inputs in
    float32 (as the GPU's kernel accumulates), rounded to ``out_dtype``, written to ``out`` if given."""
    kwargs = dict(kwargs)
    out = kwargs.pop("out", None)
    cut = 3 if func.overloadpacket in (_aten.addmm, _aten.baddbmm) else 2
    out_dtype = args[cut] if len(args) > cut else kwargs.pop("out_dtype")
    result = _OUT_DTYPE_GEMMS[func](*(t.to(torch.float32) for t in args[:cut]), **kwargs).to(out_dtype)
    return out.copy_(result) if out is not None else result


class _Census(TorchDispatchMode):
    """Marks every op's outputs as device storage when an input is one (or a device factory runs)."""

    def __init__(self, census: Census):
        super().__init__()
        self.c = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c, kwargs = self.c, kwargs or {}
        device = c.propagate and (c.factory or any(c.is_device(t) for t in tree_flatten((args, kwargs))[0]))
        c.in_kernel += 1
        try:
            out = _half_in_fp32(func, args, kwargs) if func in _HALF_SLOW else \
                _out_dtype_gemm(func, args, kwargs) if func in _OUT_DTYPE_GEMMS else _ABSENT
            if out is _ABSENT:
                if device and torch.Tag.nondeterministic_seeded in func.tags and kwargs.get("generator") is None:
                    with _on_the_device_generator(c):
                        out = func(*args, **kwargs)
                else:
                    out = func(*args, **kwargs)
        finally:
            c.in_kernel -= 1
        if device:
            c.mark_all(out)
        return out


@contextlib.contextmanager
def _on_the_device_generator(census: Census):
    """A random op on device tensors (dropout, an initialisation on the device, randn(device=cuda))
    draws from the GPU's generator, not the host's: here from a host generator of its own (the
    census's state), so that the script's host draws after it (a sampler's shuffle, an augmentation)
    are the job's, as the estimate's are. Seeded as the GPU's is: torch.manual_seed and
    torch.cuda.manual_seed (_seeding)."""
    host = torch.default_generator.get_state()
    torch.default_generator.set_state(census.device_rng)
    try:
        yield
    finally:
        census.device_rng = torch.default_generator.get_state()
        torch.default_generator.set_state(host)


def _seeding(census: Census) -> list:
    """(object, attribute, replacement): torch.manual_seed seeds the host's and the GPU's
    generators; torch.cuda.manual_seed(_all) the GPU's (the census's, _on_the_device_generator)."""
    real = torch.manual_seed

    def device_seed(seed):
        census.device_rng = torch.Generator().manual_seed(int(seed)).get_state()

    def manual_seed(seed):
        out = real(seed)
        device_seed(seed)
        return out

    return [(torch, "manual_seed", manual_seed), (torch.random, "manual_seed", manual_seed),
            (torch.cuda, "manual_seed", device_seed), (torch.cuda, "manual_seed_all", device_seed),
            (torch.cuda.random, "manual_seed", device_seed), (torch.cuda.random, "manual_seed_all", device_seed)]


def _device_property(census: Census, real):
    def get(self):
        d = real.__get__(self)
        return _CUDA if d.type == "cpu" and census.shown_as_device(self) else d
    return property(get)


class _ToCpu(TorchFunctionMode):
    """CUDA placement mapped to the CPU: ``device=cuda`` arguments, ``.cuda()``, ``.to(cuda)``;
    ``.cpu()`` / ``.to("cpu")`` of a device tensor copies it to an unmarked host tensor."""

    def __init__(self, census: Census):
        super().__init__()
        self.c = census

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        c = self.c
        if func is torch.Tensor.cuda:
            t = args[0]
            return self._to_device(t, None, kwargs.get("memory_format", torch.preserve_format))
        if func is torch.Tensor.to:
            t = args[0]
            # _parse_to takes no copy: it is to(device, dtype, non_blocking, copy)'s 4th positional
            # argument, to(dtype | other, non_blocking, copy)'s 3rd, or copy=
            pos, kw = list(args[1:]), dict(kwargs)
            copy = kw.pop("copy", False)
            if len(pos) == 4 or (len(pos) == 3 and isinstance(pos[0], (torch.dtype, torch.Tensor))):
                copy = pos.pop()
            device, dtype, _nb, fmt = torch._C._nn._parse_to(*pos, **kw)
            fmt = fmt if fmt is not None else torch.preserve_format
            if _is_cuda(device):
                return self._to_device(t, dtype, fmt, copy=copy)
            if device is not None and device.type == "cpu" and c.is_device(t):
                return self._to_host(t, dtype, fmt)
            return func(*args, **kwargs)
        if func is torch.Tensor.cpu and c.is_device(args[0]):
            return self._to_host(args[0], None, kwargs.get("memory_format", torch.preserve_format))
        if func is torch._C._nn._parse_to:
            return func(*args, **kwargs)   # Module.to(device=cuda) reads its arguments; each tensor's .to is mapped
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
            c.factory += 1
            try:
                out = func(*args, **kwargs)
            finally:
                c.factory -= 1
            c.mark_all(out)
            return out
        return func(*args, **kwargs)

    def _to_device(self, t, dtype, fmt, copy=False):
        c = self.c
        if c.is_device(t) and not copy:
            return t if dtype is None or dtype == t.dtype else t.to(dtype=dtype, memory_format=fmt)
        with torch._C.DisableTorchFunctionSubclass():
            c.factory += 1
            try:   # a host-to-device copy is a new storage, as cudaMemcpy into a fresh block
                out = torch.Tensor.to(t, _CPU, dtype or t.dtype, copy=True, memory_format=fmt)
            finally:
                c.factory -= 1
        c.mark(out)
        return out

    def _to_host(self, t, dtype, fmt):
        c = self.c
        c.propagate = False
        try:
            return torch.Tensor.to(t, _CPU, dtype or t.dtype, copy=True, memory_format=fmt)
        finally:
            c.propagate = True


def _gpu_kernels(census: Census):
    """torch.nn.functional's dropout, scaled_dot_product_attention and rms_norm as a GPU runs them,
    for device inputs. Patched in the module (not caught in _ToCpu): torch's own callers (nn.Dropout,
    F.multi_head_attention_forward) call them inside a torch function, where a function mode is off."""
    F = torch.nn.functional
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def gpu_dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1 and not inplace and census.is_device(input) and input.numel():
            # aten/src/ATen/native/Dropout.cpp: a CUDA input takes native_dropout (a bool mask saved
            # for backward); a CPU one multiplies by a mask of its own dtype
            return torch.native_dropout(input, p, True)[0]
        return dropout(input, p, training, inplace)

    def gpu_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
        if dropout_p > 0 and census.is_device(query) and torch.is_grad_enabled():
            # CUDA's fused attention kernels draw dropout inside the kernel (a philox seed) and save
            # no mask or probabilities; the CPU's fused kernel has no dropout, so with it the CPU
            # takes the math path, which keeps both (L x L each). Without dropout the CPU's fused
            # kernel runs: it saves what a GPU's fused kernel saves (output, logsumexp).
            dropout_p = 0.0
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs)

    rms_norm = F.rms_norm
    fused = _fused_rms_norm(census)

    def gpu_rms_norm(input, normalized_shape, weight=None, eps=None):
        if not census.is_device(input) or not input.is_floating_point():
            return rms_norm(input, normalized_shape, weight, eps)
        if torch.is_autocast_enabled("cpu"):   # CUDA's autocast lists rms_norm as float32
            input, weight = (t.float() if t is not None and t.dtype in _HALF else t for t in (input, weight))
        return fused.apply(input, tuple(normalized_shape), weight, eps)

    return [(F, "dropout", gpu_dropout), (F, "scaled_dot_product_attention", gpu_sdpa),
            (F, "rms_norm", gpu_rms_norm)]


def _fused_rms_norm(census: Census):
    """rms_norm of a device tensor as CUDA runs it: ATen's composite takes ``_fused_rms_norm`` for a
    CUDA input (the output in the input's dtype and a float32 rstd of one element per row, saved
    with the input and weight for ``_fused_rms_norm_backward``, which makes the two gradients), where
    the CPU decomposes it into float32 pow, mean, rsqrt and products, each saved for backward. The
    arithmetic is the CPU's, its intermediates unmarked (a fused kernel's registers); the results
    are marked as that kernel's."""

    def quietly(fn):
        census.propagate, was = False, census.propagate
        try:
            return fn()
        finally:
            census.propagate = was

    class FusedRmsNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shape, weight, eps):
            dims = tuple(range(-len(shape), 0))

            def run():
                xf = x.float()
                rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + (torch.finfo(x.dtype).eps if eps is None else eps))
                y = xf * rstd
                return (y * weight.float() if weight is not None else y).to(x.dtype), rstd
            out, rstd = quietly(run)
            census.mark_all((out, rstd))
            ctx.save_for_backward(x, rstd, weight)
            ctx.dims = dims
            return out

        @staticmethod
        def backward(ctx, grad):
            x, rstd, weight = ctx.saved_tensors
            dims = ctx.dims

            def run():
                xhat, g = x.float() * rstd, grad.float()
                gy = g * weight.float() if weight is not None else g
                gx = (rstd * (gy - xhat * (gy * xhat).mean(dims, keepdim=True))).to(x.dtype)
                gw = None
                if weight is not None and ctx.needs_input_grad[2]:
                    gw = (g * xhat).sum(tuple(range(x.dim() - len(dims)))).to(weight.dtype)
                return gx, gw
            gx, gw = quietly(run)
            census.mark_all((gx, gw) if gw is not None else gx)
            return gx, None, gw, None

    return FusedRmsNorm


def _autocast_on_cpu():
    """autocast('cuda') as autocast('cpu') at the dtype the CUDA one would use (float16 by default)."""
    from torch.amp import autocast_mode

    real = autocast_mode.autocast.__init__

    def init(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type == "cuda":
            device_type, dtype = "cpu", dtype or torch.float16
        return real(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    # and asked about CUDA's autocast, the answer is the CPU's that stands for it (TRL's chunked
    # log-prob head takes its compute dtype from torch.get_autocast_dtype(hidden.device.type))
    enabled, dtype_of = torch.is_autocast_enabled, torch.get_autocast_dtype

    def is_enabled(device_type="cuda"):
        return enabled("cpu") if device_type == "cuda" else enabled(device_type)

    def get_dtype(device_type):
        return dtype_of("cpu") if device_type == "cuda" and enabled("cpu") else dtype_of(device_type)

    return [(autocast_mode.autocast, "__init__", init), (torch, "is_autocast_enabled", is_enabled),
            (torch, "get_autocast_dtype", get_dtype)]


def _dtensor_unsupported() -> list[tuple]:
    """DTensors (tensor parallelism, distribute_tensor) are not counted: their local tensors are made
    under DTensor's own dispatch, where this census does not see them (a TP script's gradients and
    optimizer states went uncounted), so such a run is refused rather than undercounted."""
    import torch.distributed.tensor.parallel as tp

    from .fake_tp import dtensor_makers

    def refuse(*_a, **_k):
        raise Unsupported("DTensor (parallelize_module, distribute_tensor): the census does not see a DTensor's "
                          "local tensors")

    return [(tp, "parallelize_module", refuse)] + [
        (owner, attr, staticmethod(refuse) if isinstance(owner, type) else refuse) for owner, attr, _ in dtensor_makers()]


@contextlib.contextmanager
def _patched(census: Census, steps: int, state: dict):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from ..estimate import _fakecuda as fc
    from . import cuda_surface
    from .standins import _compile, triton_patches, waits_for_optimizers

    import torch._dynamo  # noqa: F401  torch imports it lazily, and it reads torch.cuda's real functions

    made, stepped = weakref.WeakSet(), weakref.WeakSet()
    real_opt_init = torch.optim.Optimizer.__init__

    def opt_init(self, *a, **k):
        real_opt_init(self, *a, **k)
        made.add(self)

    def post_step(opt, args, kwargs):
        state["optimizer_steps"] += 1
        state["steps"] = state["optimizer_steps"]
        stepped.add(opt)
        if state["steps"] >= steps and not waits_for_optimizers(state["steps"], steps, made, stepped):
            census.frozen = True   # as the estimate stops
            raise StopRun()

    orig_backward = torch.autograd.backward

    def backward(*a, **k):
        if state["optimizer_steps"] == 0 and not list(made):   # (with an optimizer: its steps count, as accumulated backward passes precede them)
            state["backwards"] += 1
            if state["backwards"] > steps:   # N hand-written steps done: the (N+1)-th starts
                state.update(steps=steps, stopped_by="backward passes (no torch.optim step)")
                census.frozen = True
                raise StopRun()
        return orig_backward(*a, **k)

    orig_dl_init = torch.utils.data.DataLoader.__init__

    def dl_init(self, *a, **k):
        k.update(num_workers=0, persistent_workers=False, pin_memory=False)   # as the estimate's child
        k.pop("prefetch_factor", None)
        return orig_dl_init(self, *a, **k)

    import torch.distributed as dist
    import torch.distributed.device_mesh  # noqa: F401
    import torch.nn.parallel as par

    real_init = dist.init_process_group

    def init_process_group(backend=None, *a, **k):
        # a script's DDP branch at world size 1 (under torchrun of one process, which sets RANK): a
        # real one-rank gloo group over a file store in the run's temp dir (no port to collide on)
        # (torchrun of one), or of the N ranks run_command started (torchrun of N on one node): a
        # real gloo group of them; another world (a script's own processes) is not run here
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        world = int(k.get("world_size", launched))
        rank = int(k.get("rank", os.environ.get("RANK", "0")))
        if world != launched:
            raise Unsupported(f"torch.distributed.init_process_group at world size {world} (the oracle launched {launched})")
        store = dist.FileStore(os.path.join(os.environ.get("TMPDIR", "/tmp"), "oracle-store"), world)
        return real_init("gloo", store=store, rank=rank, world_size=world)

    class DistributedDataParallel(par.DistributedDataParallel):
        """DDP of one rank on the CPU: device_ids name the GPU the module is on (dropped: a CPU
        module takes none); what DDP makes while it is built (its gradient buckets, Reducer.cpp)
        is the device's, as the module's."""

        def __init__(self, module, device_ids=None, output_device=None, *a, **k):
            census.factory += 1
            try:
                super().__init__(module, None, None, *a, **k)
            finally:
                census.factory -= 1

    class DataParallel(par.DataParallel):
        def forward(self, *inputs, **kw):   # one GPU: DataParallel calls its module (data_parallel.py)
            if len(self.device_ids) != 1:
                raise Unsupported("nn.DataParallel over more than one GPU")
            inputs, kw = tree_map_only(torch.Tensor, lambda t: t.to(_CUDA), (inputs, kw))
            return self.module(*inputs, **kw)

    import threading

    real_thread_run = threading.Thread.run

    def thread_run(self):
        # torch's modes are per thread: a thread the script starts (transformers loads weights in a
        # ThreadPoolExecutor) maps CUDA to the CPU and counts as the main thread does
        with _ToCpu(census), _Census(census):
            return real_thread_run(self)

    from torch.autograd.function import BackwardCFunction

    real_custom_backward = BackwardCFunction.apply

    def custom_backward(self, *args):
        # the autograd engine runs an autograd.Function's backward (TRL's chunked log-prob head,
        # a script's own) with no torch function mode: its device=cuda calls are mapped here
        if torch._C._len_torch_function_stack():
            return real_custom_backward(self, *args)
        with _ToCpu(census):
            return real_custom_backward(self, *args)

    real_load = torch.load

    def load(f, map_location=None, *a, **k):
        # a file torch saved, its storages mapped to a GPU: read to the host, each storage counted
        # as device memory from here (the GPU run's load copies it there)
        from .checkpoints import _mapped

        def restore(storage, location):
            if _is_cuda(_mapped(map_location, location)):
                census.mark_storage(storage)
            return storage

        return real_load(f, restore, *a, **k)

    real_device = torch._C.TensorBase.device
    patches = [
        (torch.optim.Optimizer, "__init__", opt_init),
        (torch, "load", load),
        (BackwardCFunction, "apply", custom_backward),
        (threading.Thread, "run", thread_run),
        (torch.Tensor, "device", _device_property(census, real_device)),
        (torch.Tensor, "is_cuda", property(census.shown_as_device)),
        (torch.Tensor, "get_device", lambda self: 0 if census.shown_as_device(self) else -1),
        (torch.autograd, "backward", backward),
        (torch.utils.data.DataLoader, "__init__", dl_init),
        (torch, "compile", _compile),
        (torch, "_cudnn_rnn_flatten_weight", fc.cudnn_rnn_flatten_weight),
        (torch.cuda, "_lazy_init", lambda: None),
        (dist, "init_process_group", init_process_group),
        (dist, "reduce_scatter_tensor", _with_future(dist.reduce_scatter_tensor)),
        (dist, "all_gather_into_tensor", _with_future(dist.all_gather_into_tensor)),
        # DeviceMesh's set-up binds its own name for it (a mesh made before any process group)
        (dist.device_mesh, "init_process_group", init_process_group),
        (par, "DistributedDataParallel", DistributedDataParallel),
        (torch.nn.parallel.distributed, "DistributedDataParallel", DistributedDataParallel),
        (par, "DataParallel", DataParallel), (torch.nn, "DataParallel", DataParallel),
        *_dtensor_unsupported(),
        *_autocast_on_cpu(), *_gpu_kernels(census), *triton_patches(census.is_device, lambda t: None),
        *cuda_surface.patches(cuda_surface.Answers(lambda: census.live_bytes, lambda: census.peak_bytes)),
        *_seeding(census),
    ]
    # a class's own attribute, or _ABSENT where it inherits it (restored by deleting the patch)
    saved = [(obj, attr, obj.__dict__.get(attr, _ABSENT) if isinstance(obj, type) else getattr(obj, attr))
             for obj, attr, _ in patches]
    hook = register_optimizer_step_post_hook(post_step)
    scripted = cuda_surface.TorchScriptNames(
        [(None if old is _ABSENT else old, new) for (_, _, old), (_, _, new) in zip(saved, patches)])
    # torch.cuda.device_count() as on the job's node: one GPU per process of the launch
    with fc.cuda_answers(device_count=int(os.environ.get("LOCAL_WORLD_SIZE", "1"))), _ToCpu(census), _Census(census), \
            CudaAutocast(census.is_device).installed():
        try:
            # torch.device("cuda") contexts and set_default_device name the device for the
            # functions of this cached set, compared by identity: filled with torch's own, before
            # cuda_surface wraps the factories (filled after, the set held the wrappers and a model
            # built under `with torch.device("cuda"):`, as torchtune builds its models, was the
            # host's, uncounted), as the estimate's bootstrap does
            _device_constructors()
            for obj, attr, new in patches:
                setattr(obj, attr, new)
            yield
        finally:
            hook.remove()
            scripted.undo()
            for obj, attr, old in reversed(saved):
                if old is _ABSENT:
                    if attr in obj.__dict__:
                        delattr(obj, attr)
                else:
                    setattr(obj, attr, old)


class _DoneWork:
    """A collective's work whose backend gives no future (gloo's reduce_scatter_tensor and
    all_gather_into_tensor: "Work::getFuture not implemented"; NCCL, the job's backend, gives
    one): waited for, and its future completed with the output, as NCCL's resolves."""

    def __init__(self, work, output):
        self._work, self._output = work, output

    def __getattr__(self, name):
        return getattr(self._work, name)

    def wait(self, timeout=None):
        return self._work.wait() if timeout is None else self._work.wait(timeout)

    def get_future(self):
        try:
            return self._work.get_future()
        except RuntimeError:
            self._work.wait()
            fut = torch.futures.Future()
            fut.set_result([self._output])
            return fut


def _with_future(collective):
    """``collective(output, input, ..., async_op=True)`` whose work has a future on every backend."""
    @functools.wraps(collective)
    def call(output, *args, async_op=False, **kwargs):
        work = collective(output, *args, async_op=async_op, **kwargs)
        return _DoneWork(work, output) if async_op and work is not None else work

    return call


def run(script: str | None, module: str | None, args: list[str], steps: int) -> dict:
    """Run the script (or module) with ``args`` for ``steps`` training steps; what the census saw."""
    census = Census()
    state = {"steps": 0, "optimizer_steps": 0, "backwards": 0, "stopped_by": "optimizer steps"}
    result = {"status": "ok"}
    sys.argv = [script or module] + list(args)
    if script:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        with _patched(census, steps, state):
            try:
                if module:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(script, run_name="__main__")
            except StopRun:
                pass
            except SystemExit as e:
                if e.code not in (0, None):
                    result.update(status="script-exit", message=f"exited with status {e.code}")
    except Unsupported as e:
        result.update(status="unsupported", message=str(e))
    except BaseException as e:   # the script failed on the CPU
        traceback.print_exc()
        result.update(status="script-error", message=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if result["status"] == "ok" and state["steps"] < steps:
        result.update(status="short", message=f"the script ended after {state['steps']} of {steps} training steps")
    result.update(live_peak_bytes=census.peak_bytes, steps=state["steps"], stopped_by=state["stopped_by"])
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="vest_slurm.dynamic.live_oracle", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--module", default=None)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    rest = ns.rest[1:] if ns.rest[:1] == ["--"] else ns.rest
    if not rest and not ns.module:
        p.error("give the training script (or --module M) and its arguments after --")
    if not ns.module and rest[0] == "-m" and len(rest) > 1:   # `-- -m pkg.train ARGS`, as python takes it
        ns.module, rest = rest[1], rest[2:]
    script, args = (None, rest) if ns.module else (rest[0], rest[1:])
    result = run(script, ns.module, args, ns.steps)
    with open(ns.out + ".part", "w") as f:
        json.dump(result, f)
    os.replace(ns.out + ".part", ns.out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # the script's threads and atexit handlers must not hold the caller up


if __name__ == "__main__":
    main()


# the most ranks the oracle runs at once: each is a full CPU process of the script
MAX_RANKS = 8


def run_command(command: str, cwd: str, steps: int, timeout_s: float = 600.0, user_env: dict | None = None) -> dict:
    """Run a job's training command line (``python train.py ARGS``, ``VAR=x python ...``,
    ``torchrun --nproc_per_node N train.py ARGS``) through this oracle in ``cwd``, with the environment
    the estimate's child gets (runner._child_env: offline hubs, a private TMPDIR, the launcher's RANK /
    WORLD_SIZE only where the launcher sets them, so a script that reads RANK takes the branch it
    takes in vest's run and in the job). A torchrun of N processes on one node runs N processes, as
    torchrun does (RANK and LOCAL_RANK 0..N-1, one gloo group over a file store in the shared temp
    dir): the result is rank 0's, the rank vest estimates. Returns that result, with ``seconds``;
    status ``unsupported`` for a launch over several nodes or of more than MAX_RANKS processes.
    ``user_env``: the user's environment (default this process's), as the estimate is given it."""
    import shlex
    import subprocess
    import tempfile
    import time

    from .launch import parse_train_command
    from .runner import _child_env

    cmd = parse_train_command(command)
    words = shlex.split(command)
    nnodes = next((w.split("=", 1)[1] if "=" in w else (words[i + 1] if i + 1 < len(words) else "1")
                   for i, w in enumerate(words) if w.split("=", 1)[0] in ("--nnodes",)), "1")
    ranks = cmd.nproc if cmd.launcher == "torchrun" else 1
    if cmd.nproc != 1 and cmd.launcher != "torchrun" or nnodes not in ("1", "1:1") or not 1 <= ranks <= MAX_RANKS:
        return {"status": "unsupported",
                "message": f"{cmd.launcher} of {cmd.nproc} processes over {nnodes} node(s): the live oracle runs "
                           f"the processes of one node, up to {MAX_RANKS}, of torchrun"}
    with tempfile.TemporaryDirectory(prefix="vest-oracle-") as tmp:
        procs = []
        t0 = time.perf_counter()
        for rank in range(ranks):
            out = os.path.join(tmp, f"result-{rank}.json")
            argv = [sys.executable, "-m", "vest_slurm.dynamic.live_oracle", "--out", out, "--steps", str(steps)]
            argv += ["--module", cmd.module, "--", *cmd.args] if cmd.module else ["--", cmd.script, *cmd.args]
            env = _child_env(cmd, tmp, ranks, user_env=user_env, host_threads=False)
            if cmd.launcher == "torchrun":
                env.update(RANK=str(rank), LOCAL_RANK=str(rank))
            log = open(os.path.join(tmp, f"log-{rank}.txt"), "w+")
            procs.append((subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, text=True), out, log))
        limit = None
        while any(p.poll() is None for p, _, _ in procs):
            # a rank that ended without its result (or with a failure) leaves the others waiting in a
            # collective: the launch is over, as torchrun ends the others when one fails
            done_bad = any(p.poll() is not None and not _ok_result(out) for p, out, _ in procs)
            if time.perf_counter() - t0 > timeout_s:
                limit = {"status": "limit", "message": f"the CPU run took over {timeout_s:.0f} s", "seconds": timeout_s}
            if limit or done_bad:
                break
            time.sleep(0.1)
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        seconds = time.perf_counter() - t0
        if limit:
            return limit
        results, died = [], None
        for rank, (p, out, log) in enumerate(procs):
            log.seek(0)
            text = log.read()
            log.close()
            if not os.path.exists(out):
                tail = " | ".join(text.strip().splitlines()[-3:])
                died = died or {"status": "died", "message": f"rank {rank}: exit {p.returncode}: {tail}", "seconds": seconds}
                continue
            with open(out) as f:
                res = json.load(f)
            if res["status"] != "ok":
                res["message"] = (f"rank {rank}: " if ranks > 1 else "") + res.get("message", "") + " | " \
                    + " | ".join(text.strip().splitlines()[-2:])
            results.append(res)
    bad = next((r for r in results if r["status"] != "ok"), None)
    if bad is None and died is not None:   # the ranks killed because another failed say less than it
        return died
    result = dict(bad or results[0])
    if bad is not None:
        result["live_peak_bytes"] = results[0].get("live_peak_bytes")
    result["seconds"] = seconds
    return result


def _ok_result(path: str) -> bool:
    try:
        with open(path) as f:
            return json.load(f).get("status") == "ok"
    except (OSError, ValueError):
        return False
