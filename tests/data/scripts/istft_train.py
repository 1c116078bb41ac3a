"""A spectral mask trained through the STFT and its inverse (speech enhancement, iSTFT vocoders):
torch.istft checks its window's overlap-add in C++ with at::equal."""
import torch

net = torch.nn.Linear(129, 129).cuda()
opt = torch.optim.Adam(net.parameters())
window = torch.hann_window(256, device="cuda")
for step in range(5):
    wav = torch.randn(4, 8000, device="cuda")
    spec = torch.stft(wav, 256, 64, window=window, return_complex=True)
    mask = torch.sigmoid(net(spec.abs().transpose(1, 2))).transpose(1, 2)
    out = torch.istft(spec * mask, 256, 64, window=window, length=wav.shape[1])
    (out - wav).square().mean().backward()
    opt.step()
    opt.zero_grad()
