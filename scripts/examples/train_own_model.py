"""A script with its own model class: a small convolutional autoencoder trained with MSE (a vest-slurm example).

    python train_own_model.py --width 64 --image-size 128 --batch-size 32
``build_model`` is also the factory a #VEST line can name: scripts/examples/train_own_model.py:build_model
"""

import argparse

import torch
from torch import nn


class AutoEncoder(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.GELU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width), nn.GELU(),
            nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1), nn.GELU(),
        )
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(4 * width, 2 * width, 4, stride=2, padding=1), nn.GELU(),
            nn.ConvTranspose2d(2 * width, width, 4, stride=2, padding=1), nn.GELU(),
            nn.ConvTranspose2d(width, 3, 4, stride=2, padding=1),
        )

    def forward(self, x):
        return self.decoder(self.encoder(x))


def build_model(width: int = 64) -> nn.Module:
    return AutoEncoder(width)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=500)
    args = p.parse_args()

    device = "cuda"
    model = build_model(args.width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.MSELoss()
    for step in range(args.steps):
        x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
        optimizer.zero_grad()
        out = model(x)
        loss = loss_fn(out, torch.randn(out.shape, device=device))
        loss.backward()
        optimizer.step()
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f} peak {torch.cuda.max_memory_allocated() >> 20} MiB")
    torch.save(model.state_dict(), "autoencoder.pt")


if __name__ == "__main__":
    main()
