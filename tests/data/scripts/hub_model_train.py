"""A model loaded with transformers' from_pretrained, as fine-tuning scripts load a checkpoint: from
the folder given (a local checkpoint) or a Hub name (fetched on first use). Since transformers 5,
from_pretrained also swaps layers (RMSNorm, rotary, activations) for kernels fetched from the
Hugging Face Hub unless USE_HUB_KERNELS says no."""
import sys

import torch
from transformers import LlamaForCausalLM

model = LlamaForCausalLM.from_pretrained(sys.argv[1]).cuda()
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(10):
    ids = torch.randint(0, 1000, (4, 32), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.3f}")
