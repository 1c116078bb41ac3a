"""Fake CUDA on a CPU-only machine. Every use of private torch APIs in vest-slurm lives here.

How it works (torch 2.4 – 2.14, CPU and CUDA builds):
- ``FakeCudaMode`` is a FakeTensorMode: tensors on ``cuda:0`` carry shapes, dtypes and strides
  but no data, and no GPU is touched.
- The autograd engine asks every tensor for its device (``prim::device``) and, told "cuda",
  reaches for CUDA streams that do not exist here (the CPU build aborts). The mode answers
  ``cpu`` to that op while Python's ``t.device`` stays ``cuda:0``. What follows from that is
  handled below, each where PyTorch would behave differently on a real GPU:
  * native autocast skips tensors whose C++ device is not CUDA, so the CUDA autocast policy
    (aten/src/ATen/autocast_mode.h: the installed torch's own header, or the op lists below) is
    re-registered in Python on the AutocastCUDA key, above autograd, with the same weight-cast
    cache;
  * ``aten::dropout`` takes its CPU path (a mask of the input's dtype); on CUDA it calls
    ``native_dropout`` (a 1-byte bool mask), so dropout is rerouted there;
  * C++ reads that answer wherever it builds a tensor from another's ``options()``: autograd's
    ``ToCopyBackward`` and ``AccumulateGrad`` (a gradient whose strides break the layout
    contract is cloned with ``new_empty_strided``; the zeros that stand for an undefined
    gradient), ``Tensor.type_as``, ``Tensor.to(other)``, the ``toType`` of
    ``softmax(x, dim, dtype=...)``. Such an op gets a CPU device argument for a fake CUDA input:
    it keeps the CUDA device unless the script itself asked for the host (``.cpu()``,
    ``.to("cpu")``; ``HOST_COPY``). Otherwise the result and all that follows from it would be
    CPU tensors, which the recorder does not see and which take CPU code paths;
  * composite ops that test ``is_cuda()`` (softmax with half input and float dtype) take the
    CUDA branch explicitly (the autocast kernels, and ``softmax``/``log_softmax`` with a dtype);
  * scaled_dot_product_attention would choose among the CPU's kernels: the GPU's choice is made
    here (``gpu_sdp_choice``) and its kernel called, from a kernel on the AutogradCUDA key, so
    that it holds wherever the call comes from (``nn.MultiheadAttention`` makes it inside
    ``F.multi_head_attention_forward``) and after autocast's cast, as on the GPU.
- Under any dispatch mode every tensor is "subclass-like" (``at::isTensorSubclassLike``), and
  PyTorch then takes out-of-place paths where a GPU run writes in place: autograd's gradient
  sums, the backward formulas that fill zeros. The tracer folds those copies back
  (tracing.py ``Tracer._maybe_in_place``); the rarer ones left are listed in benchmarks/README.md.
- ``Recorder`` sees each op's outputs: a storage seen for the first time is an allocation of
  its nbytes; a weakref finalizer on the storage records its free. No strong reference to any
  tensor is held, so frees happen exactly when PyTorch would free them.

- Values the script builds without data (masks from ``ones``, padding, ``arange``) are followed
  as sets or ranges (``_known.py``), so that a check on them (``mask.any().item()``) answers as
  on the GPU; a few random numbers drawn on the host (LayerDrop) take the draw that keeps every
  layer (``CudaFactoryMode``).
- ``Module.to(dtype)`` inside a step replaces a fake parameter's data as on a GPU
  (``_swap_or_set_data``), where swap_tensors would refuse a tensor FakeTensorMode memoizes.

Known limitations:
- Ops without a fake/meta kernel, and data-dependent ops (``nonzero``, ``.item()`` on a value
  that the data decides), cannot be traced; tracing stops with the op's name. In dynamic analysis,
  a device tensor copied from the host keeps its real values (``_shadow.py``: integer, bool and
  small tensors), and data-dependent ops on such values take the real shape.
- cuDNN / cuBLAS workspaces are not allocated by the fake ops; the tracer marks where the GPU
  would take them (``workspace`` events; a convolution's carries its shapes, conv_workspace_keys)
  and the estimator sizes them per GPU type (the profile's cuBLAS size; cuDNN's own heuristics,
  cudnn_ws.py). With ``torch.backends.cudnn.benchmark`` on, the first run of each shape also
  gets benchmark mode's timing workspace (``cudnn_find``, the largest of all engines'); which
  engine wins the timing is not knowable here, so later runs keep the heuristics' first plan.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch._prims_common import compute_elementwise_output_strides, is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, UnsupportedOperatorException)
from torch.utils import _device as _device_mod
from torch.utils import _pytree as pytree

from .. import errors
from ..errors import note_stop
from . import _known, _shadow

DEVICE = torch.device("cuda", 0)

# Layout questions other modules ask of fake tensors, answered as TensorIterator / c10 do
elementwise_output_strides = compute_elementwise_output_strides
is_dense = is_non_overlapping_and_dense_or_false
parse_to = torch._C._nn._parse_to   # Tensor.to's argument parser: (device, dtype, non_blocking, memory_format)
# What tracing stops on (data-dependent control flow, ops without a fake kernel) is raised as
# DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException (above).

aten = torch.ops.aten

# ---- CUDA autocast policy (aten/src/ATen/autocast_mode.h). The lists below are torch 2.14's; the
# installed torch's own header, which its wheel ships, replaces them where it can be read
# (installed_autocast_policy): the lists change between releases (rms_norm joined the fp32 list).
LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu",
    "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
    "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
    "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
    "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist",
    "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
           "index_put", "tensordot", "scatter_add")


def _torch_header(path: str | None, *parts: str) -> str | None:
    """The text of one of the installed torch's C++ headers (torch/include/...), or of ``path``
    where given; None where it cannot be read."""
    import os

    try:
        with open(path or os.path.join(os.path.dirname(torch.__file__), "include", *parts), encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def installed_autocast_policy(header: str | None = None) -> dict[str, tuple[str, ...]] | None:
    """The op lists of autocast_mode.h (``AT_FORALL_LOWER_PRECISION_FP``, ``_FP32``,
    ``_FP32_SET_OPT_DTYPE``, ``_PROMOTE``) as ``name[.overload]`` strings; None where the header
    is absent or not in the expected form."""
    import re

    text = _torch_header(header, "ATen", "autocast_mode.h")
    if text is None:
        return None
    lists = {}
    for name in ("LOWER_PRECISION_FP", "FP32", "FP32_SET_OPT_DTYPE", "PROMOTE"):
        block = re.search(r"#define AT_FORALL_%s\(_\)(.*?)(?:\n\s*\n|\n#)" % name, text, re.S)
        ops = re.findall(r"_\(\s*(\w+)\s*(?:,\s*(\w+)\s*)?\)", block.group(1)) if block else []
        if not ops:
            return None
        lists[name] = tuple(f"{op}.{overload}" if overload else op for op, overload in ops)
    return lists


_INSTALLED = installed_autocast_policy()
if _INSTALLED is not None:
    LOWER_PRECISION_FP, FP32 = _INSTALLED["LOWER_PRECISION_FP"], _INSTALLED["FP32"]
    FP32_SET_OPT_DTYPE, PROMOTE = _INSTALLED["FP32_SET_OPT_DTYPE"], _INSTALLED["PROMOTE"]

# Ops after which the GPU run holds a cuBLAS workspace (allocated through the caching allocator
# the first time a handle is used on a stream; see overheads.py for its size).
BLAS_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten.addmv.default, aten.mv.default}
CONV_OPS = {aten.convolution.default, aten.convolution_backward.default}


def conv_workspace_keys(func, args) -> list[str]:
    """The cuDNN convolutions a convolution op runs, as cudnn_ws.conv_key strings: the forward for
    ``convolution``; backward-data then backward-filter (as ``output_mask`` asks) for
    ``convolution_backward``. 1-d convolutions run as 2-d ones of height 1 (ATen's view4d);
    transposed and 3-d convolutions are left out (no key: workspace 0)."""
    from .cudnn_ws import conv_key

    if func is aten.convolution.default:
        x, w, _bias, stride, padding, dilation, transposed = args[:7]
        kinds = ["fprop"]
    else:
        _grad, x, w, _bias_sizes, stride, padding, dilation, transposed = args[:8]
        mask = args[10] if len(args) > 10 else (True, True, True)
        kinds = [k for k, on in (("dgrad", mask[0]), ("wgrad", mask[1])) if on]
    if transposed or not (_is_fake_cuda(x) and _is_fake_cuda(w)) or x.dim() not in (3, 4):
        return []
    xs, ws, stride, padding, dilation = conv_geometry(x, w, stride, padding, dilation)
    on_cudnn, channels_last = conv_on_cudnn(x, w, xs, ws, stride, dilation)
    if not on_cudnn:
        return []
    dtype = str(x.dtype).replace("torch.", "")
    # fp32 convolutions may run on TF32 tensor-core engines only while torch.backends.cudnn.allow_tf32
    # is on (Conv_v8.cpp filterEngineConfigs); the script's own setting, read when the op runs
    tf32 = x.dtype != torch.float32 or bool(torch.backends.cudnn.allow_tf32)
    return [conv_key(k, xs, ws, stride, padding, dilation, dtype, channels_last, tf32) for k in kinds]


def conv_geometry(x, w, stride, padding, dilation):
    """(input shape, weight shape, stride, padding, dilation) of the 2-d convolution ATen runs:
    one value stands for every spatial dimension (expand_param_if_needed: HF's EfficientNet passes
    padding=[0] to a 2-d convolution), and a 1-d convolution runs as a 2-d one of height 1 (view4d)."""
    xs, ws = list(x.shape), list(w.shape)
    stride, padding, dilation = ([int(v) for v in p] * (x.dim() - 2) if len(p) == 1 else [int(v) for v in p]
                                 for p in (stride, padding, dilation))
    if x.dim() == 3:   # (N, C, L) -> (N, C, 1, L)
        xs, ws = [xs[0], xs[1], 1, xs[2]], [ws[0], ws[1], 1, ws[2]]
        stride, padding, dilation = [1] + stride, [0] + padding, [1] + dilation
    return xs, ws, stride, padding, dilation


def conv_on_cudnn(x, w, xs, ws, stride, dilation) -> tuple[bool, bool]:
    """(whether cuDNN runs this convolution, whether in channels-last), for the 2-d geometry
    conv_geometry gives (xs, ws, stride, dilation). cudnn_conv_suggest_memory_format (ConvUtils.h): channels-last when the
    input or the weight suggests it; the operands are then copied dense in it (scratch.py).
    A bfloat16 convolution runs on cuDNN only from sm80 (Convolution.cpp use_cudnn:
    ``supportsBFloat16ConvolutionWithCuDNNv8``, CUDAHooks ``major >= 8``); before, on ATen's own
    kernels (im2col + GEMM, or the depthwise kernel)."""
    channels_last = x.dim() == 4 and (suggests_channels_last(x.shape, x.stride())
                                      or suggests_channels_last(w.shape, w.stride()))
    capability = _TRACED_CAPABILITY[0]
    if torch.bfloat16 in (x.dtype, w.dtype) and capability is not None and \
            not asked("conv_bf16_on_cudnn", None, tuple(capability) >= (8, 0)):
        return False, channels_last
    return depthwise_on_cudnn(xs, ws, stride, dilation, x.dtype, channels_last), channels_last


def conv_groups(xs, ws) -> int:
    """A convolution's groups from its input and weight shapes (weight: C_out x C_in/groups x ...)."""
    return xs[1] // ws[1] if ws[1] else 1


def is_depthwise(xs, ws) -> bool:
    """ConvParams::is_depthwise (Convolution.cpp): groups == input channels > 1, each group's output
    channels a multiple of them. Such a convolution off cuDNN runs ATen's depthwise kernel; any
    other one there runs im2col + GEMM (slow_conv2d)."""
    groups = conv_groups(xs, ws)
    return groups > 1 and groups == xs[1] and ws[0] % xs[1] == 0


def suggests_channels_last(shape, strides) -> bool:
    """c10's is_channels_last_strides_2d_s4, what ``suggest_memory_format()`` reads for 4-d
    tensors: strides growing in (C, W, H, N) order, ambiguous cases NCHW. True also for a tensor
    that is not dense (a channel slice of a channels-last one)."""
    if len(shape) != 4 or strides[1] == 0:
        return False
    low = 0
    for d in (1, 3, 2, 0):
        if shape[d] == 0 or strides[d] < low or (d == 0 and low == strides[1]):
            return False
        low = strides[d] * shape[d] if shape[d] > 1 else strides[d]
    return True


def depthwise_on_cudnn(xs, ws, stride, dilation, dtype, channels_last) -> bool:
    """ATen's backend choice (Convolution.cpp select_conv_backend): a depthwise convolution
    (groups == input channels) runs on cuDNN only in channels_last, or in fp16 where
    use_cudnn_depthwise's simplified rule for cuDNN >= 8.2 allows it (1-d with stride 1; square
    1/3/5 filters, width >= 7, stride 1; stride-2 cases are left to ATen's kernel here); otherwise
    on ATen's own depthwise kernel, which takes no workspace. Any other convolution: cuDNN."""
    if not is_depthwise(xs, ws):
        return True
    if channels_last:
        return True
    if dtype != torch.float16 or any(d != 1 for d in dilation) or xs[1] < 32:
        return False
    if xs[2] == 1 and stride[1] == 1:
        return True
    return ws[2] == ws[3] and ws[3] in (1, 3, 5) and xs[3] >= 7 and stride[0] == stride[1] == 1

_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)
_AUTOCAST_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)   # (the live oracle's: cuda_autocast.py)
# Dynamic analysis's stand-ins for checks on values: what a healthy run reads (losses are finite:
# isfinite true; isnan / isinf false; a validation's torch._is_all_true, torch.distributions' check of
# its parameters and samples against their constraints, true). Kept as fills (below), so
# all/any/not carry them.
_TRUTH_FUNCTIONS = {"isfinite": True, "isnan": False, "isinf": False, "isposinf": False, "isneginf": False,
                    "_is_all_true": True}
