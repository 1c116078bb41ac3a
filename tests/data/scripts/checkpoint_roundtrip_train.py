"""Checkpoints written and read back before and during training, in the habits of training scripts:
the initial weights saved and reloaded on the host, an atomic save (temp file, os.replace) of model
and optimizer resumed onto the GPU, a safetensors export read back, and with ``--hf`` a transformers
model through save_pretrained / from_pretrained with tied embeddings. The script checks what it
gets back, as a resume would."""
import os
import sys

import torch
from torch import nn

if "--hf" in sys.argv:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained("ckpt-hf")
    model = LlamaForCausalLM.from_pretrained("ckpt-hf").cuda()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(10):
        ids = torch.randint(0, 1000, (4, 32), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    sys.exit(0)

model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
torch.save({"model": model.state_dict(), "epoch": 0, "seen": torch.arange(5)}, "init.pt")
init = torch.load("init.pt", map_location="cpu")
assert init["epoch"] == 0 and init["seen"].tolist() == [0, 1, 2, 3, 4]
assert init["model"]["0.weight"].shape == (512, 256) and init["model"]["0.weight"].device.type == "cpu"
model.load_state_dict(init["model"])
model = model.cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(32, 256, device="cuda")).sum().backward()
opt.step()
opt.zero_grad()

torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, "last.pt.tmp")
os.replace("last.pt.tmp", "last.pt")
resume = torch.load("last.pt")   # onto the device it was saved from, as torch.load does
assert all(t.is_cuda for t in resume["model"].values())
assert sorted(resume["opt"]["state"][0]) == ["exp_avg", "exp_avg_sq", "step"]
model.load_state_dict(resume["model"])
opt.load_state_dict(resume["opt"])
del resume

from safetensors.torch import load_file, save_file

save_file({k: v.contiguous() for k, v in model.state_dict().items()}, "model.safetensors")
back = load_file("model.safetensors")
assert {k: tuple(v.shape) for k, v in back.items()} == {k: tuple(v.shape) for k, v in model.state_dict().items()}
del back
for step in range(10):
    model(torch.randn(32, 256, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
