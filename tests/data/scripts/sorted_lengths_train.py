"""Utterances sorted by length, shortest first (SpeechBrain's default `sorting: ascending`, ESPnet
and fairseq buckets), padded per batch, with an augmentation whose choice is a random draw on the
GPU read on the host (SpeechBrain's Augmenter): the batches grow through the epoch."""
import torch

lengths = sorted(int(n) for n in torch.randint(1600, 12800, (64,)))
model = torch.nn.Sequential(torch.nn.Conv1d(1, 32, 40, stride=16), torch.nn.ReLU(), torch.nn.Conv1d(32, 8, 1)).cuda()
opt = torch.optim.Adam(model.parameters())
for i in range(0, 64, 8):
    batch = torch.nn.utils.rnn.pad_sequence([torch.randn(n) for n in lengths[i:i + 8]], batch_first=True)
    x = batch.unsqueeze(1).cuda()
    n_aug = int(torch.randint(1, 3, (1,), device="cuda"))   # how many augmentations this batch
    x = x * (1.0 + 0.1 * n_aug)
    model(x).logsumexp(1).mean().backward()
    opt.step()
    opt.zero_grad()