_TRUTH_OPS = {getattr(aten, name): value for name, value in _TRUTH_FUNCTIONS.items()}


# A truth test the script makes of a device value to stop a broken run, ``assert (x2 >= x1).all()``
# (DETR's box checks), ``if torch.isnan(loss).any(): raise ...``: a healthy run passes it (else it
# raises, and the job is no job to place), so its stand-in is the value that does not raise. Read
# from the bytecode of the frame making the test: a conditional jump one of whose two ways is an
# `assert`'s LOAD_ASSERTION_ERROR, or a straight run of instructions to a raise.
_TRUTH_JUMPS = {"POP_JUMP_FORWARD_IF_TRUE": True, "POP_JUMP_BACKWARD_IF_TRUE": True, "POP_JUMP_IF_TRUE": True,
                "POP_JUMP_FORWARD_IF_FALSE": False, "POP_JUMP_BACKWARD_IF_FALSE": False, "POP_JUMP_IF_FALSE": False}
_STRAIGHT = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_CONST", "LOAD_FAST", "LOAD_DEREF", "LOAD_ATTR",
                       "LOAD_METHOD", "LOAD_ASSERTION_ERROR", "FORMAT_VALUE", "FORMAT_SIMPLE", "FORMAT_WITH_SPEC",
                       "CONVERT_VALUE", "BUILD_STRING", "BUILD_TUPLE", "PRECALL", "CALL", "PUSH_NULL", "KW_NAMES",
                       "CACHE", "NOP", "EXTENDED_ARG", "RESUME", "COPY_FREE_VARS", "LOAD_FAST_CHECK",
                       "LOAD_FAST_LOAD_FAST", "CALL_KW", "BINARY_OP"})


@functools.lru_cache(maxsize=256)
def _instructions(code) -> tuple[dict, list]:
    import dis

    ins = list(dis.get_instructions(code))
    return {x.offset: i for i, x in enumerate(ins)}, ins


def _raises_from(ins: list, i: int) -> bool:
    for x in ins[i:i + 40]:
        if x.opname == "RAISE_VARARGS":
            return True
        if x.opname not in _STRAIGHT:
            return False
    return False


def check_passed(depth: int = 40) -> bool | None:
    """The value of a bool read that lets the run go on where the frame testing it raises on the
    other value (an assert, ``if bad: raise``), else None (a branch of the program: the stand-in)."""
    import sys

    f = sys._getframe(1)
    while f is not None and depth > 0:
        at, ins = _instructions(f.f_code)
        i = at.get(f.f_lasti)
        if i is not None and ins[i].opname == "TO_BOOL":
            i += 1
        x = ins[i] if i is not None and i < len(ins) else None
        if x is not None and x.opname in _TRUTH_JUMPS:
            return _passing_side(at, ins, i)
        f, depth = f.f_back, depth - 1
    return None


def check_passed_after_call(frame) -> bool | None:
    """check_passed for a function that returns a Python bool itself (``torch.equal``,
    ``torch.allclose``), asked from its stand-in: the instruction after the call in ``frame``
    (the caller's) tests it."""
    import bisect

    at, ins = _instructions(frame.f_code)
    # (the call's instruction: f_lasti is its last inline cache entry's offset in Python 3.11)
    i = bisect.bisect_right([x.offset for x in ins], frame.f_lasti)
    if i < len(ins) and ins[i].opname == "TO_BOOL":
        i += 1
    if i >= len(ins) or ins[i].opname not in _TRUTH_JUMPS:
        return None
    return _passing_side(at, ins, i)


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are one view of one storage (so equal, as a healthy run's, NaN-free)."""
    return a is b or (a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.shape == b.shape
                      and a.stride() == b.stride() and a.storage_offset() == b.storage_offset())


def _passing_side(at: dict, ins: list, i: int) -> bool | None:
    """The value for which the truth jump ``ins[i]`` goes where nothing raises, where one side raises."""
    jumps_on = _TRUTH_JUMPS[ins[i].opname]
    target = at.get(ins[i].argval)
    if target is not None and _raises_from(ins, target):
        return not jumps_on
    if _raises_from(ins, i + 1):
        return jumps_on
    return None


# Values known without data (_known.py: a tensor filled with one value, a scalar made by
# torch.tensor, an arange, and what comparisons, casts, padding, gathers, where / masked_fill /
# index_put and all/any make of them). transformers 4.x builds an all-ones attention mask itself
# when none is given and asks `torch.all(mask == 1)` to choose the attention kernel; Longformer
# asks whether its padded mask has global attention. Kept per storage (views share it); a write to
# a storage forgets it unless a rule says what it leaves. Dynamic analysis's stand-ins for checks
# on values (_TRUTH_FUNCTIONS) are kept the same way.


@functools.lru_cache(maxsize=None)
def _written_args(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments an op writes to (in-place and out= forms)."""
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _op_leaves(args, kwargs) -> list:
    """The arguments of an aten op that pytree.tree_leaves((args, kwargs)) finds tensors, devices and
    strings among (with None and the elements of int lists besides, which no caller looks at): an
    op's schema types are scalars, tensors and one-level lists of them (Tensor[], Tensor?[],
    int[]), so they are walked directly; anything nested deeper goes to pytree. Asked for every
    op the fake mode sees, where pytree's general walk costs as much as the rest of our dispatch."""
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, (list, tuple, dict)):
                    return pytree.tree_leaves((args, kwargs))
            out.extend(a)
        elif isinstance(a, dict):
            return pytree.tree_leaves((args, kwargs))
        else:
            out.append(a)
    return out


def _is_fake_cuda(t) -> bool:
    return isinstance(t, FakeTensor) and t.fake_device.type == "cuda"


CASTING_WEIGHT = [False]   # True while a weight's low-precision copy is made (the tracer tags it)
HOST_COPY = [0]            # > 0 while the script copies a tensor to the host (.cpu(), .to("cpu"))
CURRENT_OP = [""]          # the outermost op whose outputs are being recorded (AllocEvent.op)


def _targets_host(func, args, kwargs) -> bool:
    """Whether a call copies a fake CUDA tensor to the host because the script asked for it."""
    if not (args and _is_fake_cuda(args[0])):
        return False
    if func is torch.Tensor.cpu:
        return True
    if func in (torch.Tensor.to, torch.Tensor.type_as):
        for a in list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]:
            if isinstance(a, torch.Tensor):
                return a.device.type == "cpu"   # Python's device: a fake CUDA tensor says cuda
            if (isinstance(a, str) and a.split(":")[0] == "cpu") or (isinstance(a, torch.device) and a.type == "cpu"):
                return True
    return False


class _CastCache:
    """The autocast weight cast cache (autocast_mode.cpp cached_cast): casts of fp32 leaf tensors
    that require grad are kept until the outermost autocast region exits."""

    def __init__(self, eligible=None):
        self.entries: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.eligible = eligible or _is_fake_cuda   # a tensor on the device autocast casts

    def cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not (self.eligible(t) and t.is_floating_point()) or t.dtype == dtype or t.dtype == torch.float64:
            return t
        cacheable = (dtype != torch.float32 and t.dtype == torch.float32 and t.requires_grad
                     and t.is_leaf and not t._is_view() and torch.is_autocast_cache_enabled())
        if cacheable:
            hit = self.entries.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
            CASTING_WEIGHT[0] = True
            try:
                casted = t.to(dtype)
            finally:
                CASTING_WEIGHT[0] = False
            self.entries[id(t)] = (weakref.ref(t), casted)
            return casted
        return t.to(dtype)

    def clear(self):
        self.entries.clear()


CAST_CACHE = _CastCache()


def _autocast_kernel(op, policy: str, cache: _CastCache | None = None, device: str = "cuda"):
    """CUDA autocast's ``policy`` for ``op`` (autocast_mode.h's WrapFunction_), registered on the
    autocast key of ``device``: AutocastCUDA for vest's fake CUDA tensors, AutocastCPU for the live
    oracle's (dynamic/cuda_autocast.py); ``cache`` casts the tensors it deems on the device."""
    cache = CAST_CACHE if cache is None else cache
    exclude = _AUTOCAST_KEYS if device == "cuda" else _AUTOCAST_CPU_KEYS

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            if policy == "lower":
                dtype = torch.get_autocast_dtype(device)
                args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: cache.cast(t, dtype), (args, kwargs))
            elif policy == "fp32":
                args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: cache.cast(t, torch.float32), (args, kwargs))
            elif policy == "set_opt_dtype":
                first = args[0] if args else None
                name = op._schema.name
                positional_dtype = name in ("aten::softmax", "aten::log_softmax")
                given = args[2] if positional_dtype and len(args) > 2 else kwargs.get("dtype")
                if cache.eligible(first) and first.is_floating_point() and given is None:
                    # (the CPU has no half-to-float softmax: the oracle converts first, a transient copy)
                    if positional_dtype and first.dtype == torch.float16 and device == "cuda":
                        # CUDA branch of SoftMax.cpp: half input, float output, no converted copy.
                        fn = aten._softmax if name == "aten::softmax" else aten._log_softmax
                        return fn(first, args[1], True)
                    if positional_dtype:
                        args = (args[0], args[1], torch.float32)
                    else:
                        kwargs = dict(kwargs, dtype=torch.float32)
            elif policy == "promote":
                tensors = [a for a in pytree.tree_leaves((args, kwargs)) if cache.eligible(a) and a.is_floating_point()]
                if tensors:
                    widest = _widest_dtype(tensors)
                    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: cache.cast(t, widest), (args, kwargs))
            return op(*args, **kwargs)

    return kernel


def _widest_dtype(tensors):
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _dropout_kernel(input, p, train):
    # aten/src/ATen/native/Dropout.cpp: CUDA inputs take the fused native_dropout (bool mask).
    if not train or p == 0 or input.numel() == 0:
        return input
    if p == 1:
        return input * 0
    return aten.native_dropout(input, p, train)[0]


def _softmax_kernel(fn):
    # aten/src/ATen/native/SoftMax.cpp softmax / log_softmax with a dtype: a CUDA half input with
    # a float dtype runs the half-to-float kernel; anything else converts first (toType).
    def kernel(input, dim, dtype=None):
        if dtype == torch.float32 and input.dtype == torch.float16:
            return fn(input, dim, True)
        return fn(input.to(dtype) if dtype is not None else input, dim, False)
    return kernel


def cudnn_batch_norm_input(input, weight, bias, running_mean, running_var, training: bool, eps: float):
    """The input as ATen's batch norm hands it to its backend on a GPU (Normalization.cpp,
    _batch_norm_impl_index): where _select_batch_norm_backend takes cuDNN, a copy contiguous in the
    input's suggested memory format, which cudnn_batch_norm saves for backward in the input's
    place (a transposed input, PatchTST's BatchNorm1d over the features: one input-sized copy
    alive to the backward, and a contiguous output); else the input itself. The fake tensors'
    C++ device is the host's, so ATen's own choice here is always its native kernel.
    (CUDNN_BN_MIN_EPSILON, the least eps cuDNN takes, is 0.0 since cuDNN 7.)"""
    from torch._prims_common import suggest_memory_format

    if not (torch.backends.cudnn.enabled and input.layout == torch.strided
            and input.dtype != torch.bfloat16 and weight is not None and bias is not None
            and weight.dtype != torch.bfloat16
            and (input.dtype != torch.float16 or weight.dtype == torch.float32)
            and ((running_mean is not None and running_var is not None)
                 or (running_mean is None and running_var is None and training))
            and input.dim() >= 3 and input.shape[0] <= (880801 if training else 65535)
            and eps >= 0.0 and input.numel() < 2**31 - 1):
        return input
    return input.contiguous(memory_format=suggest_memory_format(input))


