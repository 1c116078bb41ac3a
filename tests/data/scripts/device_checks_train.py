"""A script that asks its tensors which device they are on, in the older habits still common in
research code: ``x.is_cuda``, ``x.get_device()``, ``x.type()``, ``.type(torch.cuda.FloatTensor)`` to
move a batch, and an RNN whose weights cuDNN flattens once they are on the GPU. It keeps a buffer on
the GPU only when its data is there (the branch the GPU run takes), and checks the answers."""
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(32, 64, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


model = Net().cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
assert next(model.parameters()).is_cuda
for step in range(10):
    x = torch.randn(16, 20, 32).type(torch.cuda.FloatTensor)
    y = torch.randint(0, 10, (16,)).cuda()
    assert x.is_cuda and not x.is_cpu and x.get_device() == 0 and x.type() == "torch.cuda.FloatTensor"
    if x.is_cuda and step == 0:
        scratch = torch.empty(1 << 20, device=torch.device("cuda", x.get_device()))   # 4 MiB, kept
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
