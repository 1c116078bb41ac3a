"""A layer that sizes its own buffer from the autocast state it asks for (TRL's chunked log-prob
head: torch.get_autocast_dtype(device.type) when torch.is_autocast_enabled(device.type)), run
under autocast("cuda", bfloat16)."""
import torch
import torch.nn as nn


class ChunkedHead(nn.Module):
    def __init__(self, dim=256, vocab=8192):
        super().__init__()
        self.proj = nn.Linear(dim, vocab)

    def forward(self, h):
        kind = h.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else h.dtype
        buf = torch.empty(h.shape[0], self.proj.out_features, device=h.device, dtype=dtype)
        buf.copy_(self.proj(h))
        return (buf * buf).mean()


model = ChunkedHead().cuda()   # (its input is the float32 batch)
opt = torch.optim.AdamW(model.parameters())
for step in range(3):
    x = torch.randn(2048, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
