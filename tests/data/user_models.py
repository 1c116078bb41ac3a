"""User model factories for the estimator tests (``tests/data/user_models.py:NAME``)."""

import torch
from torch import nn


def small_cnn(num_classes: int = 10):
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def raises():
    raise RuntimeError("checkpoint file /nonexistent/weights.pt not found")


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        if x.sum() > 0:          # control flow on a value: needs the data
            x = x * 2
        return self.fc(x)


def data_dependent():
    return _DataDependent()


class _DataDependentLater(_DataDependent):
    """Reads a value only from its second forward on: after the first optimizer step."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x) if self.calls > 1 else self.fc(x)


def data_dependent_later():
    return _DataDependentLater()


def not_a_module():
    return "resnet"


class _Checkpointed(nn.Module):
    """A conv block recomputed in backward (activation checkpointing): its forward convolutions run
    a second time, on autograd's thread."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.head = nn.Linear(8, num_classes)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, x, use_reentrant=False).mean(dim=(2, 3)))


def checkpointed_cnn(num_classes: int = 10):
    return _Checkpointed(num_classes)


class _Attention(nn.Module):
    """Eager attention in the style of transformers 4.x T5: fp32 softmax, back to the scores'
    dtype, dropout on the weights. ``type_as`` chooses how the cast back is written."""

    def __init__(self, type_as: bool, dim: int = 32, heads: int = 4):
        super().__init__()
        self.type_as, self.heads = type_as, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2)
        probs = nn.functional.softmax(scores.float(), dim=-1)
        probs = probs.type_as(scores) if self.type_as else probs.to(scores.dtype)
        probs = nn.functional.dropout(probs, p=0.1, training=self.training)
        return self.out((probs @ v).transpose(1, 2).reshape(b, n, d))


def attention_type_as():
    return _Attention(type_as=True)


def attention_to_dtype():
    return _Attention(type_as=False)


class _FanOut(nn.Module):
    """A hidden tensor used by three layers: autograd accumulates its three gradients. ``hook``
    adds a tensor hook that writes ``grad + grad`` on it (Python code, not the engine)."""

    def __init__(self, features: int, hidden: int, out: int, hook: bool):
        super().__init__()
        self.inp = nn.Linear(features, hidden, bias=False)
        self.a, self.b, self.c = (nn.Linear(hidden, out, bias=False) for _ in range(3))
        self.hook = hook

    def forward(self, x):
        h = self.inp(x)
        if self.hook and h.requires_grad:
            h.register_hook(lambda grad: grad + grad)
        return self.a(h) + self.b(h) + self.c(h)


def fan_out(features: int = 32, hidden: int = 512, out: int = 128, hook: bool = False):
    return _FanOut(features, hidden, out, hook)


class _PickFromScores(nn.Module):
    """Scores over a large vocabulary, then one value picked per position, as log-probability
    code does: ``gather`` of the log-softmax, or ``max`` over the scores. Their backward
    formulas fill a scores-sized tensor of zeros."""

    def __init__(self, features: int, vocab: int, pick: str):
        super().__init__()
        self.proj = nn.Linear(features, vocab, bias=False)
        self.pick = pick

    def forward(self, x):
        import torch

        scores = self.proj(x)
        if self.pick == "gather":
            index = torch.zeros(x.shape[:-1] + (1,), dtype=torch.long, device=x.device)
            return scores.log_softmax(-1).gather(-1, index).squeeze(-1)
        return scores.max(-1).values


def pick_from_scores(features: int = 16, vocab: int = 4096, pick: str = "gather"):
    return _PickFromScores(features, vocab, pick)


class _NormOfTransposed(nn.Module):
    """A LayerNorm over the last dim of a transposed activation (Whisper's residual stream keeps
    the conv's channels-first layout), then a Linear, so its gradient arrives contiguous."""

    def __init__(self, features: int, length: int, transpose: bool):
        super().__init__()
        self.inp = nn.Linear(features, features)
        self.norm = nn.LayerNorm(length)
        self.out = nn.Linear(length, 4)
        self.transpose = transpose

    def forward(self, x):
        h = self.inp(x).transpose(1, 2)   # [batch, features, length], not contiguous
        if not self.transpose:
            h = h.contiguous()
        return self.out(self.norm(h)).mean((1, 2))


def norm_of_transposed(features: int = 32, length: int = 48, transpose: bool = True):
    return _NormOfTransposed(features, length, transpose)


class _Probabilities(nn.Module):
    """softmax (or log_softmax) over a projection, then a Linear over the probabilities."""

    def __init__(self, features: int, classes: int, log: bool):
        super().__init__()
        self.proj = nn.Linear(features, classes)
        self.out = nn.Linear(classes, 4)
        self.log = log

    def forward(self, x):
        scores = self.proj(x)
        p = scores.log_softmax(-1) if self.log else scores.softmax(-1)
        return self.out(p)


def probabilities(features: int = 16, classes: int = 1000, log: bool = False):
    return _Probabilities(features, classes, log)