def _batch_norm_kernel(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    x = cudnn_batch_norm_input(input, weight, bias, running_mean, running_var, training, eps)
    return aten._batch_norm_impl_index(x, weight, bias, running_mean, running_var, training, momentum, eps,
                                       cudnn_enabled)[0]


def aten_overload(qualname: str):
    """``torch.ops.aten``'s overload named ``name[.overload]`` (the default one where none is
    named), or None where this torch has no such op."""
    base, _, overload = qualname.partition(".")
    packet = getattr(aten, base, None)
    return getattr(packet, overload or "default", None) if packet is not None else None


_LIBS: list = []


def _register_kernels() -> None:
    """Register the Python kernels once per process (torch.library keeps them for its lifetime)."""
    if _LIBS:
        return
    import warnings

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel" is intended
        for names, policy in ((LOWER_PRECISION_FP, "lower"), (FP32, "fp32"),
                              (FP32_SET_OPT_DTYPE, "set_opt_dtype"), (PROMOTE, "promote")):
            for full in names:
                op = aten_overload(full)
                if op is not None:
                    lib.impl(full, _autocast_kernel(op, policy), "AutocastCUDA")
        lib.impl("dropout", _dropout_kernel, "AutogradCUDA")
        lib.impl("scaled_dot_product_attention", _sdpa_kernel, "AutogradCUDA")
        lib.impl("softmax.int", _softmax_kernel(aten._softmax), "AutogradCUDA")
        lib.impl("log_softmax.int", _softmax_kernel(aten._log_softmax), "AutogradCUDA")
        lib.impl("batch_norm", _batch_norm_kernel, "AutogradCUDA")
        for full in _fused_optimizer_ops_without_meta():
            lib.impl(full, _writes_in_place, "Meta")
        for name, fn in _SYNC_BATCH_NORM_META.items():
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
                lib.impl(name, fn, "Meta")
    _LIBS.append(lib)


# SyncBatchNorm's CUDA-only kernels (torch/nn/modules/_functions.py; ATen's cuda/Normalization.cu),
# which torch gives no Meta kernel: their outputs as the CUDA kernels allocate them. Statistics are
# one value per channel (dim 1) in the accumulate type of a half input (float); the elementwise
# passes give a tensor like the input in its suggested memory format; running stats are updated in place.
def _bn_acc(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _bn_stats(input, eps):
    c = input.size(1)
    return tuple(input.new_empty((c,), dtype=_bn_acc(input.dtype)) for _ in range(2))


def _bn_gather_stats(input, mean, invstd, running_mean, running_var, momentum, eps, counts):
    c = mean.size(1)
    return tuple(mean.new_empty((c,), dtype=_bn_acc(mean.dtype)) for _ in range(2))


def _bn_like_input(input, *args):
    from torch._prims_common import suggest_memory_format

    return torch.empty_like(input, memory_format=suggest_memory_format(input))


def _bn_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g):
    c = input.size(1)
    sums = (torch.empty_like(mean), torch.empty_like(mean)) if input_g else (None, None)
    like = weight if weight is not None else mean
    return sums + tuple(like.new_empty((c,)) if g else None for g in (weight_g, bias_g))


_SYNC_BATCH_NORM_META = {
    "batch_norm_stats": _bn_stats,
    "batch_norm_gather_stats_with_counts": _bn_gather_stats,
    "batch_norm_gather_stats": _bn_gather_stats,
    "batch_norm_elemt": lambda input, weight, bias, mean, invstd, eps: _bn_like_input(input),
    "batch_norm_backward_reduce": _bn_backward_reduce,
    "batch_norm_backward_elemt": lambda grad_out, input, *a: _bn_like_input(input),
}


def _fused_optimizer_ops_without_meta() -> list[str]:
    """The fused optimizer steps (``torch.optim.SGD(fused=True)``, Adagrad's, Adam's with a tensor
    lr: ``aten._fused_*_``) that torch gives no Meta kernel: fake tensors cannot run them (FakeTensor
    falls back to the real CUDA kernel, which needs the driver). Each updates its tensor lists in
    place in one kernel that allocates nothing (ATen's fused optimizer kernels take every buffer,
    momentum and state included, as arguments), and returns nothing."""
    out = []
    names = {n.split("::", 1)[1].split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("aten::_fused_")}   # (dir(aten) lists only the ops looked up so far)
    for name in sorted(names):
        if not name.endswith("_"):
            continue
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if op._schema.returns or torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"):
                continue
            out.append(name + ("" if overload == "default" else "." + overload))
    return out


def _writes_in_place(*args, **kwargs):
    return None


# ---- recording -------------------------------------------------------------------------------------

@dataclass
class Recorder:
    """Receives alloc/free callbacks; the tracer owns the policy (phase, category, module)."""

    on_alloc: Callable[[int, int, torch.UntypedStorage], None]
    on_free: Callable[[int], None]
    on_op: Callable[[object, tuple, object], None] | None = None
    next_block: int = 0   # the id the next block gets (ids only grow: a block made later has a larger one)
    _seen: dict = field(default_factory=dict)  # id(storage) -> block id

    def new_block(self) -> int:
        """A block id of its own, for an allocation recorded without a storage (repeats.py)."""
        block, self.next_block = self.next_block, self.next_block + 1
        return block

    def see(self, t) -> None:
        if not _is_fake_cuda(t):
            return
        s = t.untyped_storage()
        key = id(s)
        if key in self._seen:
            return
        block = self.new_block()
        self._seen[key] = block
        weakref.finalize(s, self._freed, key, block)
        self.on_alloc(block, s.nbytes(), s)

    def live_block(self, t) -> int | None:
        return self._seen.get(id(t.untyped_storage()))

    def _freed(self, key: int, block: int) -> None:
        if self._seen.get(key) == block:
            del self._seen[key]
        self.on_free(block)


def _forget_the_freed(table: dict, every: int = 4096) -> None:
    """Drop the entries of storages that are gone, each time the table has grown by ``every``."""
    if len(table) % every == 0:
        for key in [key for key, entry in table.items() if entry[0]() is None]:
            del table[key]


def _is_real_host(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.device.type == "cpu"


def _backward_on_the_host(limit: int = 64) -> bool:
    """Whether the backward node running now computes a model that is not on the GPU: one kept on
    the host (a CPU-only script, a model never moved to the GPU) or one on the meta device (FLOP
    counting on a meta copy: Lightning's measure_flops, litgpt): the weights nearest to it in the
    graph (its own, else its inputs') are fake host tensors or meta tensors. C++ reads every fake
    tensor's device as the host's, so the node's own metadata cannot say; a node that reaches no
    weight within ``limit`` nodes counts as the GPU's."""
    node = torch._C._current_autograd_node()
    todo, seen = [node] if node is not None else [], 0
    while todo and seen < limit:
        n = todo.pop(0)
        seen += 1
        var = getattr(n, "variable", None)   # AccumulateGrad: a leaf that takes a gradient
        if isinstance(var, FakeTensor):
            return var.fake_device.type != "cuda"
        if isinstance(var, torch.Tensor) and var.is_meta:
            return True
        todo.extend(f for f, _ in getattr(n, "next_functions", ()) if f is not None)
    return False


def _names_cuda(a) -> bool:
    if isinstance(a, torch.device):
        return a.type == "cuda"
    return isinstance(a, str) and (a == "cuda" or a.startswith("cuda:") or a.startswith("torch.cuda."))


def _fake_at_heart(a) -> bool:
    """A FakeTensor, or a torch.func transform's wrapper of one (vmap's BatchedTensor, grad's
    GradTrackingTensor: their values are the fake tensor's, on its device)."""
    while isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) and \
            torch._C._functorch.is_functorch_wrapped_tensor(a):
        a = torch._C._functorch.get_unwrapped(a)
    return isinstance(a, FakeTensor)


# The most elements a run draws for real to keep the host generator where the job's would be: the
# host generator makes about 50 M float draws a second here, so a GPT-2 small (124 M weights) built
# on the host costs 1-2 s more; a larger model's later fills are not drawn, and the script's later
# host draws differ from the job's (the batches traced are others of the same kind; where their
# shapes differ, the estimate says so: standins.shapes_note).
_ADVANCE_BUDGET = [1 << 27]


def _spend_draws(n: int) -> bool:
    """Whether ``n`` more draws fit in the run's _ADVANCE_BUDGET (taken from it if so)."""
    if n > _ADVANCE_BUDGET[0]:
        return False
    _ADVANCE_BUDGET[0] -= n
    return True


def _advance_host_generator(func, args, kwargs) -> torch.Tensor | None:
    """A random fill of a fake host tensor (the weights a module's constructor initialises on the
    host, which stay fake: ``nn.init.kaiming_uniform_``, ``normal_``, ``trunc_normal_``) drew
    nothing, where the job's draws from the host's generator. Every later host draw of the script
    (the DataLoader's shuffle seed, a random crop, a sampler without its own generator) then
    differed from the job's, and so did the batches traced (their lengths, where each batch is
    padded to its longest). The same fill of a real tensor of the same layout takes as many
    numbers from the same generator. (CudaFactoryMode does the same for torch.randn and its kind
    in a constructor; fills of fake CUDA tensors are the GPU generator's draws: none.) Returns the
    real tensor filled: the values the job draws there (None where nothing was drawn)."""
    first = func._schema.arguments[0] if func._schema.arguments else None
    target = args[0] if args else None
    if not (isinstance(target, FakeTensor) and target.fake_device.type == "cpu" and first is not None
            and first.alias_info is not None and first.alias_info.is_write):
        return None
    if any(isinstance(a, torch.Tensor) for a in pytree.tree_leaves((args[1:], kwargs))):
        return None   # a draw from other tensors (bernoulli_(p)): not a weight's initialisation
    gen = kwargs.get("generator")
    if (gen is not None and getattr(gen, "_vest_device", None) is not None) or not _spend_draws(target.numel()):
        return None   # a CUDA generator's draw; or past the budget
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        real = torch.empty_strided(tuple(target.shape), tuple(target.stride()), dtype=target.dtype)
        func(real, *args[1:], **kwargs)
    return real


_CTC_FORWARD = {aten._ctc_loss.default, aten._ctc_loss.Tensor}
_CTC_OPS = _CTC_FORWARD | {aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor}


def _real_host_op(leaves) -> bool:
    """An aten op on real host tensors only, with no CUDA device asked for: it runs for real
    (``leaves``: its arguments, _op_leaves)."""
    real = False
    for a in leaves:
        if _fake_at_heart(a) or _names_cuda(a):
            return False
        real = real or isinstance(a, torch.Tensor)
    return real


# Calls under the script's torch.compile (dynamic analysis: standins._compile runs them eagerly, and
# counts here): what a compiled region's higher-order operators allocate is their fused kernels'
COMPILED = [0]
# nonzero of a device tensor without host values, of at most this many elements, is taken as all
# selected (FakeCudaMode._bounded_nonzero): per-sample and per-sequence masks (a batch of 64K
# sequences, or 8 x 8K tokens), not a detector's anchors (hundreds of thousands)
BOUNDED_MASK_NUMEL = 1 << 16
BOUNDED_MASKS: list = []   # where it was (the script's file:line), for the run's flag

_PRIM_DEVICE = torch.ops.prim.device.default   # autograd's device query (four attribute lookups per op otherwise)


class FakeCudaMode(FakeTensorMode):
    """FakeTensorMode that answers ``cpu`` to autograd's device query and records storages."""

    def __init__(self, recorder: Recorder, scalar_stand_in: bool = False, host_real: bool = False):
        super().__init__(allow_non_fake_inputs=True)
        _RUN_MODE[0] = self
        self.recorder = recorder
        # Dynamic analysis: host tensors are real (see CudaFactoryMode): an op whose tensors are
        # all real and that targets no CUDA device runs for real; a real tensor that meets a fake
        # CUDA one is handled as a fake host tensor was (_onto_the_gpu), and what its values are
        # is read from them (known_of).
        self.host_real = host_real
        # nesting of __torch_dispatch__ (decompositions re-enter the mode), per thread: a thread
        # the script starts runs under this mode too (bootstrap.py: transformers loads weights in a
        # ThreadPoolExecutor), and its ops are outermost in their own thread
        self._nesting = threading.local()
        # FakeTensorMode keeps its kernel-invocation state on the instance, not per thread: one op
        # at a time across threads (reentrant: decompositions dispatch back in)
        self._lock = threading.RLock()
        # Dynamic analysis: a value read from the device (bool(t), float(t)) gets a stand-in
        # (1 / 1.0 / False) instead of failing; the declarative tracer reports it as data-dependent.
        self.scalar_stand_in = scalar_stand_in
        self._fills: dict[int, tuple] = {}   # id(storage) -> (storage, known values, their dtype)
        self._truths: dict[int, tuple] = {}   # id(mask storage) -> (mask storage, source storage, source version)
        # Dynamic analysis: device tensors copied from the host keep their real values (_shadow.py)
        self.shadows = _shadow.Shadows() if host_real else None
        # Dynamic analysis: a call of the model being recorded for replay sees each outermost op
        # first (vest_slurm/dynamic/repeats.py); None otherwise
        self.watch: Callable[[object, tuple, dict], None] | None = None
        # the blocks of outputs of higher-order operators run fused (under torch.compile)
        self._fused: set[int] = set()

    @property
    def _depth(self) -> int:
        return getattr(self._nesting, "depth", 0)

    @_depth.setter
    def _depth(self, value: int) -> None:
        self._nesting.depth = value

    @property
    def avoid_device_init(self) -> bool:
        """FakeTensorMode runs an op on real inputs for real (constant propagation) unless it would
        initialise a device; it asks ``torch.cuda.is_available()``, which answers True here. With
        real host tensors, ``real.to("cuda")`` would then reach for the absent GPU."""
        return True if self.host_real else FakeTensorMode.avoid_device_init.fget(self)

    def known_of(self, t) -> _known.Known | None:
        """What every element of ``t`` can be, where that is known without data; else None."""
        if isinstance(t, (bool, int, float)):
            return frozenset({t})
        if not isinstance(t, FakeTensor):
            if self.host_real and _is_real_host(t):
                from torch._subclasses.fake_tensor import unset_fake_temporarily

                with unset_fake_temporarily():
                    return _known.of_real(t)
            return None
        s = t.untyped_storage()
        hit = self._fills.get(id(s))
        if hit is not None and hit[0]() is s:
            return hit[1] if hit[2] == t.dtype else None   # a view as another dtype reads other bits
        c = t.constant   # a scalar or small tensor made by torch.tensor(): FakeTensorMode keeps it
        if c is not None and c.numel() <= _known.MAX_SET:
            return _known.cast(frozenset(c.flatten().tolist()), t.dtype)
        return None

    def fill_of(self, t):
        """The one value every element of ``t`` holds, where it is known without data; else None."""
        return _known.single(self.known_of(t)) if isinstance(t, FakeTensor) else None

    def set_known(self, t, k: _known.Known | None) -> None:
        s = t.untyped_storage()
        k = _known.cast(k, t.dtype)
        if k is None:
            self._fills.pop(id(s), None)
        else:
            self._fills[id(s)] = (weakref.ref(s), k, t.dtype)
            _forget_the_freed(self._fills)

    def _is_truth_of(self, mask, x) -> bool:
        """Whether ``mask`` is ``x.to(bool)`` of ``x`` as it is now (no write since)."""
        if not (isinstance(mask, FakeTensor) and isinstance(x, FakeTensor)):
            return False
        s = mask.untyped_storage()
        hit = self._truths.get(id(s))
        return (hit is not None and hit[0]() is s and hit[1]() is x.untyped_storage() and hit[2] == x._version
                and mask.shape == x.shape and mask.stride() == x.stride() and mask._version == 0)

    def written_outside(self, t) -> None:
        """``t``'s storage was written where no op shows it (a Triton kernel): nothing is known of
        its values any more."""
        self._fills.pop(id(t.untyped_storage()), None)
        if self.shadows is not None:
            self.shadows.forget(t)

    def set_fill(self, t, value) -> None:
        self.set_known(t, frozenset({value}))

    def _track_fills(self, func, args, kwargs, out) -> None:
        k = None
        if isinstance(out, FakeTensor):
            if self.scalar_stand_in and func.overloadpacket in _TRUTH_OPS:
                k = frozenset({_TRUTH_OPS[func.overloadpacket]})
            elif func in _known.MASKED_FILL and self._is_truth_of(args[1], args[0]):
                k = _known.where_truthy(self.known_of(args[0]), args[2])
            elif func in _known.HANDLED:
                k = _known.after_op(func, args, kwargs, out, self.known_of)   # before the op's writes are forgotten
            if func is aten._to_copy.default and out.dtype == torch.bool and isinstance(args[0], FakeTensor):
                s = out.untyped_storage()
                self._truths[id(s)] = (weakref.ref(s), weakref.ref(args[0].untyped_storage()), args[0]._version)
                _forget_the_freed(self._truths)
        if self._fills:
            for i, name in _written_args(func):
                target = args[i] if i < len(args) else kwargs.get(name)
                if isinstance(target, FakeTensor):
                    self._fills.pop(id(target.untyped_storage()), None)
        if k is not None:
            self.set_known(out, k)

    # Higher-order operators (flex_attention, torch.cond, while_loop, scan, ...) look their rule up by
    # the exact type of the mode (torch/_ops.py HigherOrderOperator.dispatch): FakeTensorMode's rules
    # do not match this subclass, and the run stopped at "no rule registered". With this flag they
    # come here, and take FakeTensorMode's rule (_higher_order).
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if errors.UNSETTLED:   # a stop raised since the last op, caught by now: let its frames go
            errors.settle_stops()
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._higher_order(func, types, args, kwargs or {})
        with self._lock:
            try:
                return self._dispatch(func, types, args, kwargs)
            except (DataDependentOutputException, DynamicOutputShapeException) as e:
                note_stop(e)   # a value the data decides: said if the script catches it and goes on
                raise

    def _higher_order(self, func, types, args, kwargs):
        """A higher-order operator under this mode: the rule torch registered for FakeTensorMode (its
        outputs as fake tensors, its inner ops dispatched back here and so recorded: flex_attention's
        output and logsumexp as the fused kernel writes them, not the score matrix an unfused eager
        run would build); one with none stops the run, named. A rule that
        hands the operator back to the mode (``redirect_to_mode``) gets FakeTensorMode's own dispatch."""
        active = self._nesting.__dict__.setdefault("hops", set())
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, FakeTensor)]
        # a backward whose forward was fused (its saved outputs among the arguments) is fused too:
        # torch.compile compiles the backward of what it compiled
        fused = COMPILED[0] or any(self.recorder.live_block(t) in self._fused for t in tensors)
        eager = func._name.startswith("flex_attention") and not fused and func not in active
        kernel = func.py_kernels.get(torch._C.DispatchKey.CompositeExplicitAutograd)
        if eager and kernel is not None:
            # FlexAttention run eagerly (not under torch.compile): torch's own unfused kernel, which
            # builds the whole score matrix (torch warns so); compiled, the fused kernel's outputs
            active.add(func)
            try:
                with self:
                    return kernel(*args, **kwargs)
            finally:
                active.discard(func)
        if func in active:
            return FakeTensorMode.__torch_dispatch__(self, func, types, args, kwargs)
        for cls in type(self).__mro__:
            handler = func.python_key_table.get(cls)
            if handler is not None and cls is not type(self):
                active.add(func)
                try:
                    out = handler(self, *args, **kwargs)
                finally:
                    active.discard(func)
                if fused:   # (its saved outputs reach the backward in other Python objects: by block)
                    self._fused.update(self.recorder.live_block(t) for t in pytree.tree_leaves(out)
                                       if isinstance(t, FakeTensor))
                return out
        from ..errors import NotSupportedHere

        raise NotSupportedHere(f"the higher-order operator {func._name}", "torch registers no fake-tensor rule for it")

    def _dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _PRIM_DEVICE:
            return torch.device("cpu")
        if self.watch is not None and self._depth == 0:
            self.watch(func, args, kwargs)
        if func is aten._local_scalar_dense.default:
            real = self.shadows.read(args[0]) if self.shadows is not None else None
            if real is not None:
                return real.item()   # a value copied from the host: the real one (_shadow.py)
            known = self.fill_of(args[0])
            if known is not None:
                return known   # known without data (or, in dynamic analysis, a healthy run's check)
            if self.scalar_stand_in and isinstance(args[0], FakeTensor):
                t = args[0]
                if t.dtype == torch.bool:
                    passed = check_passed()
                    return passed if passed is not None else False
                return 1.0 if t.is_floating_point() else 1
        if func is aten.equal.default and self.scalar_stand_in and any(isinstance(a, FakeTensor) for a in args[:2]):
            # called from C++ (the Python call has a stand-in of its own: standins._compare):
            # istft's window check, at::is_scalar_tensor_true, compares with a tensor of ones
            a, b = args[0], args[1]
            reals = [self.shadows.read(t) if isinstance(t, FakeTensor) and self.shadows is not None else
                     (None if isinstance(t, FakeTensor) else t) for t in (a, b)]
            if all(r is not None for r in reals):
                return torch.equal(*reals)
            return same_view(a, b)   # (else a stand-in: False)
        if func is aten._to_copy.default and isinstance(args[0], FakeTensor) and args[0].constant is not None:
            args[0].constant = None   # a scalar from torch.tensor(): never run the copy for real
        if func.overloadpacket is aten.to and self.host_real and _is_real_host(args[0]) and \
                any(_names_cuda(a) for a in (*args[1:], *kwargs.values())):
            # Tensor.to("cuda") of a host tensor under inference_mode: no autograd key between, so
            # aten::to reaches the mode whole, and FakeTensorMode's constant propagation would run
            # it for real (it skips only _to_copy to a device). Its own decomposition, as autograd
            # would have taken it (to -> _to_copy), under this mode.
            with self:
                return func.decompose(*args, **kwargs)
        device = kwargs.get("device")
        if device is not None and device.type == "cpu":
            in_backward = torch._C._current_autograd_node() is not None
            from_cuda = args and _is_fake_cuda(args[0])
            factory = not any(isinstance(a, torch.Tensor) for a in args)
            if (from_cuda and (not HOST_COPY[0] or in_backward)) or \
                    (factory and in_backward and not HOST_COPY[0] and not _backward_on_the_host()):
                # a device taken from a fake CUDA tensor's options() in C++ (see the module's
                # docstring; in backward also the zeros autograd makes for an output's
                # undefined gradient, from the output's metadata): on the GPU it is CUDA
                kwargs = dict(kwargs, device=DEVICE)
        if func is aten._grouped_mm.default and _is_fake_cuda(args[0]) and args[0].dtype == torch.float32:
            func, args, kwargs = _grouped_mm_fp32_output(*args, **kwargs)
        outermost = self._depth == 0
        leaves = _op_leaves(args, kwargs) if outermost else ()
        if outermost and any(_tagged(a) for a in leaves):
            args, kwargs = _untagged(args), {k: _untagged(v) for k, v in kwargs.items()}
            leaves = _op_leaves(args, kwargs)
        if outermost and func in _CTC_OPS and _is_fake_cuda(args[0] if func in _CTC_FORWARD else args[1]):
            return self._ctc(func, args, kwargs)
        if self.host_real and outermost and _real_host_op(leaves):
            # host data the script computes on (C++ reached past CudaFactoryMode): real values
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if outermost:
            args, kwargs = self._onto_the_gpu(types, args, kwargs, leaves)
        self._depth += 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            # nonzero, boolean indexing, unique, ... : on values copied from the host, the real shape
            out = self.shadows.run_for_real(func, args, kwargs, self._fake_like) if self.shadows is not None else None
            if out is None and self.host_real:
                out = self._bounded_nonzero(func, types, args)
            if out is None:
                raise
        finally:
            self._depth -= 1
        host_draw = None
        if self.host_real and outermost and torch.Tag.nondeterministic_seeded in func.tags:
            host_draw = _advance_host_generator(func, args, kwargs)
        if not outermost:
            # An op that FakeTensorMode runs as a Python decomposition (native_batch_norm, ...)
            # dispatches its pieces back here. On the GPU it is one kernel: only its outputs are
            # allocations, not the decomposition's intermediates.
            return out
        self._track_fills(func, args, kwargs, out)
        if self.shadows is not None:
            written = [w for w in (args[i] if i < len(args) else kwargs.get(name) for i, name in _written_args(func))
                       if isinstance(w, FakeTensor)]
            self.shadows.after_op(func, args, kwargs, out, written, host_draw)
        CURRENT_OP[0] = func.__name__
        try:
            for t in (out,) if isinstance(out, torch.Tensor) else pytree.tree_leaves(out):   # a tensor is a leaf
                if isinstance(t, FakeTensor):
                    self.recorder.see(t)
            if self.recorder.on_op is not None:
                # after the outputs: a CUDA op allocates its outputs before the library takes its
                # workspace or the kernel its scratch
                self.recorder.on_op(func, args, out)
        finally:
            CURRENT_OP[0] = ""
        return out

    def _bounded_nonzero(self, func, types, args):
        """``nonzero`` of a small device tensor whose values no host data decided (a mask over the
        tokens a model sampled, per sequence: trl's GRPO ``eos_idx[is_eos.any(dim=1)] = ...``; a
        boolean index is nonzero under the hood): every element taken as selected, the most it can
        select, so that what follows from it is the most it can need, and flagged (BOUNDED_MASKS).
        Larger masks (a detector's anchors and proposals) stay data-dependent: their count decides
        much more than a small temporary."""
        t = args[0] if args else None
        if func is not aten.nonzero.default or not isinstance(t, FakeTensor) or t.numel() > BOUNDED_MASK_NUMEL:
            return None
        out = super().__torch_dispatch__(aten.new_empty.default, types, (t, [t.numel(), t.dim()]), {"dtype": torch.int64})
        BOUNDED_MASKS.append(_shadow._script_place())
        return out

    def _lengths(self, lengths) -> list | None:
        """The values of a CTC loss's lengths: a list, a host tensor's, or a device tensor's copied
        from the host (its shadow); None where they are not known here."""
        if isinstance(lengths, (list, tuple)):
            return [int(v) for v in lengths]
        if not isinstance(lengths, FakeTensor):
            return [int(v) for v in lengths.reshape(-1).tolist()]
        real = self.shadows.read(lengths) if self.shadows is not None else None
        return None if real is None else [int(v) for v in real.reshape(-1).tolist()]

    def _ctc(self, func, args, kwargs):
        """CTC loss on the GPU (LossCTC.cu): its forward makes the loss per sequence and log_alpha,
        (batch, T, 2 * max(target_lengths) + 1), a shape the target lengths' values decide, so
        FakeTensorMode stops on it (dynamic output shape). The lengths are the script's: a list,
        host data, or device data copied from the host, whose values are read here. The backward
        makes the gradient (full_like the log-probabilities) and a log_beta like log_alpha, freed
        when it returns (the kernel's smaller scratch for long targets is not counted)."""
        from torch._subclasses.fake_tensor import DynamicOutputShapeException

        if func in _CTC_FORWARD:
            log_probs, target_lengths = args[0], args[3]
            lengths = self._lengths(target_lengths)
            if lengths is None:
                raise DynamicOutputShapeException(func)
            batched = log_probs.dim() == 3
            opts = dict(dtype=log_probs.dtype, device=DEVICE)
            with self:
                nll = torch.empty((log_probs.shape[1],) if batched else (), **opts)
                alpha = torch.empty((log_probs.shape[1] if batched else 1, log_probs.shape[0],
                                     2 * max(lengths, default=0) + 1), **opts)
            return nll, alpha
        log_probs, log_alpha = args[1], args[6]
        with self:
            beta = torch.empty_like(log_alpha, memory_format=torch.contiguous_format)
            grad = torch.full_like(log_probs, float("-inf"), memory_format=torch.contiguous_format)
            del beta
        return grad

    def _onto_the_gpu(self, types, args, kwargs, flat):
        """C++ composite ops build new tensors from ``input.options()``, whose device is the
        answer to prim::device, cpu. On the GPU those tensors are CUDA tensors: give a non-scalar
        fake CPU tensor that meets a fake CUDA tensor in one op CUDA storage (recorded as the
        GPU would allocate it). ``flat``: the op's arguments (_op_leaves)."""
        if not any(_is_fake_cuda(t) for t in flat):
            return args, kwargs
        if not any(((isinstance(t, FakeTensor) and t.fake_device.type == "cpu") or (self.host_real and _is_real_host(t)))
                   and t.dim() > 0 for t in flat):
            return args, kwargs

        def move(t):
            if (isinstance(t, FakeTensor) and t.fake_device.type == "cpu" and t.dim() > 0) or \
                    (self.host_real and _is_real_host(t) and t.dim() > 0):
                new = super(FakeCudaMode, self).__torch_dispatch__(
                    aten.empty_strided.default, (FakeTensor,), (t.shape, t.stride()), {"dtype": t.dtype, "device": DEVICE})
                self.recorder.see(new)
                if self.shadows is not None:
                    self.shadows.copy_from_host(new, t)   # the host values it carries over
                return new
            return t

        return pytree.tree_map(move, (args, kwargs))

    def _fake_like(self, real: torch.Tensor, device) -> FakeTensor:
        """An empty fake tensor of a real one's shape, strides and dtype on ``device``."""
        return super().__torch_dispatch__(aten.empty_strided.default, (FakeTensor,), (real.shape, real.stride()),
                                          {"dtype": real.dtype, "device": device})


