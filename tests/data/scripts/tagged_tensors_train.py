"""Tensors of Python subclasses that tag the data (torchvision's tv_tensors from transforms v2,
as detection and segmentation pipelines yield them; a "meta tensor" of the script's own that keeps
its tag through ops, as MONAI's and fastai's do): moved to the GPU with .cuda() / .to(), wrapped
again around the model's output (tv_tensors.wrap), unwrapped with as_subclass(torch.Tensor)."""
import copy

import torch
from torch import nn
from torchvision import tv_tensors


class Tagged(torch.Tensor):
    """Keeps its class and its metadata through every op, as fastai's TensorBase does: the result's
    __dict__ becomes a copy of the first argument's (Tensor.set_meta)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        out = out.as_subclass(cls) if isinstance(out, torch.Tensor) and not isinstance(out, cls) else out
        if isinstance(out, cls) and args and isinstance(args[0], cls) and args[0] is not out:
            out.__dict__ = copy.copy(args[0].__dict__)
        return out


model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 3, 3, padding=1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
like = tv_tensors.Image(torch.zeros(3, 2, 2))
for step in range(10):
    img = tv_tensors.Image(torch.rand(8, 3, 64, 64)).cuda()
    mask = tv_tensors.Mask(torch.zeros(8, 64, 64, dtype=torch.long)).to("cuda", non_blocking=True)
    tagged = Tagged(torch.rand(8, 3, 64, 64))
    tagged.source = "camera 1"
    tagged = tagged.cuda()
    assert tagged.source == "camera 1" and tagged.is_cuda
    out = tv_tensors.wrap(model(img + tagged), like=like)
    assert isinstance(out, tv_tensors.Image) and isinstance(img, tv_tensors.Image) and out.is_cuda
    loss = (out.as_subclass(torch.Tensor) - mask.unsqueeze(1)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
