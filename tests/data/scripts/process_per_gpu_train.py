"""Training in a process per GPU that the script starts itself (I-JEPA's main.py: one spawn
Process per device, then __main__ ends; --join waits for them)."""
import argparse
import multiprocessing as mp

import torch


def train(device):
    model = torch.nn.Linear(64, 64).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        model(torch.randn(8, 64, device=device)).sum().backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--join", action="store_true")
    args = p.parse_args()
    mp.set_start_method("spawn")
    procs = [mp.Process(target=train, args=("cuda:0",))]
    for proc in procs:
        proc.start()
    if args.join:
        for proc in procs:
            proc.join()
