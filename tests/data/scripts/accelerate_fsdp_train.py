"""A Hugging Face accelerate loop launched with an FSDP config file (accelerate_fsdp.yaml: FSDP1
FULL_SHARD, TRANSFORMER_BASED_WRAP on LlamaDecoderLayer, bf16, 4 processes); the script itself
names no FSDP: Accelerator() reads what ``accelerate launch --config_file`` set.

    accelerate launch --config_file accelerate_fsdp.yaml accelerate_fsdp_train.py --batch-size 4
"""
import argparse

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM


def build_model():
    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=4000, max_position_embeddings=256)
    return LlamaForCausalLM(cfg)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    a = p.parse_args()
    acc = Accelerator()
    model = acc.prepare(build_model())
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0))
    for _ in range(10):
        ids = torch.randint(0, 4000, (a.batch_size, a.seq), device=acc.device)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
