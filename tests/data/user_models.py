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
