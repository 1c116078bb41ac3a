"""The training loop of periodic_eval_train.py, kept in a module beside it (a project's train.py
importing its own trainer): the loop, its periodic evaluation and its logging."""
import torch
from torch.nn import functional as F


@torch.no_grad()
def evaluate(model, batch):
    model.eval()
    x = torch.randn(batch, 256, device="cuda")
    loss = F.cross_entropy(model(x), torch.zeros(batch, dtype=torch.long, device="cuda"))
    model.train()
    return loss


def sample(model):
    return model(torch.randn(4096, 256, device="cuda")).argmax(dim=1)


def train(model, opt, args):
    step = 0
    for epoch in range(1000):
        for _ in range(100):
            x = torch.randn(args.batch_size, 256, device="cuda")
            loss = F.cross_entropy(model(x), torch.zeros(args.batch_size, dtype=torch.long, device="cuda"))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % args.log_every == 0:
                print(f"step {step} loss {loss.item():.3f}")
            if step % args.eval_every == 0:
                print("eval", evaluate(model, args.eval_batch).item())
            if args.sample:
                if step % 5000 == 0:
                    sample(model)
