"""TimesNet's FFT_for_Period (Time-Series-Library): the dominant periods of a batch, from the top-k
frequency bins read back to the host with .cpu().numpy(), decide a padding and a reshape."""
import torch
import torch.nn as nn

B, T, C = 8, 96, 16
conv = nn.Conv2d(C, C, 3, padding=1).cuda()
opt = torch.optim.Adam(conv.parameters())
for step in range(4):
    x = torch.randn(B, T, C, device="cuda")
    freq = abs(torch.fft.rfft(x, dim=1)).mean(0).mean(-1)
    freq[0] = 0
    _, top = torch.topk(freq, 2)
    period = T // top.detach().cpu().numpy()
    p = period[0]
    if T % p != 0:
        length = (T // p + 1) * p
        xx = torch.cat([x, torch.zeros(B, length - T, C, device="cuda")], 1)
    else:
        length, xx = T, x
    out = conv(xx.reshape(B, length // p, p, C).permute(0, 3, 1, 2).contiguous())
    out.mean().backward()
    opt.step()
    opt.zero_grad()
