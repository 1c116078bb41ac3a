"""Fine-tuning with transformers' Trainer (bf16, its default AdamW), as most LLM fine-tuning jobs run;
its output_dir is written in the estimate's temp dir. ``--8bit``: bitsandbytes' 8-bit AdamW and
gradient checkpointing, as memory-saving fine-tuning recipes set them."""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 1000, (32,))
        return {"input_ids": ids, "labels": ids}


cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128)
args = TrainingArguments(output_dir="out", per_device_train_batch_size=6, max_steps=20, bf16=True,
                         logging_steps=5, save_strategy="no", report_to=[],
                         optim="adamw_bnb_8bit" if "--8bit" in sys.argv else "adamw_torch",
                         gradient_checkpointing="--8bit" in sys.argv)
Trainer(model=LlamaForCausalLM(cfg), args=args, train_dataset=Tokens()).train()
