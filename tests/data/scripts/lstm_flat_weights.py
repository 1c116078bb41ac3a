"""An nn.LSTM on the GPU: flatten_parameters puts its weights into one cuDNN buffer, the parameters
becoming views of it (their own storages freed). Plain SGD, one token: parameters and gradients are
nearly the whole peak."""
import torch
from torch import nn

rnn = nn.LSTM(256, 256, num_layers=2).cuda()
opt = torch.optim.SGD(rnn.parameters(), lr=0.1)
for _ in range(4):
    out, _ = rnn(torch.randn(1, 1, 256, device="cuda"))
    out.sum().backward()
    opt.step()
    opt.zero_grad()