def _grouped_mm_fp32_output(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """aten._grouped_mm of fp32 matrices as the CUDA kernel runs it: torch's meta kernel takes
    only bf16 / fp16, but the CUDA op (GroupedBlas.cpp) validates Float32 too
    (GroupedMMUtils.h _grouped_mm_validate_inputs) and runs it on its fallback path, a loop of
    mm_out into slices of one output. transformers' MoE experts call it with fp32 weights under
    AMP. The output is allocated as create_grouped_gemm_output_tensor does: the last dimension's
    stride padded to 16 bytes. Returns the empty_strided call that allocates it."""
    if (out_dtype or mat_a.dtype) != mat_a.dtype or mat_b.dtype != torch.float32 or bias is not None:
        raise RuntimeError("_grouped_mm: fp32 needs fp32 matrices of one dtype, no bias, no other output dtype")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        size = [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]
    elif a2:
        size = [mat_a.shape[0], mat_b.shape[-1]]
    elif b2:
        size = [mat_a.shape[1], mat_b.shape[1]]
    else:
        size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]
    padded = size[:-1] + [-(-size[-1] // 4) * 4]   # 16 bytes of fp32
    stride = [1] * len(padded)
    for i in range(len(padded) - 2, -1, -1):
        stride[i] = stride[i + 1] * padded[i + 1]
    return aten.empty_strided.default, (size, stride), {"dtype": torch.float32, "device": mat_a.device}


def _pin(d):
    """``cuda`` / ``cuda:N`` / torch.device(cuda) / an index N -> cuda:0; anything else unchanged. A
    bare ``cuda`` would make C++ ask the (absent) driver for the current device. A device given as
    an index (``device=local_rank``, ``t.to(gpu)``: DDP scripts' habit) is a CUDA device's in a
    CUDA build of torch (c10::Device from an int is the current accelerator's)."""
    if isinstance(d, str) and (d == "cuda" or d.startswith("cuda:")):
        return DEVICE
    if isinstance(d, torch.device) and d.type == "cuda":
        return DEVICE
    if isinstance(d, int) and not isinstance(d, bool) and d >= 0:
        return DEVICE
    return d


def _on_the_gpu_like(host: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """An empty fake CUDA tensor of a host tensor's shape, strides and dtype: what copying host
    data to the device allocates (values are not needed to trace memory)."""
    out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=DEVICE)
    _carry_known(host, out)   # torch.tensor(0.0, device="cuda"): its value is the script's
    shadows = getattr(getattr(out, "fake_mode", None), "shadows", None)
    if shadows is not None:
        shadows.copy_from_host(out, host)   # and its values, exactly (_shadow.py)
    return out.requires_grad_(requires_grad) if requires_grad else out


def _carry_known(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst`` holds ``src``'s values (a copy between host and device): so does its knowledge."""
    mode = getattr(src, "fake_mode", None)
    known = mode.known_of(src) if isinstance(mode, FakeCudaMode) else None
    if known is not None:
        mode.set_known(dst, known)


class CudaFactoryMode(torch.overrides.TorchFunctionMode):
    """Keeps C++ from reaching for a real GPU:
    - ``torch.tensor(data, device='cuda')`` copies host data to the device in C++, past the fake
      mode: build the host tensor, then an empty fake CUDA tensor of its shape (values are not
      needed to trace memory);
    - ``t.cuda()``, ``t.to('cuda')`` and ``device='cuda'`` name the device ``cuda:0``.
    (scaled_dot_product_attention takes the GPU's kernel in a dispatcher kernel, _sdpa_kernel, so
    that calls from inside other functions and autocast's cast come first, as on the GPU.)

    With ``host_real`` (dynamic analysis: a user's whole script runs here) host code runs for
    real: a call whose tensors are all real and that names no CUDA device runs with the fake mode
    set aside, so data loading, index sampling, numpy interop and metrics see real values. Two
    exceptions: tensors a module builds in its constructor with no tensor input (a model's
    weights, before ``.cuda()``) stay fake host tensors, as the weights' values are not needed and
    a 7-billion-parameter model built on the host would not fit in its memory; and a few random
    numbers drawn on the host keep the deterministic answers described in __torch_function__."""

    def __init__(self, host_real: bool = False):
        super().__init__()
        self.host_real = host_real

    FACTORIES = (torch.tensor, torch.as_tensor, torch.asarray)
    HOST_RANDOM = (torch.rand, torch.randn, torch.randint, torch.randperm)
    HOST_RANDOM_MAX_NUMEL = 64

    def _host_generator(self) -> torch.Generator:
        if getattr(self, "_generator", None) is None:
            self._generator = torch.Generator().manual_seed(0)
        return self._generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        truth = _TRUTH_FUNCTIONS.get(getattr(func, "__name__", None))
        if truth is not None and args and _is_fake_cuda(args[0]):
            out = func(*args, **kwargs)   # composite: decomposed below, so it is marked here
            if isinstance(out, FakeTensor) and getattr(out.fake_mode, "scalar_stand_in", False):
                out.fake_mode.set_fill(out, truth)
            return out
        if func in (torch.ctc_loss, torch.nn.functional.ctc_loss) and len(args) >= 4 and _is_fake_cuda(args[0]) \
                and any(isinstance(a, (list, tuple)) for a in args[2:4]):
            # lengths as lists: ATen's composite makes a tensor of them from its output's options
            # (at::tensor, a copy into a fake storage, which fails); as host tensors the composite
            # takes its path for tensor subclasses, to the same kernel (_ctc)
            args = (*args[:2], *(torch.tensor(a, dtype=torch.long) if isinstance(a, (list, tuple)) else a
                                 for a in args[2:4]), *args[4:])
            return func(*args, **kwargs)
        if func is torch.Tensor.__deepcopy__ and isinstance(args[0], FakeTensor):
            return _deepcopy_fake(*args)
        if func is torch.Tensor.__deepcopy__ and not _fake_at_heart(args[0]):
            # a host tensor copied beside fake ones (deepcopy's memo holds them: a model's EMA copy
            # with a plain tensor attribute, ultralytics' stride): a real copy of real data
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func == _SET_DATA and len(args) == 2:
            return _set_data(*args)
        if func is torch.Tensor.share_memory_ and isinstance(args[0], FakeTensor):
            # a no-op for CUDA tensors (shared across processes by CUDA IPC instead; _tensor.py);
            # a fake host tensor has no data to move (nn.Module.share_memory, Hogwild scripts)
            return args[0]
        dev = kwargs.get("device")
        if dev is None and self.host_real:
            # torch.set_default_device("cuda") (and the legacy default tensor type): its
            # DeviceContext sits at the bottom of the mode stack, below this mode, and would name
            # the device only after this mode took the factory for a host one (a real CUDA call)
            default = _device_mod.CURRENT_DEVICE
            if default is not None and default.type == "cuda" and func in _device_mod._device_constructors():
                kwargs = dict(kwargs, device=default)
                dev = default
        if dev is not None:
            pinned = _pin(dev)
            if pinned is not dev:
                kwargs = dict(kwargs, device=pinned)
        if self.host_real and func not in self.HOST_RANDOM and _host_call(func, args, kwargs):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            if not (_no_tensor_input(args, kwargs) and _in_module_constructor()):
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            # a module's weights made on the host stay fake (no host memory for a large model), but
            # one with no elements holds nothing: real, so that a Parameter subclass can wrap it
            # (nn.Lazy* modules' UninitializedParameter: _make_subclass of torch.empty(0))
            out = func(*args, **kwargs)
            if isinstance(out, FakeTensor) and out.numel() == 0 and out.fake_device.type == "cpu":
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            return out
        if func in self.FACTORIES and kwargs.get("device") is DEVICE:
            kwargs = dict(kwargs)
            kwargs.pop("device")
            requires_grad = kwargs.pop("requires_grad", False)
            return _on_the_gpu_like(func(*args, **kwargs), requires_grad)
        if func is torch.Tensor.cuda:
            device = _pin(args[1]) if len(args) > 1 and args[1] is not None else DEVICE
            if isinstance(device, int):
                device = DEVICE
            func, args = torch.Tensor.to, (args[0], device)   # Tensor.cuda() is to(cuda) (TensorConversions.cpp)
            kwargs = {"non_blocking": kwargs.get("non_blocking", False),
                      "memory_format": kwargs.get("memory_format", torch.preserve_format)}
        if func is torch.Tensor.to and _to_aliases(args, kwargs):
            return args[0]
        if func in self.HOST_RANDOM and self.host_real and _host_call(func, args, kwargs) and not _in_module_constructor():
            # the script's host draws outside a module's constructor are real, as below, drawn at
            # once (the fake draw that sized them first took 0.7 ms each: DINOv2's sampler draws
            # one per sample of its data set)
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func in self.HOST_RANDOM:
            out = func(*args, **kwargs)
            small = isinstance(out, FakeTensor) and out.fake_device.type == "cpu" and out.numel() <= self.HOST_RANDOM_MAX_NUMEL
            if self.host_real and not small and _host_call(func, args, kwargs):
                from torch._subclasses.fake_tensor import unset_fake_temporarily

                constructing = _in_module_constructor()
                if not constructing or _spend_draws(out.numel()):
                    with unset_fake_temporarily():
                        real = func(*args, **kwargs)
                    if not constructing:
                        return real
                # a module's weight stays fake; its draw was made, as the job's host generator
                # makes it (_advance_host_generator)
                return out
            if small:
                # A few random numbers drawn on the host steer the step: LayerDrop,
                # `if torch.rand([]) < layerdrop: skip the layer` (transformers' Wav2Vec2 and
                # HuBERT, layerdrop 0.1; 4.x in most models). They are no data and take no device
                # memory. A long run reaches the step that keeps every layer, the one with the
                # most memory (Wav2Vec2's 12 layers all run in 0.9^12 = 28% of its steps), so
                # torch.rand answers with the top of its range, below 1, which drops nothing;
                # other draws come from a generator of fixed seed, so that an estimate repeats.
                # A user's script (host_real) draws them all from its own generators, as the job
                # does and as its Python and NumPy draws are (cuda_answers): a sampler's
                # permutation (accelerate's SeedableRandomSampler seeds a generator of its own),
                # an index drawn for a crop or a batch; the traced steps see the job's batches.
                from torch._subclasses.fake_tensor import unset_fake_temporarily

                with unset_fake_temporarily():
                    if self.host_real:
                        return func(*args, **kwargs)
                    if func is torch.rand:
                        dtype = kwargs.get("dtype") or torch.get_default_dtype()
                        top = torch.nextafter(torch.tensor(1.0, dtype=dtype), torch.tensor(0.0, dtype=dtype))
                        real = torch.full(tuple(out.shape), top.item(), dtype=dtype)
                    else:
                        real = func(*args, **dict(kwargs, generator=self._host_generator()))
                return torch.tensor(real.tolist(), dtype=real.dtype)
            return out
        if func is torch.Tensor.new_tensor and _is_fake_cuda(args[0]) and kwargs.get("device", DEVICE) is DEVICE:
            # like torch.tensor(data, device='cuda'): the host data would be copied to a real GPU
            kwargs = dict(kwargs)
            kwargs.pop("device", None)
            requires_grad = kwargs.pop("requires_grad", False)
            host = torch.tensor(*args[1:], **dict(kwargs, dtype=kwargs.get("dtype") or args[0].dtype))
            return _on_the_gpu_like(host, requires_grad)
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0],) + tuple(_pin(a) for a in args[1:])
        if _targets_host(func, args, kwargs):
            shadows = getattr(args[0].fake_mode, "shadows", None)
            real = shadows.host_copy(args[0], lambda r: func(r, *args[1:], **kwargs)) if shadows is not None else None
            if real is not None:
                return real   # values copied from the host come back as they went (_shadow.py)
            HOST_COPY[0] += 1
            try:
                out = func(*args, **kwargs)
            finally:
                HOST_COPY[0] -= 1
            if out is args[0] and not (out.requires_grad and torch.is_grad_enabled()):
                # C++ took the copy for a no-op (it reads the device as cpu). On the GPU the
                # script gets a new host tensor, and the device tensor can be freed without it.
                host = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="cpu")
                _carry_known(out, host)
                return host
            return out
        return func(*args, **kwargs)


