"""Fine-tuning that starts from weights read from a checkpoint file and grows the vocabulary, as
Hugging Face scripts do after from_pretrained (transformers' resize_token_embeddings ends with
``old.weight.data = new.weight.data``; stanford_alpaca then averages the old rows into the new
ones on the host): a freshly built embedding's weight assigned into a loaded one. --by-hand: the
other way, a tensor read from a safetensors file assigned into a freshly built layer's weight
(``layer.weight.data = state["w"]``). Then the model moves to the GPU and trains."""
import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--vocab", type=int, default=1000)
p.add_argument("--added", type=int, default=24)
p.add_argument("--by-hand", action="store_true")
args = p.parse_args()
D = 64

torch.save({"emb": torch.randn(args.vocab, D), "head": torch.randn(args.vocab, D)}, "base.pt")
state = torch.load("base.pt", map_location="cpu")

emb, head = nn.Embedding(args.vocab, D), nn.Linear(D, args.vocab, bias=False)
if args.by_hand:
    from safetensors import torch as st

    with open("base.safetensors", "wb") as f:
        f.write(st.save(state))
    state = st.load_file("base.safetensors")
    emb.weight.data = state["emb"]
    head.weight.data = state["head"]
    emb.weight.data[0] = emb.weight.data[1:].mean(dim=0)   # a host op on the loaded rows
else:
    emb.weight, head.weight = nn.Parameter(state["emb"]), nn.Parameter(state["head"])   # as loaded
    for old in (emb, head):   # grow by --added rows, the new ones the old rows' mean
        fresh = nn.Embedding(args.vocab + args.added, D)   # built here: its weight is a new tensor
        fresh.weight.data[:args.vocab] = old.weight.data
        old.weight.data = fresh.weight.data
        old.weight.data[-args.added:] = old.weight.data[:-args.added].mean(dim=0, keepdim=True)
    emb.num_embeddings = head.out_features = args.vocab + args.added

model = nn.Sequential(emb, nn.Linear(D, D), nn.GELU(), head).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
n = head.out_features
for _ in range(5):
    x = torch.randint(0, n, (8, 32)).cuda()
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
