"""Evaluation first, under torch.inference_mode() (Lightning's test/validate/predict, an eval
decorated with @torch.inference_mode): host batches moved to the GPU there by .to("cuda"),
.cuda() and .to(device, non_blocking=True); the evaluation's inputs are kept (a cache of the
validation set on the GPU), then the model trains."""
import torch
from torch import nn

device = torch.device("cuda")
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
host = [torch.randn(128, 256) for _ in range(3)]


@torch.inference_mode()
def evaluate():
    kept = [host[0].to("cuda"), host[1].cuda(), host[2].to(device, non_blocking=True)]
    return kept, sum(model(x).argmax(1).sum() for x in kept)


cache, hits = evaluate()
print("hits", int(hits))
for step in range(4):
    x, y = torch.randn(64, 256).to(device), torch.randint(0, 10, (64,)).to(device)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"{loss:.4f}")
