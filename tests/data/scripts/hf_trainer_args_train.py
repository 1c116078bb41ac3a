"""transformers' Trainer with its arguments from the command line (HfArgumentParser, as the
run_clm-style example scripts take them): --fsdp "full_shard auto_wrap" --fsdp_config X.json,
or --deepspeed ds.json, --bf16, --per_device_train_batch_size ... Its own small Llama.

    torchrun --nproc_per_node 4 hf_trainer_args_train.py --output_dir out --fsdp "full_shard auto_wrap" \
        --fsdp_config hf_fsdp_config.json --bf16 --per_device_train_batch_size 4 --max_steps 10
"""
import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


def build_model():
    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=4000, max_position_embeddings=256)
    return LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        ids = torch.randint(0, 4000, (128,))
        return {"input_ids": ids, "labels": ids}


if __name__ == "__main__":
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    args.report_to = []
    args.save_strategy = "no"
    Trainer(model=build_model(), args=args, train_dataset=Tokens()).train()
