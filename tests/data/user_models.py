"""User model factories for the estimator tests (``tests/data/user_models.py:NAME``)."""

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
