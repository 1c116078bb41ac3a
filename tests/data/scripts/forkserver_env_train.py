"""Environment workers in forkserver processes (stable-baselines3's SubprocVecEnv, Linux's default
there): the forkserver is handed each worker's pipes over a UNIX socket (sendmsg of descriptors)."""
import multiprocessing as mp

import torch


def worker(conn):
    while (msg := conn.recv()) is not None:
        conn.send([float(msg)] * 8)


if __name__ == "__main__":
    ctx = mp.get_context("forkserver")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=worker, args=(child,), daemon=True)
    p.start()
    model = torch.nn.Linear(8, 8).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        parent.send(step)
        obs = torch.tensor(parent.recv(), device="cuda")
        loss = model(obs).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    parent.send(None)
    p.join()