_SET_DATA = torch.Tensor.data.__set__   # `t.data = v` (a new method-wrapper each time: compared with ==)


def _set_data(target, value):
    """``target.data = value`` where one of the two is a fake host tensor (a module's weights made
    on the host are fake) and the other a real one (weights a checkpoint file gave: from_pretrained,
    torch.load): the value made of the target's kind, so the parameter stays what it was.
    transformers' ``resize_token_embeddings`` after ``from_pretrained`` ends with ``old.weight.data =
    new.weight.data`` (a fake new embedding into the real loaded one): the real parameter takes real
    zeros of the new shape (a fake value has none; the job's values decide no device memory); a
    real tensor assigned into a fake weight (a state dict copied in by hand) becomes fake, as the
    fake mode converts any real tensor it meets."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
        if isinstance(target, FakeTensor) and not _fake_at_heart(value):
            value = target.fake_mode.from_tensor(value)
        elif isinstance(value, FakeTensor) and not _fake_at_heart(target) and value.fake_device.type == "cpu":
            with unset_fake_temporarily():
                value = torch.zeros(value.shape, dtype=value.dtype, requires_grad=value.requires_grad)
    with unset_fake_temporarily():
        return _SET_DATA(target, value)


def release_moved(old: torch.Tensor, new: torch.Tensor) -> None:
    """The parameter a module conversion replaced (Module._apply's stand-in makes a new object) lets
    its device memory go, as on a GPU, where it is the moved one (the conversion swaps its data):
    its data becomes the new value's (shared; a fake host copy where the model went to the host) and
    its gradient goes. Held by the last step's graph (AccumulateGrad keeps its leaf) or by a list of
    the script's, the old weights and gradient were counted beside the new ones: a CycleGAN that
    saves with ``net.cpu()`` then ``net.cuda()`` was estimated a model's weights high."""
    if not isinstance(old, FakeTensor) or old is new:
        return
    try:
        with torch.no_grad():
            old.grad = None
            _set_data(old, new)
    except RuntimeError:
        pass   # (a kind the data cannot be swapped between: the old object stays as it was)


def _tagged(t) -> bool:
    """A host tensor of a Python subclass that only tags it (torchvision's tv_tensors, fastai's
    TensorImage, MONAI's MetaTensor): its own __torch_function__ perhaps, no __torch_dispatch__.
    Such a subclass reaches the dispatch as itself (its __torch_function__ calls the op on it), and
    FakeTensorMode refuses every tensor subclass it does not know ("Multiple dispatch failed")."""
    return (isinstance(t, torch.Tensor) and type(t) is not torch.Tensor and not isinstance(t, (FakeTensor, torch.nn.Parameter))
            and type(t).__torch_dispatch__ is torch._C._disabled_torch_dispatch_impl)


def _untagged(a):
    """``a`` with its tagged host tensors as plain ones (an alias: the same storage, no copy): at
    the dispatch the tag decides nothing, the op's result is made of the data."""
    if isinstance(a, (list, tuple)):
        return type(a)(_untagged(x) for x in a) if any(_tagged(x) for x in a) else a
    return a.as_subclass(torch.Tensor) if _tagged(a) else a


def _call_leaves(args, kwargs):
    """The leaves of a torch function's arguments, as pytree's tree_leaves finds them (lists, tuples,
    dicts, nested), without its per-node registry lookups: it ran on every host op of a script (a
    sampler's index arithmetic, a transform's), several times, and cost more than the op."""
    stack = [kwargs, args]
    while stack:
        node = stack.pop()
        if isinstance(node, (list, tuple)):
            stack.extend(reversed(node))
        elif isinstance(node, dict):
            stack.extend(reversed(list(node.values())))
        else:
            yield node


def _host_call(func, args, kwargs) -> bool:
    """Whether a torch function call computes on the host only: no fake tensor among its
    arguments and no CUDA device asked for (``device=``, ``.to("cuda")``, ``.cuda()``)."""
    if func is torch.Tensor.cuda:
        return False
    for a in _call_leaves(args, kwargs):
        if _fake_at_heart(a) or _names_cuda(a):
            return False
    if func is torch.Tensor.to:
        try:
            device = parse_to(*args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})[0]
        except (TypeError, RuntimeError):
            return True
        return device is None or torch.device(device).type != "cuda"
    return True


