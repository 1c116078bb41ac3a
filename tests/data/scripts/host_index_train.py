"""A graph-style script: labels, a training mask and index permutations built on the host, moved to
the GPU, then used for boolean-mask indexing, .nonzero(), .item() and .sum() counts. The real run
knows every one of those values (they came from the host); the script asserts them, so a stand-in
(1, False, an empty selection) fails it instead of passing silently."""
import torch
import torch.nn.functional as F
from torch import nn

N, FEATURES = 300, 16
labels = (torch.arange(N) % 5).to("cuda")               # host-built labels, 5 classes
num_classes = labels.max().item() + 1                     # .item() of a host value moved over
assert num_classes == 5, num_classes
train_mask = torch.zeros(N, dtype=torch.bool)
train_mask[:180] = True
train_mask = train_mask.cuda()
idx_val = torch.randperm(N)[180:].to("cuda")
features = torch.randn(N, FEATURES).cuda()

model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, num_classes)).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(5):
    n_train = int(train_mask.sum())
    assert n_train == 180 and train_mask.nonzero().shape == (180, 1), n_train
    out = model(features[train_mask])                     # the model's input: (180, 16)
    loss = F.cross_entropy(out, labels[train_mask])
    loss.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        val = model(features[idx_val])
        acc = (val.argmax(1) == labels[idx_val]).float().mean().item()   # from the model: a stand-in
    print(f"step {step} loss {loss.item():.4f} acc {acc:.3f} train nodes {n_train}")
