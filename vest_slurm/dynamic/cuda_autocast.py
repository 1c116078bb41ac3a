"""CUDA's autocast, run on the CPU: for the live oracle, which runs a script's ``autocast("cuda")``
on CPU tensors.

CPU autocast's op lists are not CUDA's (aten/src/ATen/autocast_mode.cpp): under CUDA autocast
``layer_norm``, ``softmax``, ``log_softmax``, ``sum``, ``exp``, ``rms_norm`` and the losses run in
float32 (their outputs and what they save for backward are float32), on the CPU they run in the
input's dtype; the CPU has ``cross_entropy_loss``, ``cat``, ``stack`` and the FFTs in its lists,
CUDA has not. A bf16 language model's count moved by 6-10% between the two. So while the oracle
runs, the AutocastCPU dispatch key takes CUDA's policies: the installed torch's own lists, read from
the header it ships (torch/include/ATen/autocast_mode.h, the ``AT_FORALL_*`` macros the CUDA
kernels are registered from), and a fallthrough for every op that only the CPU lists. Each policy is
applied as ATen's ``WrapFunction_`` applies it (autocast_mode.h):

- lower_precision_fp: eligible tensors cast to the autocast dtype;
- fp32: eligible tensors cast to float32;
- fp32_set_opt_dtype: when the first tensor is eligible, an unset ``dtype`` argument set to float32;
- fp32_append_dtype (``norm``): the overload with a dtype, float32;
- promote: eligible tensors cast to the widest floating dtype among them.

Eligible, as ``is_eligible`` says: a floating tensor, not float64, on the device (here: one the
oracle's census marks as device storage; a host tensor is not cast on a GPU either). Casts of leaf
float32 parameters to the lower dtype are cached until the outermost autocast region ends, as
``cached_cast`` caches them (one bf16 copy of a weight used twice, not two).
"""
from __future__ import annotations

import contextlib
import os
import re

import torch

MACROS = {"AT_FORALL_LOWER_PRECISION_FP": "lower", "AT_FORALL_FP32": "fp32",
          "AT_FORALL_FP32_SET_OPT_DTYPE": "fp32_set_opt_dtype", "AT_FORALL_PROMOTE": "promote"}
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: each of these goes to its overload with a dtype, float32
APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}


# registered on AutocastCUDA to raise (aten/src/ATen/autocast_mode.cpp), its message
BANNED = "binary_cross_entropy"
BANNED_MESSAGE = ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
                  "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
                  "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
                  "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
                  "safe to autocast.")


def header_path() -> str:
    return os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "autocast_mode.h")


def policies(text: str | None = None) -> dict[str, str]:
    """``{"name.overload": policy}`` of CUDA autocast's lists in the header's text (default: the
    installed torch's); ``name`` alone is the default overload. Empty where the header is missing."""
    if text is None:
        try:
            with open(header_path()) as f:
                text = f.read()
        except OSError:
            return {}
    out = {}
    for macro, policy in MACROS.items():
        m = re.search(r"#define %s\(_\)\s*\\\n(.*?)(?:\n\s*\n|\n#)" % macro, text, re.S)
        if not m:
            continue
        for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", m.group(1)):
            out[f"{name}.{overload}" if overload else name] = policy
    if "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE" in text:
        out.update({k: "fp32_append_dtype" for k in APPEND_DTYPE})
    return out


def _overload(qualname: str):
    name, _, overload = qualname.partition(".")
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, overload or "default", None) if packet is not None else None


class CudaAutocast:
    """Registers CUDA's policies on the AutocastCPU key while entered; ``eligible(t)``: a tensor that
    lives on the device."""

    def __init__(self, eligible):
        self.eligible = eligible
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _ok(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and self.eligible(t)

    def _cast(self, t, dtype):
        if not self._ok(t) or t.dtype == dtype:
            return t
        if isinstance(t, torch.Tensor) and dtype == torch.get_autocast_dtype("cpu") and t.dtype == torch.float32 \
                and t.requires_grad and t.is_leaf and not t._is_view() and torch.is_autocast_cache_enabled():
            hit = self.cache.get(id(t))
            if hit is None or hit[0] is not t:
                hit = self.cache[id(t)] = (t, t.to(dtype))
            return hit[1]
        return t.to(dtype)

    def _map(self, value, dtype):
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._cast(v, dtype) for v in value)
        return self._cast(value, dtype)

    def _tensors(self, args, kwargs):
        for v in (*args, *kwargs.values()):
            if isinstance(v, (list, tuple)):
                yield from (x for x in v if isinstance(x, torch.Tensor))
            elif isinstance(v, torch.Tensor):
                yield v

    def kernel(self, op, policy: str):
        guard = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
        dtype_at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)
        with_dtype = _overload(APPEND_DTYPE[f"{op._schema.name.split('::')[1]}.{op._overloadname}"]) \
            if policy == "fp32_append_dtype" else None

        def run(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(guard):
                first = next(self._tensors(args, kwargs), None)
                if policy in ("lower", "fp32", "promote"):
                    to = torch.get_autocast_dtype("cpu") if policy == "lower" else torch.float32
                    if policy == "promote":
                        seen = [t.dtype for t in self._tensors(args, kwargs) if self._ok(t)]
                        to = torch.float32 if torch.float32 in seen else torch.get_autocast_dtype("cpu")
                    args = tuple(self._map(a, to) for a in args)
                    kwargs = {k: self._map(v, to) for k, v in kwargs.items()}
                    return op(*args, **kwargs)
                if first is None or not self._ok(first):
                    return op(*args, **kwargs)
                if policy == "fp32_append_dtype":
                    return with_dtype(*args, dtype=torch.float32, **kwargs)
                if dtype_at is not None and dtype_at < len(args):
                    if args[dtype_at] is None:
                        args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
        return run

    def banned(self, *args, **kwargs):
        # at::autocast::binary_cross_entropy_banned: what a GPU run raises
        if any(self._ok(t) for t in self._tensors(args, kwargs)):
            raise RuntimeError(BANNED_MESSAGE)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            return torch.ops.aten.binary_cross_entropy.default(*args, **kwargs)

    @contextlib.contextmanager
    def installed(self):
        """CUDA's lists on AutocastCPU (a fallthrough for the CPU's own others); the cast cache
        dropped where torch drops its own (``torch.clear_autocast_cache``)."""
        table = policies()
        if not table:   # a torch without its headers: the CPU's lists stay (the oracle says so)
            yield False
            return
        lib = torch.library.Library("aten", "IMPL")
        mine = set()
        try:
            for qualname, policy in table.items():
                op = _overload(qualname)
                if op is None:
                    continue
                lib.impl(qualname, self.kernel(op, policy), "AutocastCPU")
                mine.add(qualname)
            lib.impl(BANNED, self.banned, "AutocastCPU")
            cuda = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
            for reg in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"):
                qualname = reg.split("::", 1)[1]
                # an op CUDA's autocast leaves alone goes through; one CUDA registers outside the
                # header's lists (autocast_mode.cpp's own KERNEL_CUDA lines) keeps the CPU's kernel
                if reg.startswith("aten::") and qualname not in mine and reg not in cuda:
                    lib.impl(qualname, torch.library.fallthrough_kernel, "AutocastCPU")
            real_clear = torch.clear_autocast_cache

            def clear():
                self.cache.clear()
                real_clear()
            torch.clear_autocast_cache = clear
            try:
                yield True
            finally:
                torch.clear_autocast_cache = real_clear
                self.cache.clear()
        finally:
            lib._destroy()