class _ConvOfChannelSlice(nn.Module):
    """A depthwise convolution of a channel slice of a channels-last activation, as timm's
    FocalNet convolves the context part of its projection: the slice is channels-last-like but
    not dense, so the GPU copies it before cuDNN, in forward and for the weight gradient."""

    def __init__(self, channels: int, slice_: bool):
        super().__init__()
        self.f = nn.Conv2d(3, 2 * channels, 1)
        self.dw = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.channels = channels
        self.slice = slice_

    def forward(self, x):
        import torch

        h = self.f(x).contiguous(memory_format=torch.channels_last)
        q, ctx = h.split(self.channels, 1)
        if not self.slice:
            ctx = ctx.contiguous(memory_format=torch.channels_last)
        return (self.dw(ctx) * q).mean((2, 3))


def conv_of_channel_slice(channels: int = 32, slice_: bool = True):
    return _ConvOfChannelSlice(channels, slice_)


class _NeedsSm80(nn.Module):
    """A model whose forward refuses GPUs before sm80 (as FlashAttention-2 kernels do)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        import torch

        if torch.cuda.get_device_capability() < (8, 0):
            raise RuntimeError("this model needs an Ampere or newer GPU (sm80+)")
        return self.fc(x)


def needs_sm80():
    return _NeedsSm80()


class _PadsTheBatch(nn.Module):
    """Pads the batch with 1-8 rows to the next multiple of 8 above it before its layer: its
    activation sizes are a staircase in the batch, not a line."""

    def __init__(self, features: int):
        super().__init__()
        self.fc = nn.Linear(features, features)

    def forward(self, x):
        n = x.shape[0]
        x = torch.cat([x, x.new_zeros(8 - n % 8, *x.shape[1:])])
        return self.fc(x)[:n]


def pads_the_batch(features: int = 256):
    return _PadsTheBatch(features)


class _AsksItsDevice(nn.Module):
    """Research-code habits: a GRU, and a forward that asks its input where it is (``is_cuda``,
    ``get_device()``, ``type()``) and on the GPU keeps a wider projection (a fused path's buffer)."""

    def __init__(self, features: int = 32, hidden: int = 64):
        super().__init__()
        self.rnn = nn.GRU(features, hidden, batch_first=True)
        self.gpu_path = nn.Linear(hidden, 4 * hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x):
        out = self.rnn(x)[0][:, -1]
        if x.is_cuda and not x.is_cpu and x.get_device() == 0 and x.type().startswith("torch.cuda."):
            out = self.gpu_path(out)[:, :out.shape[1]]
        return self.head(out)


def asks_its_device():
    return _AsksItsDevice()


class _ReturnsItsLoss(nn.Module):
    """A model whose forward computes its own training loss (a diffusion model's denoising loss, a
    research model's wrapper): returned as a tensor, in a dict, or first in a tuple."""

    def __init__(self, features: int = 64, form: str = "tensor"):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 4 * features), nn.GELU(), nn.Linear(4 * features, features))
        self.form = form

    def forward(self, x):
        noise = torch.randn_like(x)
        loss = nn.functional.mse_loss(self.net(x + noise), noise)
        return {"tensor": loss, "dict": {"loss": loss}, "tuple": (loss, noise)}[self.form]


def returns_its_loss(features: int = 64, form: str = "tensor"):
    return _ReturnsItsLoss(features, form)


class _PicksItsKernelWhenBuilt(nn.Module):
    """Chooses its GPU path when built, as flash-attention layers do (lucidrains' Attend): on a GPU
    of sm80 or newer a wider fused projection, on older ones the plain one; called on a GPU it
    was not built for, it fails."""

    def __init__(self, features: int = 1024):
        super().__init__()
        self.built_for = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        wide = self.built_for is not None and self.built_for >= (8, 0)
        self.proj = nn.Linear(features, (4 if wide else 1) * features)
        self.head = nn.Linear((4 if wide else 1) * features, 10)

    def forward(self, x):
        if x.is_cuda and self.built_for is None:
            raise RuntimeError("built without a GPU but called on one")
        return self.head(self.proj(x))


def picks_its_kernel_when_built():
    return _PicksItsKernelWhenBuilt()


class _ProjectTransposed(nn.Module):
    """A linear layer on a transposed (non-contiguous) 3-D input, as nn.MultiheadAttention's
    in-projection of a batch_first input: ATen's linear adds the bias in place on the GPU. With
    ``by_hand`` the same projection written ``x @ w.t() + b`` in Python: two calls, the sum a new
    tensor on the GPU too."""

    def __init__(self, features: int, hidden: int, by_hand: bool):
        super().__init__()
        self.proj = nn.Linear(features, hidden)
        self.by_hand = by_hand

    def forward(self, x):
        x = x.transpose(0, 1)
        if self.by_hand:
            return x @ self.proj.weight.t() + self.proj.bias
        return self.proj(x)


def project_transposed(features: int = 32, hidden: int = 256, by_hand: bool = False):
    return _ProjectTransposed(features, hidden, by_hand)


class _IndexBlock(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.lin, self.i = nn.Linear(64, 64), i

    def forward(self, x):
        for _ in range(self.i % 3):   # every third block does more than the others
            x = x * 1.5
        return torch.relu(self.lin(x))


class _IndexBlocks(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(_IndexBlock(i) for i in range(blocks))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def index_dependent_blocks(blocks: int = 8):
    """A stack of blocks of the same shapes whose forward depends on their index (input: 64)."""
    return _IndexBlocks(blocks)
