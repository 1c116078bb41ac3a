"""A sequence-first recurrent model (nn.LSTM without batch_first): inputs are T x B x F."""
import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--bptt", type=int, default=20)
args = p.parse_args()


class RNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(32, 64, num_layers=2)
        self.out = nn.Linear(64, 32)

    def forward(self, x):
        h, _ = self.rnn(x)
        return self.out(h)


model = RNNModel().cuda()
opt = torch.optim.Adam(model.parameters())
for step in range(100):
    x = torch.randn(args.bptt, args.batch_size, 32).cuda()
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
