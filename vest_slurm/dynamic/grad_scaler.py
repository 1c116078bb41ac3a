"""GradScaler stand-ins for the fake GPU (torch.amp.GradScaler and torch.cuda.amp.GradScaler with
their real signatures): what enters is the script's scaler calls, what leaves is the device memory
a GPU run's scaler makes (one fp32 scale tensor; grads unscaled in place). Used by standins.patched,
which installs them, and by cuda_surface, which records them as the decision for every public
method of the two classes."""

from __future__ import annotations

import functools

import torch

from ..errors import FailsOnAGpu
from ..estimate import _fakecuda as fc

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"   # torch's OptState, per optimizer
_FIX = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."


@functools.cache
def _fails(kind: type) -> type:
    """An exception of torch's own type (ValueError, AssertionError, RuntimeError) that says the
    script fails on a GPU too (errors.FailsOnAGpu): the script must act."""
    return type(kind.__name__, (FailsOnAGpu, kind), {"__module__": "builtins"})


class FakeGradScaler:
    """torch.amp.GradScaler's memory behaviour: a scale tensor on the device, loss * scale, grads
    unscaled in place before the step (found_inf checks need values: never inf here). Its checks
    of the script's calls are torch's own, in torch's words (torch/amp/grad_scaler.py): fp16
    gradients (a model cast to half under a scaler: diffusers' LoRA scripts when fp16 comes from
    accelerate's config), unscale_ twice or after step, step twice, no gradient to check, no
    scale() before; without them the estimate was of a job that fails at its first step."""

    _allow_fp16 = False   # (ShardedGradScaler's unscale_ allows them)

    def __init__(self, device="cuda", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True):
        self._enabled = bool(enabled)
        self._scale = None
        self._init_scale = init_scale
        self._growth_factor, self._backoff_factor, self._growth_interval = growth_factor, backoff_factor, growth_interval
        self._states: dict = {}   # id(optimizer) -> [stage, whether a gradient was checked]
        if self._enabled:
            if growth_factor <= 1.0:
                raise _fails(AssertionError)("The growth factor must be > 1.0.")
            if backoff_factor >= 1.0:
                raise _fails(AssertionError)("The backoff factor must be < 1.0.")

    def _state(self, optimizer) -> list:
        return self._states.setdefault(id(optimizer), [_READY, False])

    def _check_scale(self, funcname):
        if self._scale is None:
            raise _fails(AssertionError)(f"Attempted {funcname} but _scale is None.  " + _FIX)

    def is_enabled(self):
        return self._enabled

    def scale(self, outputs):
        if not self._enabled:
            return outputs
        if self._scale is None:
            self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=fc.DEVICE)
        if isinstance(outputs, torch.Tensor):
            return outputs * self._scale
        return type(outputs)(self.scale(o) for o in outputs)

    def unscale_(self, optimizer):
        if not self._enabled:
            return
        self._check_scale("unscale_")
        state = self._state(optimizer)
        if state[0] == _UNSCALED:
            raise _fails(RuntimeError)("unscale_() has already been called on this optimizer since the last update().")
        if state[0] == _STEPPED:
            raise _fails(RuntimeError)("unscale_() is being called after step().")
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not self._allow_fp16 and any(g.dtype == torch.float16 for g in grads):
            raise _fails(ValueError)("Attempting to unscale FP16 gradients.")
        if grads:
            inv = self._scale.double().reciprocal().float()
            torch._foreach_mul_(grads, inv)
        state[:] = [_UNSCALED, bool(grads)]   # (torch records an inf check per device with gradients)

    def step(self, optimizer, *args, **kwargs):
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise _fails(RuntimeError)("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale("step")
        state = self._state(optimizer)
        if state[0] == _STEPPED:
            raise _fails(RuntimeError)("step() has already been called since the last update().")
        if state[0] == _READY:
            self.unscale_(optimizer)
        if not state[1]:
            raise _fails(AssertionError)("No inf checks were recorded for this optimizer.")
        out = optimizer.step(*args, **kwargs)
        state[0] = _STEPPED
        return out

    def update(self, new_scale=None):
        if not self._enabled:
            return
        self._check_scale("update")
        if new_scale is None and not any(checked for _, checked in self._states.values()):
            raise _fails(AssertionError)("No inf checks were recorded prior to update.")
        self._states.clear()

    def get_scale(self):
        return self._init_scale if self._enabled else 1.0

    def state_dict(self):
        return {"scale": self.get_scale()} if self._enabled else {}

    def load_state_dict(self, state_dict):
        pass

    # the schedule's settings: kept and answered (no inf ever appears, so they change nothing here)
    def get_growth_factor(self):
        return self._growth_factor

    def set_growth_factor(self, new_factor):
        self._growth_factor = new_factor

    def get_backoff_factor(self):
        return self._backoff_factor

    def set_backoff_factor(self, new_factor):
        self._backoff_factor = new_factor

    def get_growth_interval(self):
        return self._growth_interval

    def set_growth_interval(self, new_interval):
        self._growth_interval = new_interval


class FakeCudaGradScaler(FakeGradScaler):
    """torch.cuda.amp.GradScaler's signature (no device argument)."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 enabled=True):
        super().__init__("cuda", init_scale, growth_factor, backoff_factor, growth_interval, enabled)


class FakeShardedGradScaler(FakeGradScaler):
    """torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler's signature (FSDP1 in fp16:
    accelerate's FSDP plugin, Lightning's FSDP precision): a GradScaler whose found-inf flags are
    all-reduced over ``process_group`` (one element each) and which unscales sharded gradients in
    place: GradScaler's memory. The real class, subclassing GradScaler, reached for private methods
    this stand-in does not have ('no attribute _lazy_init_scale_growth_tracker')."""

    _allow_fp16 = True   # (torch/distributed/fsdp/sharded_grad_scaler.py: unscale_ allows fp16 gradients)

    def __init__(self, device="cuda", init_scale=2.0**16, backoff_factor=0.5, growth_factor=2.0, growth_interval=2000,
                 enabled=True, process_group=None):
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
