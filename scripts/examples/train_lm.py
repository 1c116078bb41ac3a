"""Causal language-model training with transformers, model built from a config (a vest-slurm example).

    python train_lm.py --n-layer 12 --n-embd 768 --seq-len 1024 --batch-size 8 --amp bf16
Synthetic token batches; nothing is downloaded.
"""

import argparse

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel


class RandomTokens(Dataset):
    def __init__(self, n, seq_len, vocab):
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (self.seq_len,))
        return {"input_ids": ids, "labels": ids.clone()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--amp", choices=["none", "fp16", "bf16"], default="none")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--out", default="lm-checkpoint")
    args = p.parse_args()

    config = GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab,
                        n_positions=max(1024, args.seq_len))
    model = GPT2LMHeadModel(config).cuda()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp == "fp16")
    loader = DataLoader(RandomTokens(args.batch_size * args.steps, args.seq_len, args.vocab),
                        batch_size=args.batch_size, num_workers=4)
    for step, batch in enumerate(loader):
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            outputs = model(**batch)
            loss = outputs.loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    model.save_pretrained(args.out)


if __name__ == "__main__":
    main()
