"""ImageNet-style training of a torchvision model on synthetic data (a vest-slurm example).

    python train_imagenet.py --arch resnet50 --batch-size 64 --optimizer sgd --amp bf16 --epochs 1
"""

import argparse
import time

import torch
import torchvision
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SyntheticImageNet(Dataset):
    """Random images and labels, made on the fly like a decoded JPEG batch."""

    def __init__(self, n: int, size: int, classes: int = 1000):
        self.n, self.size, self.classes = n, size, classes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.randn(3, self.size, self.size), torch.randint(0, self.classes, ()).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--amp", choices=["none", "fp16", "bf16"], default="none")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps-per-epoch", type=int, default=100)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--checkpoint", default="checkpoint.pt")
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.get_model(args.arch, weights=None).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    criterion = nn.CrossEntropyLoss()
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=args.weight_decay)
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp == "fp16")
    data = SyntheticImageNet(args.batch_size * args.steps_per_epoch, args.image_size)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, pin_memory=True)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for step, (images, target) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            if args.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                output = model(images)
                loss = criterion(output, target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if step % 10 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} "
                      f"mem {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB {time.time() - t0:.1f}s", flush=True)
        torch.save({"model": model.state_dict(), "epoch": epoch}, args.checkpoint)


if __name__ == "__main__":
    main()