def _no_tensor_input(args, kwargs) -> bool:
    return not any(isinstance(a, torch.Tensor) for a in _call_leaves(args, kwargs))


def _in_module_constructor() -> bool:
    """Whether the call comes from inside an ``nn.Module``'s ``__init__`` (any frame up the stack)."""
    import sys

    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "__init__" and isinstance(f.f_locals.get("self"), torch.nn.Module):
            return True
        f = f.f_back
    return False


def _to_aliases(args, kwargs) -> bool:
    """Whether ``Tensor.to(...)`` returns the tensor itself, as ATen's to() does when nothing changes
    (to_will_alias: same device, dtype and memory format, copy=False): ``x.to(x.device)``,
    ``mask.to("cuda")`` on a tensor already on the GPU. C++ reads a fake CUDA tensor's device as
    the host's (see the module docstring), so it would make a copy that the GPU run never makes."""
    x = args[0]
    if not _is_fake_cuda(x) or kwargs.get("copy", False):
        return False
    rest = {k: v for k, v in kwargs.items() if k != "copy"}
    try:
        device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **rest)
    except (TypeError, RuntimeError):
        return False
    if device is not None and torch.device(device).type != "cuda":
        return False
    if dtype is not None and dtype != x.dtype:
        return False
    return memory_format in (None, torch.preserve_format) or x.is_contiguous(memory_format=memory_format)


def is_fake(t) -> bool:
    """A fake tensor on the host or the device (not a meta tensor the script made itself)."""
    return isinstance(t, FakeTensor) and t.fake_device.type != "meta"


def storage_key(t: FakeTensor) -> int:
    """An id of a fake tensor's storage, the same for every view of it while it lives: the address
    of its StorageImpl (``_cdata``), which no data buffer of a real tensor has."""
    return t.untyped_storage()._cdata


_FAKE_SUBCLASSES: dict = {}


def _fake_subclass(cls: type) -> type:
    """A class that is ``cls`` to the script and FakeTensor to torch (``cls`` first in its MRO)."""
    made = _FAKE_SUBCLASSES.get(cls)
    if made is None:
        made = _FAKE_SUBCLASSES[cls] = type(cls.__name__, (cls, FakeTensor), {"__module__": cls.__module__,
                                                                          "__qualname__": cls.__qualname__})
    return made


# A fake tensor's own fields (FakeTensor.__new__), and the run's fake mode (FakeCudaMode.__init__)
_MEMOS = ("nonzero_memo", "item_memo", "unique_memo", "unique_consecutive_memo", "nested_int_memo")
_FAKE_FIELDS = frozenset({"_fake_device", "fake_mode", "constant", "pytype", "dispatch_keys", "real_tensor"}
                         | {f"_{m}{s}" for m in _MEMOS for s in ("", "_vc", "_epoch")})
_RUN_MODE: list = [None]


def _fake_fields_restored(self, name):
    """FakeTensor's ``__getattr__`` while fake CUDA is on (called only for an attribute not found):
    a library that copies another tensor's ``__dict__`` over a tensor's own (fastai's
    ``Tensor.set_meta``, after every op of its TensorBase) wiped a fake tensor's fields, and the next
    op found no device. They are made again as FakeTensor.__new__ makes them: the device its
    dispatch keys carry (the backend key of the device it was made for), the run's fake mode, no
    constant and empty memos."""
    if name not in _FAKE_FIELDS or _RUN_MODE[0] is None or self.__dict__.get("_vest_restoring"):
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
    self.__dict__["_vest_restoring"] = True
    try:
        keys = str(torch._C._dispatch_keys(self))
        self.fake_device = torch.device("cuda", 0) if "CUDA" in keys else torch.device("meta" if "Meta" in keys else "cpu")
        self.fake_mode, self.constant, self.pytype, self.dispatch_keys, self.real_tensor = _RUN_MODE[0], None, None, None, None
        for memo in _MEMOS:
            setattr(self, memo, None)
    finally:
        del self.__dict__["_vest_restoring"]
    return object.__getattribute__(self, name)


if "__getattr__" not in vars(FakeTensor):   # (only asked for what is not found: no cost on any other lookup)
    FakeTensor.__getattr__ = _fake_fields_restored


def subclasses_of_fake_tensors() -> list:
    """Patches (obj, attr, new): ``torch.Tensor._make_subclass(cls, data)`` and ``as_subclass(cls)`` of a
    fake tensor. A
    library's parameter class that wraps a weight with it (bitsandbytes' Params4bit and Int8Params
    for QLoRA and 8-bit training, a script's own Parameter subclass) failed on a fake weight: its
    TensorImpl already has a Python object, the FakeTensor. The wrapper is a detached alias of the
    fake tensor whose class is ``cls`` and FakeTensor at once (_fake_subclass): the library's own
    methods (``.cuda()`` quantizing through bitsandbytes' ops, which have fake kernels) run on it,
    and torch dispatches its ops to the fake mode as any fake tensor's."""
    real = torch.Tensor._make_subclass

    def make_subclass(cls, data, requires_grad=False, **kwargs):
        if not isinstance(data, FakeTensor) or issubclass(cls, FakeTensor) or kwargs:
            return real(cls, data, requires_grad, **kwargs)
        out = data.detach()
        out.requires_grad_(requires_grad)
        out.__class__ = _fake_subclass(cls)
        return out

    real_new = FakeTensor.__new__

    def new(cls, *args, **kwargs):
        if cls is FakeTensor and args and isinstance(args[0], torch.Tensor):
            # type(param)(data, requires_grad=...): a parameter rebuilt with its own class
            # (accelerate's set_module_tensor_to_device, which every diffusers from_pretrained
            # runs); a fake parameter's class is FakeTensor (nn.Parameter keeps a subclass's).
            # Other keywords are the fake tensor's own fields (accelerate's init_empty_weights
            # passes the parameter's __dict__), which a parameter's __dict__ would not hold
            grad = kwargs.get("requires_grad", args[1] if len(args) > 1 else True)
            return torch.nn.Parameter(args[0], requires_grad=bool(grad))
        return real_new(cls, *args, **kwargs)

    real_as = torch.Tensor.as_subclass

    def as_subclass(self, cls):
        # Tensor.as_subclass(cls) of a fake tensor (torchvision's tv_tensors.wrap, a tv_tensor kept
        # through .to("cuda") / .clone(); fastai's TensorBase): torch gives cls's Python object to an
        # alias of the tensor, which for a fake one already is a FakeTensor; refused so. The alias,
        # attached to the graph as torch's is, takes a class that is cls and FakeTensor at once
        # (its __torch_function__ cls's, its dispatch the fake mode's)
        # (torch's own alias is made past the fake mode: as_subclass(torch.Tensor) of a fake tensor,
        # a tv_tensor unwrapped, gave a tensor of no mode on the CUDA device, which autograd's engine
        # then took for a real GPU's)
        if not isinstance(self, FakeTensor):
            # a host tensor (real): its alias made by torch itself, past the fake mode, which would
            # hand back a tensor that has its Python object already; of the script's class where it
            # was asked for a fake tensor's (fastcore's retain_type: type(a device tensor))
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            if isinstance(cls, type) and issubclass(cls, FakeTensor):
                cls = next((c for c in cls.__mro__[1:] if not issubclass(c, FakeTensor)), torch.Tensor)
            with unset_fake_temporarily():
                return real_as(self, cls)
        with torch._C.DisableTorchFunctionSubclass():
            out = self.view_as(self)
        out.__class__ = FakeTensor if issubclass(FakeTensor, cls) else cls if issubclass(cls, FakeTensor) else _fake_subclass(cls)
        return out

    return [(torch.Tensor, "_make_subclass", staticmethod(make_subclass)), (FakeTensor, "__new__", staticmethod(new)),
            (torch.Tensor, "as_subclass", as_subclass)]


def fake_pointers() -> list:
    """Patches (obj, attr, new): ``data_ptr()`` of fake tensors and of their storages, distinct per
    storage as a GPU's are. Fake storages are meta storages, whose data pointer is 0 for all;
    libraries that find tied weights or shared tensors by pointer (safetensors, transformers'
    save_pretrained, accelerate) would take every weight for one. Never dereferenced: a fake
    tensor's bytes are never read (checkpoints.py writes files of fake tensors without data)."""
    tensor_ptr, storage_ptr = torch.Tensor.data_ptr, torch.UntypedStorage.data_ptr

    def data_ptr(self):
        if is_fake(self) and self.untyped_storage().nbytes():
            return storage_key(self) + self.storage_offset() * self.element_size()
        return tensor_ptr(self)

    def storage_data_ptr(self):
        # a storage does not say whose it is: every meta storage gets its address (a script's own
        # meta tensors too, at storage level; their tensors' data_ptr stays 0)
        if self.device.type == "meta" and self.nbytes():
            return self._cdata
        return storage_ptr(self)

    return [(torch.Tensor, "data_ptr", data_ptr), (torch.UntypedStorage, "data_ptr", storage_data_ptr)]


def real_host():
    """A context in which torch calls make real tensors, the fake mode set aside (host data)."""
    return torch._subclasses.fake_tensor.unset_fake_temporarily()


