"""A Llama-style model (grouped-query attention, SDPA) trained with the all-ones attention mask a
Trainer's collator passes (--mask), or with none: on a GPU transformers drops an all-ones mask
(is_causal instead) and SDPA takes the grouped key/value heads natively, so both need the same."""
import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--mask", action="store_true")
args = p.parse_args()

config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                     attn_implementation="sdpa")
model = LlamaForCausalLM(config).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(4):
    ids = torch.randint(0, 512, (4, 256)).cuda()
    mask = torch.ones_like(ids) if args.mask else None
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
