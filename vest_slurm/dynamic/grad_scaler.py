"""GradScaler stand-ins for the fake GPU (torch.amp.GradScaler and torch.cuda.amp.GradScaler with
their real signatures): what enters is the script's scaler calls, what leaves is the device memory
a GPU run's scaler makes (one fp32 scale tensor; grads unscaled in place). Used by standins.patched,
which installs them, and by cuda_surface, which records them as the decision for every public
method of the two classes."""

from __future__ import annotations

import torch

from ..estimate import _fakecuda as fc


class FakeGradScaler:
    """torch.amp.GradScaler's memory behaviour: a scale tensor on the device, loss * scale, grads
    unscaled in place before the step (found_inf checks need values: never inf here)."""

    def __init__(self, device="cuda", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True):
        self._enabled = bool(enabled)
        self._scale = None
        self._init_scale = init_scale
        self._growth_factor, self._backoff_factor, self._growth_interval = growth_factor, backoff_factor, growth_interval

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
        if not self._enabled or self._scale is None or getattr(optimizer, "_vest_unscaled", False):
            return
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            inv = self._scale.double().reciprocal().float()
            torch._foreach_mul_(grads, inv)
        optimizer._vest_unscaled = True

    def step(self, optimizer, *args, **kwargs):
        if self._enabled:
            self.unscale_(optimizer)
        optimizer._vest_unscaled = False
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale=None):
        pass

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

    def __init__(self, device="cuda", init_scale=2.0**16, backoff_factor=0.5, growth_factor=2.0, growth_interval=2000,
                 enabled=True, process_group=None):
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