def device_identity() -> list:
    """Patches (obj, attr, new): what a fake CUDA tensor says of its device when asked in Python.
    ``t.device`` is FakeTensor's own (cuda:0), but ``is_cuda``, ``is_cpu``, ``get_device()`` and
    ``type()`` read the C++ tensor, which answers as the host (see the module docstring): a
    script's ``if x.is_cuda:`` or ``torch.cuda.device(x.get_device())`` would take the host's
    branch. They answer as on the GPU here; every other tensor is asked as before."""
    is_cuda, is_cpu = torch.Tensor.is_cuda, torch.Tensor.is_cpu
    get_device, type_ = torch.Tensor.get_device, torch.Tensor.type
    _cuda = _is_fake_cuda

    def type_of(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = type_(self)   # (torch's function handling may come back here: add "cuda" once)
            return name.replace("torch.", "torch.cuda.", 1) if _cuda(self) and not name.startswith("torch.cuda.") \
                else name
        legacy = torch._utils._import_dotted_name(dtype) if isinstance(dtype, str) else dtype
        if isinstance(legacy, type) and hasattr(legacy, "is_cuda") and not getattr(legacy, "is_sparse", False):
            # x.type(torch.cuda.FloatTensor): a copy to that device and dtype (torch/_utils.py _type);
            # C++ would reach for the driver, or see a fake CUDA tensor as the host's
            return self.to(DEVICE if legacy.is_cuda else "cpu", legacy.dtype, non_blocking=non_blocking)
        return type_(self, dtype, non_blocking, **kwargs)

    return [(torch.Tensor, "is_cuda", property(lambda self: True if _cuda(self) else is_cuda.__get__(self))),
            (torch.Tensor, "is_cpu", property(lambda self: False if _cuda(self) else is_cpu.__get__(self))),
            (torch.Tensor, "get_device", lambda self: self.fake_device.index or 0 if _cuda(self) else get_device(self)),
            (torch.Tensor, "type", type_of)]


def cudnn_rnn_flatten_weight(weight_arr, weight_stride0, input_size, mode, hidden_size, proj_size, num_layers,
                             batch_first, bidirectional):
    """cuDNN's weight flattening (aten/src/ATen/native/cudnn/RNN.cpp, _cudnn_rnn_flatten_weight, which
    nn.LSTM/GRU/RNN's flatten_parameters calls once their weights say ``is_cuda``: device_identity),
    which has no fake kernel: one buffer holding every weight, each parameter then a view of it
    (set_orig_weights_to_flat_buf), so the parameters' own storages are freed. Sized as the sum of
    the weights (cuDNN's weight space packs them; cudnnGetRNNWeightSpaceSize may add alignment).
    The live oracle (dynamic/live_oracle.py) runs it on real host weights."""
    with torch.no_grad():
        total = sum(w.numel() for w in weight_arr)
        buf = weight_arr[0].new_empty(total)
        offset = 0
        for w in weight_arr:
            n = w.numel()
            buf[offset:offset + n].copy_(w.reshape(-1))
            w.set_(buf.untyped_storage(), offset, w.size())
            offset += n
    return buf


def fake_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """A new fake uint8 tensor of ``nbytes`` on ``device`` (dynamic analysis, the fake mode active):
    on the GPU an allocation the recorder sees, as a real one would be; on the host a fake tensor,
    as a model's weights built on the host are (no host memory), not the real one the host_real
    factories would make."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    with real_host():
        meta = torch.empty(nbytes, dtype=torch.uint8, device="meta")
    return mode.fake_tensor_converter.from_meta_and_device(mode, meta, torch.device("cpu"))


def _deepcopy_fake(t: FakeTensor, memo: dict):
    """copy.deepcopy of a fake tensor (EMA copies of a model, torchmetrics' default states): a clone
    on the same device, as on a GPU. Tensor.__deepcopy__ would rebuild the storage from its bytes,
    which a fake tensor does not have."""
    if id(t) in memo:
        return memo[id(t)]
    with torch.no_grad():
        new = t.clone(memory_format=torch.preserve_format)
    if isinstance(t, torch.nn.Parameter):
        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
    elif t.requires_grad:
        new.requires_grad_(True)
    memo[id(t)] = new
    return new


# ---- SDPA backend choice as the GPU makes it (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) ----
# scaled_dot_product_attention picks its kernel from the C++ device of the query, which here is the
# CPU: the CPU's choice (math, saving the S x S attention) would stand in for the GPU's flash or
# memory-efficient kernels (saving only the log-sum-exp). The choice is made here as on the GPU.
SDP_MATH, SDP_FLASH, SDP_EFFICIENT, SDP_CUDNN = "math", "flash", "efficient", "cudnn"
# torch's SDPBackend numbers (torch.nn.attention.SDPBackend) in its priority list, and the list it
# starts with (Context.h sdp_priority_order: flash, efficient, math, cudnn, overrideable)
_SDP_NUMBERED = {0: SDP_MATH, 1: SDP_FLASH, 2: SDP_EFFICIENT, 3: SDP_CUDNN}
_SDP_DEFAULT_ORDER = (1, 2, 0, 3, 4)


def _sdp_order(capability) -> list[str]:
    """The order torch tries the SDPA kernels in (sdp_utils.cpp ``priority_order``): the script's own
    (``sdpa_kernel(backends, set_priority=True)``, ``torch._C._set_sdp_priority_order``), or torch's
    default, which torch itself changes once, at its first attention on the GPU, to cuDNN first
    where it prefers cuDNN's kernel (``check_prefer_cudnn_attention``: _prefers_cudnn_sdpa)."""
    get = getattr(torch._C, "_get_sdp_priority_order", None)
    order = tuple(get()) if get is not None else _SDP_DEFAULT_ORDER
    if order == _SDP_DEFAULT_ORDER and _prefers_cudnn_sdpa(capability):
        order = (3, 1, 2, 0)
    return [_SDP_NUMBERED[n] for n in order if n in _SDP_NUMBERED]


def _cudnn_version() -> int:
    """The cuDNN of the torch running the script (``torch.backends.cudnn.version()``: 92400 for 9.24),
    0 where it has none."""
    try:
        return int(torch.backends.cudnn.version() or 0)
    except (RuntimeError, TypeError, ValueError):
        return 0


def _prefers_cudnn_sdpa(capability) -> bool:
    """Whether torch puts cuDNN's attention first on this GPU (sdp_utils.cpp
    ``check_prefer_cudnn_attention``, torch >= 2.9): datacenter Hopper and Blackwell (sm90, sm100,
    and with CUDA before 13 only minor 0 or 3), a cuDNN newer than 9.15.0, unless
    TORCH_CUDNN_SDPA_DEPRIORITIZED is set."""
    import os

    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().upper() in ("1", "ON", "TRUE", "YES", "Y"):
        return False
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    cuda = tuple(int(p) for p in (torch.version.cuda or "0").split(".")[:1] if p.isdigit())
    major, minor = tuple(capability)[:2]
    return (version >= (2, 9) and _cudnn_version() > 91500 and major in (9, 10)
            and (cuda >= (13,) or minor in (0, 3)))


def _cudnn_sdpa_ok(capability, query, key, value, dropout_p, grads: bool) -> bool:
    """Whether cuDNN's attention takes these inputs (sdp_utils.cpp ``can_use_cudnn_attention``:
    enabled, not deterministic algorithms, fp16/bf16 on sm80-sm121, dropout a multiple of 1/16,
    batch and heads up to 65535, head dims a multiple of 8 and at most 128 (256 on sm90/sm10x with
    cuDNN 9.22+, 192/128 from 9.11), a key sequence longer than 1, key and value heads dividing
    the query's; with gradients on the d256 cuDNN, backward head dims <= 128, 192/128 or 256/256)."""
    if not _sdp_enabled("cudnn") or query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return False
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    cudnn = _cudnn_version()
    cap = tuple(capability)[:2]
    if (cudnn < 90000 or not (8, 0) <= cap <= (12, 1) or query.dtype not in (torch.float16, torch.bfloat16)
            or dropout_p * 16 != math.floor(dropout_p * 16) or (dropout_p > 0 and 91100 < cudnn < 91400)):
        return False
    batch, heads, seq_q, d_qk = query.shape
    seq_k, d_v = key.shape[-2], value.shape[-1]
    k_heads, v_heads = key.shape[-3], value.shape[-3]
    if batch > 65535 or heads > 65535 or k_heads != v_heads or heads % k_heads or seq_k == 1:
        return False
    if dropout_p > 0 and seq_q == 1:
        return False
    hopper_on = (cap[0] == 9 and cap[1] == 0) or cap[0] == 10
    d256 = hopper_on and not (cap == (10, 7) and cudnn <= 92500) and cudnn > 92200
    limit = 256 if d256 else 192 if hopper_on and cudnn >= 91100 and (d_qk, d_v) == (192, 128) else 128
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    return not (grads and d256 and not ((d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))))


def installed_sdp_broadcasts_one_kv_head(header: str | None = None) -> bool:
    """Whether the installed torch's fused attention kernels take a key and value of one head for
    a query of many without ``enable_gqa`` (multi-query attention: ``supports_mqa`` in
    sdp_utils_cpp.h ``check_batch_size_and_num_heads_dense``, torch's own header); False where
    the header is absent or has no such rule (older torch: such a call runs the math kernel)."""
    text = _torch_header(header, "ATen", "native", "transformers", "sdp_utils_cpp.h")
    return text is not None and "supports_mqa" in text and "k_num_heads == 1 && v_num_heads == 1" in text


SDP_BROADCASTS_ONE_KV_HEAD = installed_sdp_broadcasts_one_kv_head()


def _sdp_enabled(name: str) -> bool:
    """Whether the script left this backend on: torch.backends.cuda.enable_flash_sdp(False),
    ``with sdpa_kernel(SDPBackend.MATH)`` (plain setters of torch's global context, no GPU)."""
    return getattr(torch.backends.cuda, f"{name}_sdp_enabled")()


def gpu_sdp_choice(capability: tuple[int, int], query, key, value, attn_mask, dropout_p, enable_gqa,
                   is_causal: bool = False) -> str:
    """The backend torch's select_sdp_backend picks on a GPU of this capability: the first in its
    priority order (_sdp_order: flash, memory-efficient, math, cuDNN by default; cuDNN first where
    torch prefers it; the script's own order) that the script left enabled and that takes the
    inputs (cuDNN: _cudnn_sdpa_ok). Flash: fp16/bf16 on sm80+, no explicit mask, one head dim for q, k and v of at most 256 (one not
    a multiple of 8 is padded: _gpu_sdpa), no causal mask over a non-square score matrix, not a head
    dim over 192 that needs gradients on sm86/89/120. Memory-efficient: any float dtype but fp64 (bf16
    from sm80: ``less_than_sm80_mem_efficient_dtypes``), masks allowed, q and k of one head dim,
    head dims a multiple of the GEMM alignment (minimum_gemm_alignment: 8 for fp16/bf16, 4 for fp32
    from sm80, 1 for fp32 before), sm50+. With ``enable_gqa`` (torch >= 2.5) key and value may have
    fewer heads than the query, a divisor of its heads: flash and memory-efficient attention take
    them as they are (``check_batch_size_and_num_heads_dense`` with GQA support), and newer torch
    takes a key and value of one head so without it (SDP_BROADCASTS_ONE_KV_HEAD). None enabled that
    can run: torch's "No available kernel" error."""
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    fused = None
    for backend in _sdp_order(capability):
        if backend == SDP_MATH and _sdp_enabled("math"):
            return SDP_MATH
        if backend == SDP_CUDNN and _cudnn_sdpa_ok(capability, query, key, value, dropout_p, grads):
            return SDP_CUDNN
        if backend in (SDP_FLASH, SDP_EFFICIENT):
            fused = fused if fused is not None else _fused_sdp_ok(capability, query, key, value, attn_mask, enable_gqa,
                                                                  is_causal, grads)
            if backend in fused:
                return backend
    raise errors.FailsOnAGpu(
        "No available kernel. Aborting execution. (scaled_dot_product_attention: none of the kernels the script "
        f"left enabled takes these inputs on a GPU of capability {'.'.join(map(str, tuple(capability)[:2]))}: "
        f"{query.dtype} query of shape {tuple(query.shape)}{', a mask' if attn_mask is not None else ''}; "
        "enable the math kernel, or give the fused kernels fp16/bf16 inputs without a mask)")


def _fused_sdp_ok(capability, query, key, value, attn_mask, enable_gqa, is_causal, grads: bool,
                  switches: bool = True) -> set:
    """Which of flash and memory-efficient attention take these inputs (gpu_sdp_choice); with
    ``switches=False``, whether the script left them on or not."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return set()
    q_heads, k_heads, v_heads = query.shape[-3], key.shape[-3], value.shape[-3]
    if not (q_heads == k_heads == v_heads
            or (enable_gqa and k_heads == v_heads and q_heads % k_heads == 0)
            or (SDP_BROADCASTS_ONE_KV_HEAD and k_heads == v_heads == 1)):
        return set()
    head_dim = query.shape[-1]
    half = query.dtype in (torch.float16, torch.bfloat16)
    same_dims = key.shape[-1] == head_dim and value.shape[-1] == head_dim
    ok = set()
    if ((_sdp_enabled("flash") or not switches) and half and attn_mask is None and same_dims and head_dim <= 256
            and capability >= (8, 0)
            and not (is_causal and query.shape[-2] != key.shape[-2])
            and not (grads and head_dim > 192 and tuple(capability) in ((8, 6), (8, 9), (12, 0)))):
        ok.add(SDP_FLASH)
    align = 8 if half else 4 if capability >= (8, 0) else 1
    if (_sdp_enabled("mem_efficient") and key.shape[-1] == head_dim and head_dim % align == 0
            and value.shape[-1] % align == 0 and capability >= (5, 0) and query.dtype != torch.float64
            and (query.dtype != torch.bfloat16 or capability >= (8, 0))):
        ok.add(SDP_EFFICIENT)
    return ok


def _gpu_sdpa(capability, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """scaled_dot_product_attention as the GPU of this capability runs it (gpu_sdp_choice)."""
    choice = gpu_sdp_choice(capability, query, key, value, attn_mask, dropout_p, enable_gqa, is_causal)
    if choice == SDP_CUDNN and SDP_FLASH in _fused_sdp_ok(capability, query, key, value, attn_mask, enable_gqa, is_causal,
                                                          torch.is_grad_enabled(), switches=False):
        # cuDNN's attention runs FlashAttention-2's algorithm: the same output and fp32 log-sum-exp
        # kept for backward, and in backward an fp32 dQ accumulator (cuDNN sizes its workspace; the
        # GPU check measures it). Where flash's kernel would take the inputs, its buffers, whose sizes
        # flash_api.cpp states, stand for cuDNN's
        choice = SDP_FLASH
    if choice == SDP_FLASH:
        head_dim = query.shape[-1]
        if head_dim % 8 == 0:
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        # attention.cpp: q, k and v padded to a multiple of 8 (copies), the scale of the true head
        # dim, and the output a view of the padded one's first head_dim columns
        pad = 8 - head_dim % 8
        q, k, v = (torch.nn.functional.pad(t, (0, pad)) for t in (query, key, value))
        scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0][..., :head_dim]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # the GPU converts a boolean mask to an additive one of the query's dtype
        # (attention.cpp convert_boolean_attn_mask) for the other kernels
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=DEVICE).masked_fill(
            attn_mask.logical_not(), float("-inf"))
    if choice == SDP_CUDNN:
        # (attention.cpp: cuDNN takes the additive mask as its bias, and key and value heads that
        # divide the query's as they are)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return aten._scaled_dot_product_cudnn_attention(query, key, value, attn_mask, needs_grad, dropout_p, is_causal,
                                                        False, scale=scale)[0]
    if choice == SDP_EFFICIENT:
        bias = attn_mask
        if bias is not None:
            bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return aten._scaled_dot_product_efficient_attention(query, key, value, bias, needs_grad, dropout_p,
                                                            is_causal, scale=scale)[0]
    # The math kernel, as the GPU runs it: the query's C++ device here is the CPU's, whose
    # scaled_dot_product_attention would pick the CPU's flash kernel and keep no S x S scores.
    gqa = {"enable_gqa": True} if enable_gqa else {}   # torch >= 2.5
    return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                   None, scale=scale, **gqa)[0]


# The capability of the GPU being traced (cuda_answers sets it): scaled_dot_product_attention on
# fake CUDA tensors takes that GPU's kernel wherever it is called from, Python or C++
# (nn.MultiheadAttention calls it inside F.multi_head_attention_forward, below any function mode).
_TRACED_CAPABILITY: list = [None]

# The GPU-dependent questions the traced run asked (cuda_answers collects them; trace.holds_on says
# whether another GPU answers them alike): a list while tracing, None outside.
_GPU_ASKED: list = [None]


def asked(question: str, arg, answer):
    """Record a question whose answer depends on the GPU (trace.gpu_answer re-derives it; any other
    question name marks the trace as holding on its own GPU class only), and return the answer."""
    log = _GPU_ASKED[0]
    if log is not None:
        log.append((question, arg, answer))
    return answer


def gpu_asked() -> tuple | None:
    """What the run traced under the innermost cuda_answers asked so far (None outside one)."""
    log = _GPU_ASKED[0]
    return None if log is None else tuple(dict.fromkeys(log))   # each question once, in order


def _sdpa_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                 enable_gqa=False):
    capability = _TRACED_CAPABILITY[0]
    if capability is not None and _is_fake_cuda(query):
        asked("sdpa_kernel", None, None)   # the kernel chosen depends on the GPU and the tensors
        return _gpu_sdpa(capability, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    # a real CUDA tensor: PyTorch's own composite, which chooses among the GPU's kernels itself
    gqa = {"enable_gqa": enable_gqa} if enable_gqa else {}
    return aten.scaled_dot_product_attention.default.decompose(query, key, value, attn_mask, dropout_p, is_causal,
                                                                scale=scale, **gqa)


# ---- patches for code that asks CUDA questions --------------------------------------------------------

def _bf16_supported(capability: tuple[int, int]):
    """torch.cuda.is_bf16_supported as on a GPU of this capability: natively from sm80; before,
    with ``including_emulation`` (the default), whether a bfloat16 tensor can be made on the
    device, which it can with any CUDA 11+ (torch/cuda/__init__.py). So autocast to bfloat16 runs
    on a V100 or T4 too, on kernels that compute in fp32; its tensors are the same."""
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return asked("bf16_supported", bool(including_emulation),
                     tuple(capability) >= (8, 0) or bool(including_emulation))
    return is_bf16_supported


def _asking(question: str, recorded, answer):
    """A torch.cuda query's stand-in that records the question (asked) and gives ``answer()``:
    ``recorded`` is the answer as trace.gpu_answer re-derives it, None where it is not."""
    def query(*args, **kwargs):
        asked(question, None, recorded)
        return answer()
    return query


# Per compute capability, what every GPU of it has (CUDA C Programming Guide, "Technical
# Specifications per Compute Capability"): shared memory per SM, and the most a block may opt in to
# (the SM's less the 1 KiB the system keeps), in KiB. Threads per SM: profiles._THREADS_PER_SM.
_SHARED_KIB = {(7, 0): (96, 96), (7, 5): (64, 64), (8, 0): (164, 163), (8, 6): (100, 99), (8, 7): (164, 163),
               (8, 9): (100, 99), (9, 0): (228, 227), (10, 0): (228, 227), (12, 0): (100, 99)}
# the board's clocks and memory bus: no profile knows them, and nothing that sizes memory reads them
_BOARD_ONLY = ("clock_rate", "memory_clock_rate", "memory_bus_width")


class FakeDeviceProperties:
    """What ``torch.cuda.get_device_properties`` answers for the GPU type: every attribute of torch's
    ``_CudaDeviceProperties`` (tests/test_cuda_surface.py fails when torch adds one not decided here).
    From the profile: name, memory, capability, SMs, L2 cache; from the capability: the CUDA
    programming guide's per-architecture limits; the fake device's identity (PCI slot 0, a UUID from
    the name); ``gcnArchName`` is the name, as torch's CUDA builds answer (a HIP-only property). The
    clocks and the memory bus are the board's and unknown here: reading them stops the run, named."""

    is_integrated = False
    is_multi_gpu_board = False
    warp_size = 32
    max_threads_per_block = 1024
    regs_per_multiprocessor = 65536
    shared_memory_per_block = 48 * 1024
    pci_bus_id = pci_device_id = pci_domain_id = 0

    def __init__(self, name: str, total_memory: int, capability: tuple[int, int], sm_count: int, l2_cache_bytes: int):
        import uuid

        from .profiles import _THREADS_PER_SM

        self.name = self.gcnArchName = name
        self.total_memory = total_memory
        self.major, self.minor = capability
        self.multi_processor_count = sm_count
        self._l2 = l2_cache_bytes
        self._arch = capability in _SHARED_KIB and capability in _THREADS_PER_SM
        if self._arch:
            self.max_threads_per_multi_processor = _THREADS_PER_SM[capability]
            per_sm, optin = _SHARED_KIB[capability]
            self.shared_memory_per_multiprocessor, self.shared_memory_per_block_optin = per_sm * 1024, optin * 1024
        self.uuid = uuid.uuid5(uuid.NAMESPACE_OID, f"vest-slurm fake GPU {name}")

    @property
    def L2_cache_size(self) -> int:   # noqa: N802  (torch's name)
        if not self._l2:
            self._unknown("L2_cache_size", "the GPU type's profile does not say its L2 cache")
        return self._l2

    def __getattr__(self, attr):   # only for what __init__ did not set
        if attr in _BOARD_ONLY:
            self._unknown(attr, "the board's clocks and memory bus are not in vest's GPU profiles")
        if attr in ("max_threads_per_multi_processor", "shared_memory_per_multiprocessor",
                    "shared_memory_per_block_optin"):
            self._unknown(attr, f"compute capability {self.major}.{self.minor} is not in vest's table")
        raise AttributeError(f"'torch._C._CudaDeviceProperties' object has no attribute {attr!r}")

    @staticmethod
    def _unknown(attr: str, why: str):
        from ..errors import NotSupportedHere

        raise NotSupportedHere(f"torch.cuda.get_device_properties().{attr}", why)

    def __repr__(self) -> str:   # as torch's, without what is not known here
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // 2**20}MB, multi_processor_count={self.multi_processor_count}, "
                f"uuid={self.uuid}, pci_bus_id={self.pci_bus_id}, pci_device_id={self.pci_device_id}, "
                f"pci_domain_id={self.pci_domain_id}, L2_cache_size={self._l2 // 2**20}MB)")


