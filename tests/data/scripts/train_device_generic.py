"""A training loop in the style of newer device-generic scripts (written for vest's tests): it picks
the device through torch.accelerator, pins its host batches, overlaps the copy on a side stream made
with torch.Stream, enters it by keyword (torch.cuda.stream(stream=...)), draws dropout noise from a
cuda Generator, times each step with events and logs memory queries."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--width", type=int, default=256)
args = p.parse_args()

assert torch.accelerator.is_available()
device = torch.accelerator.current_accelerator()
torch.accelerator.set_device_index(0)
idx = torch.accelerator.current_device_index()
gen = torch.Generator(device=device.type)
gen.manual_seed(1234)
assert gen.device.type == "cuda"
cpu_gen = torch.Generator()
cpu_gen.manual_seed(0)

model = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, 10)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
side = torch.Stream(device=device)
copy_stream = torch.cuda.Stream(priority=-1)
assert isinstance(side, torch.Stream) and isinstance(copy_stream, torch.Stream)
start, end = torch.Event(device=device, enable_timing=True), torch.cuda.Event(enable_timing=True)

host = torch.randn(args.batch_size * 8, 64, generator=cpu_gen).pin_memory()
assert host.is_pinned()
labels = torch.randint(0, 10, (args.batch_size * 8,), generator=cpu_gen)
staging = torch.empty(args.batch_size, 64, pin_memory=True)

for step in range(100):
    lo = step % 8 * args.batch_size
    with torch.cuda.stream(stream=copy_stream):
        x = host[lo:lo + args.batch_size].to(device, non_blocking=True)
        y = labels[lo:lo + args.batch_size].to(device, non_blocking=True)
    torch.cuda.current_stream().wait_stream(copy_stream)
    x.record_stream(torch.cuda.current_stream())
    start.record()
    noise = torch.rand(x.shape, device=device, generator=gen)
    loss = nn.functional.cross_entropy(model(x * (noise > 0.1)), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    end.record()
    torch.accelerator.synchronize()
    ms = start.elapsed_time(end)
    used = torch.cuda.memory_allocated(device) + torch.accelerator.memory_allocated(idx)
    free, total = torch.cuda.mem_get_info()
    print(f"step {step} {ms:.1f} ms {used} B {free}/{total} {torch.cuda.memory_stats()['allocated_bytes.all.peak']}")
