"""CUDA's autocast, run on the CPU: for the live oracle, which runs a script's ``autocast("cuda")``
on CPU tensors.

CPU autocast's op lists are not CUDA's (aten/src/ATen/autocast_mode.cpp): under CUDA autocast
``layer_norm``, ``softmax``, ``log_softmax``, ``sum``, ``exp``, ``rms_norm`` and the losses run in
float32 (their outputs and what they save for backward are float32); on the CPU they run in the
input's dtype, and the CPU has ``cross_entropy_loss``, ``cat``, ``stack`` and the FFTs in its lists,
CUDA has not. So while the oracle runs, the AutocastCPU dispatch key takes CUDA's policies, with
the kernels vest's own fake CUDA registers on AutocastCUDA (_fakecuda._autocast_kernel, from the
installed torch's autocast_mode.h), given the oracle's own test of a device tensor (a floating
tensor the census marks; a host tensor is not cast on a GPU either) and cast cache (leaf float32
weights cast once per autocast region, as ``cached_cast``). Besides the header's lists:

- ``norm`` goes to its overload with a dtype, float32 (``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``);
- ``binary_cross_entropy`` raises what a GPU raises (``binary_cross_entropy_banned``);
- an op CUDA's autocast leaves alone goes through on the CPU too (a fallthrough on AutocastCPU);
- an op autocast_mode.cpp registers for CUDA one by one, outside the header (``linalg_matrix_sqrth``),
  keeps the CPU's kernel where the CPU lists it too.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from ..estimate import _fakecuda as fc

POLICIES = {"LOWER_PRECISION_FP": "lower", "FP32": "fp32", "FP32_SET_OPT_DTYPE": "set_opt_dtype", "PROMOTE": "promote"}
APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
# registered on AutocastCUDA to raise (autocast_mode.cpp), with this message
BANNED = "binary_cross_entropy"
BANNED_MESSAGE = ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
                  "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
                  "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
                  "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
                  "safe to autocast.")


def policies() -> dict[str, str]:
    """``{"name[.overload]": policy}`` of CUDA autocast's lists in the installed torch's header;
    empty where it ships none."""
    lists = fc.installed_autocast_policy()
    return {op: POLICIES[name] for name, ops in (lists or {}).items() for op in ops}


class CudaAutocast:
    """CUDA's policies on the AutocastCPU key while ``installed()``; ``eligible(t)``: ``t`` lives on
    the device."""

    def __init__(self, eligible):
        self.cache = fc._CastCache(lambda t: isinstance(t, torch.Tensor) and eligible(t))

    def _on_device(self, args, kwargs) -> bool:
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        return any(self.cache.eligible(t) and t.is_floating_point() and t.dtype != torch.float64 for t in leaves)

    def _append_dtype(self, qualname: str):
        with_dtype = fc.aten_overload(APPEND_DTYPE[qualname])
        plain = fc.aten_overload(qualname)

        def run(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(fc._AUTOCAST_CPU_KEYS):
                first = args[0] if args else None
                if self._on_device((first,), {}):
                    return with_dtype(*args, dtype=torch.float32, **kwargs)
                return plain(*args, **kwargs)
        return run

    def _banned(self, *args, **kwargs):
        if self._on_device(args, kwargs):
            raise RuntimeError(BANNED_MESSAGE)
        with torch._C._ExcludeDispatchKeyGuard(fc._AUTOCAST_CPU_KEYS):
            return torch.ops.aten.binary_cross_entropy.default(*args, **kwargs)

    @contextlib.contextmanager
    def installed(self):
        """Yields whether CUDA's lists were found (else the CPU's stay, as before)."""
        table = policies()
        if not table:
            yield False
            return
        lib = torch.library.Library("aten", "IMPL")
        real_clear = torch.clear_autocast_cache

        def clear():
            self.cache.clear()
            real_clear()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # "overriding a previously registered kernel" is meant
                mine = {BANNED, *APPEND_DTYPE}
                for qualname, policy in table.items():
                    op = fc.aten_overload(qualname)
                    if op is not None:
                        lib.impl(qualname, fc._autocast_kernel(op, policy, self.cache, "cpu"), "AutocastCPU")
                        mine.add(qualname)
                for qualname in APPEND_DTYPE:
                    lib.impl(qualname, self._append_dtype(qualname), "AutocastCPU")
                lib.impl(BANNED, self._banned, "AutocastCPU")
                cuda = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
                for reg in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"):
                    qualname = reg.split("::", 1)[1]
                    if reg.startswith("aten::") and qualname not in mine and reg not in cuda:
                        lib.impl(qualname, torch.library.fallthrough_kernel, "AutocastCPU")
            torch.clear_autocast_cache = clear
            yield True
        finally:
            torch.clear_autocast_cache = real_clear
            self.cache.clear()
            lib._destroy()
