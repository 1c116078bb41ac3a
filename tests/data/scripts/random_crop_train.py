"""hlb-CIFAR10's style: the whole data set on the GPU; a setup pass of the first layer under
no_grad over many images (its whitening); each epoch cropped at random centres drawn in place
(torch.empty(...).random_()) and cut out with masked_select; then mini-batches of 16."""
import torch
from torch import nn

N, B, C, S, CROP = 256, 16, 3, 36, 32
images = torch.randn(N, C, S, S, device="cuda").half()
net = nn.Sequential(nn.Conv2d(C, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * CROP * CROP, 10)).cuda().half()
with torch.no_grad():
    net[0](images[:128, :, :CROP, :CROP])   # the setup pass: 128 images, not the batch


def crop(x, size):
    cy = torch.empty(x.shape[0], dtype=torch.long, device=x.device).random_(size // 2, x.shape[-2] - size // 2)
    cx = torch.empty(x.shape[0], dtype=torch.long, device=x.device).random_(size // 2, x.shape[-1] - size // 2)
    ys = torch.arange(x.shape[-2], device=x.device).view(1, 1, -1, 1) - cy.view(-1, 1, 1, 1)
    xs = torch.arange(x.shape[-1], device=x.device).view(1, 1, 1, -1) - cx.view(-1, 1, 1, 1)
    mask = (ys >= -(size // 2)) * (ys < size // 2) * (xs >= -(size // 2)) * (xs < size // 2)
    return torch.masked_select(x, mask).view(x.shape[0], x.shape[1], size, size)


opt = torch.optim.SGD(net.parameters(), lr=0.01)
for epoch in range(10):
    cropped = crop(images, CROP)
    for i in range(N // B):
        loss = net(cropped[i * B:(i + 1) * B]).float().logsumexp(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