@contextlib.contextmanager
def cuda_answers(total_memory_bytes: int = 80 * 2**30, name: str = "NVIDIA A100-SXM4-80GB",
                 capability: tuple[int, int] = (8, 0), device_count: int = 1, scalar_draws_at_the_top: bool = False,
                 sm_count: int = 108, l2_cache_bytes: int = 40 * 2**20):
    """Make torch.cuda queries answer as a GPU of this kind would, for the duration (the defaults:
    an A100's). With ``scalar_draws_at_the_top`` (the declarative tracer, where only the model's step
    runs), also Python's and NumPy's scalar random draws (_host_draws_at_the_top); a user's script
    keeps them (its data code may loop on them)."""
    import torch.cuda.amp.common as common

    props = FakeDeviceProperties(name, total_memory_bytes, tuple(capability), sm_count, l2_cache_bytes)
    patches = [
        (common, "amp_definitely_not_available", lambda: False),
        (torch.cuda, "is_bf16_supported", _bf16_supported(capability)),
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "device_count", lambda: device_count),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "get_device_properties", _asking("device_properties", None, lambda: props)),
        (torch.cuda, "get_device_name", _asking("device_name", None, lambda: name)),
        (torch.cuda, "get_device_capability", _asking("capability", "%d.%d" % tuple(capability), lambda: capability)),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch, "clear_autocast_cache", _clear_autocast_cache(torch.clear_autocast_cache)),
        (torch.utils, "swap_tensors", _swap_or_set_data(torch.utils.swap_tensors)),
        (torch, "_cudnn_rnn_flatten_weight", cudnn_rnn_flatten_weight),
        # torch.cuda.device(i) / device_of(t): the one fake device is current; -1 (host) stays a no-op
        (torch.cuda, "_exchange_device", lambda device: -1 if device < 0 else 0),
        (torch.cuda, "_maybe_exchange_device", lambda device: -1 if device < 0 else 0),
    ]
    patches += device_identity() + fake_pointers() + subclasses_of_fake_tensors()
    if scalar_draws_at_the_top:
        patches += _host_draws_at_the_top()
    # Optimizer.step asks the current CUDA stream whether it is capturing a graph: it is not.
    for attr in ("_accelerator_graph_capture_health_check", "_cuda_graph_capture_health_check"):
        if hasattr(torch.optim.Optimizer, attr):
            patches.append((torch.optim.Optimizer, attr, lambda self: None))
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    _register_kernels()
    saved_capability, saved_asked = _TRACED_CAPABILITY[0], _GPU_ASKED[0]
    try:
        for obj, attr, new in patches:
            setattr(obj, attr, new)
        _TRACED_CAPABILITY[0] = tuple(capability)
        _GPU_ASKED[0] = []
        yield props
    finally:
        _TRACED_CAPABILITY[0], _GPU_ASKED[0] = saved_capability, saved_asked
        for obj, attr, old in saved:
            setattr(obj, attr, old)
        CAST_CACHE.clear()


_TOP = 1.0 - 2.0 ** -53   # the largest double below 1: the top of random()'s range [0, 1)


def _host_draws_at_the_top() -> list:
    """(object, attribute, replacement) for the scalar draws of Python's and NumPy's random
    modules: some models draw LayerDrop with them (transformers' Wav2Vec2 adapter, WavLM,
    Data2VecAudio: ``np.random.random() > layerdrop``; MusicGen: ``random.uniform(0, 1) <
    layerdrop``). As for torch.rand on the host (CudaFactoryMode), the draw is the top of the range,
    which keeps every layer: the step with the most memory, and the same estimate every time.
    Draws of arrays (``size=``) stay as they are."""
    import random

    def uniform_top(a, b):
        return a + (b - a) * _TOP

    patches = [(random, "random", lambda: _TOP), (random, "uniform", uniform_top)]
    try:
        import numpy as np
    except ImportError:
        return patches

    def scalar_or(original, top, size_at: int):
        """``top(*args)`` for a scalar draw; ``original`` for an array (``size``, keyword or
        argument ``size_at``)."""
        def draw(*args, **kwargs):
            size = kwargs.get("size", args[size_at] if len(args) > size_at else None)
            if size is not None:
                return original(*args, **kwargs)
            kwargs.pop("size", None)
            return top(*args[:size_at], **kwargs)
        return draw

    rand = np.random.rand
    patches += [
        (np.random, "random", scalar_or(np.random.random, lambda: _TOP, 0)),
        (np.random, "rand", lambda *d: rand(*d) if d else _TOP),
        (np.random, "uniform", scalar_or(np.random.uniform, lambda low=0.0, high=1.0: low + (high - low) * _TOP, 2)),
    ]
    return patches


def _swap_or_set_data(original):
    """Module._apply (``module.to(dtype)``, ``.half()``, ``.cuda()``) swaps every FakeTensor
    parameter with its converted copy, and swap_tensors refuses a tensor that has a weak
    reference, as every fake tensor FakeTensorMode has memoized does. On a GPU the same call
    replaces the parameter's data (``param.data = converted``, compute_should_use_set_data), or
    does nothing where the conversion returned the parameter itself (SwitchTransformers' router
    calls ``self.classifier.to(self.dtype)`` in every forward). Do that instead."""

    def swap(t1, t2):
        try:
            return original(t1, t2)
        except RuntimeError:
            if not (_is_fake_cuda(t1) and _is_fake_cuda(t2)):
                raise
        same = (t1.untyped_storage()._cdata == t2.untyped_storage()._cdata
                and t1.dtype == t2.dtype and t1.shape == t2.shape and t1.stride() == t2.stride()
                and t1.storage_offset() == t2.storage_offset())
        if not same:
            with torch.no_grad():
                t1.data = t2.data
        return None

    return swap


def _clear_autocast_cache(original):
    def clear():
        CAST_CACHE.clear()
        original()

    return clear


def gpu_optimizer_defaults():
    """(object, attribute, replacement) making torch.optim pick its implementation as on a GPU:
    torch/optim/optimizer.py _default_to_fused_or_foreach chooses foreach when every parameter is
    a CUDA tensor of a supported type; FakeTensor is not one of those types, which would make a
    script's optimizer fall back to the per-parameter loop."""
    import torch.optim.optimizer as opt_mod

    original = opt_mod._default_to_fused_or_foreach

    def choose(params, differentiable, use_fused=False):
        if not differentiable and params and all(_is_fake_cuda(p) for p in params if p is not None):
            return False, True
        return original(params, differentiable, use_fused)

    targets = [(opt_mod, "_default_to_fused_or_foreach", choose)]
    import importlib

    for name in ("adam", "adamw", "sgd", "rmsprop", "adagrad", "adamax", "nadam", "radam", "asgd", "adadelta", "rprop",
                 "_adafactor"):
        try:
            mod = importlib.import_module(f"torch.optim.{name}")
        except ImportError:
            continue
        if hasattr(mod, "_default_to_fused_or_foreach"):
            targets.append((mod, "_default_to_fused_or_foreach", choose))
    return targets


# ---- model materialisation ----------------------------------------------------------------------------

def materialize(module: torch.nn.Module, weight_dtype: torch.dtype, channels_last: bool) -> None:
    """Give every meta parameter and buffer fake CUDA storage, in the order Module._apply visits
    them for ``model.cuda()``: children first, then the module's own parameters, then buffers.
    Tied parameters stay tied."""
    memo: dict[int, torch.Tensor] = {}
    kept: list[torch.Tensor] = []   # the converted originals stay alive: their ids stay theirs

    def convert(t: torch.Tensor, is_param: bool) -> torch.Tensor:
        if id(t) in memo:
            return memo[id(t)]
        if _is_fake_cuda(t):
            # already converted: a submodule that appears twice in the tree (T5's shared
            # embedding is also encoder.embed_tokens in transformers 4.x) is visited twice, and
            # .cuda() leaves a CUDA tensor as it is
            return t
        dtype = weight_dtype if t.is_floating_point() else t.dtype
        fmt = torch.channels_last if (channels_last and t.dim() == 4) else torch.contiguous_format
        new = torch.empty(t.shape, dtype=dtype, device=DEVICE, memory_format=fmt)
        if is_param:
            new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
        memo[id(t)] = new
        kept.append(t)
        return new

    def visit(m: torch.nn.Module) -> None:
        for child in m.children():
            visit(child)
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = convert(p, True)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = convert(b, False)
        if isinstance(m, torch.nn.RNNBase):
            m._init_flat_weights()   # as RNNBase._apply does: cuDNN's flat weight buffer

    visit(module)


def current_autograd_node():
    return torch._C._current_autograd_node()
