"""LoRA fine-tuning with peft, as an LLM fine-tuning job runs it: a frozen base model, adapters on
the attention projections, the optimizer over the adapters only; the model is called with keyword
arguments only (its input reaches the hooks through the token embedding)."""
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128)
model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
model.cuda()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
for step in range(100):
    ids = torch.randint(0, cfg.vocab_size, (6, 32), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
