#!/usr/bin/env python3
"""cuDNN's RNN reserve space, measured on a real GPU (run by scripts/gpu-check.sh).

    python scripts/measure_rnn_reserve.py --out benchmarks/gpu/rnn-reserve.csv

Without a GPU the estimator cannot size the reserve space cuDNN keeps from an RNN's forward for its
backward (cudnnGetRNNTempSpaceSizes needs a cuDNN handle on a device; torch's meta kernel of
aten._cudnn_rnn gives it 0 bytes), so nn.LSTM/GRU/RNN estimates are flagged (CUDNN_RNN_NOTE). This
records, for a grid of RNN shapes, the reserve tensor aten._cudnn_rnn returns in training mode (read
from the op's outputs through a dispatch mode, not inferred from memory counters) beside the elements
of one layer's per-step state, and one training step's torch.cuda.max_memory_allocated, so that the
reserve's size can be written down as a rule of the cuDNN version and checked.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MODES = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "RNN_TANH": torch.nn.RNN}
GRID = {                      # small enough for any GPU, varied in every dimension cuDNN is told
    "num_layers": (1, 2),
    "hidden": (128, 650),
    "batch": (8, 20),
    "seq": (35, 100),
    "bidirectional": (False, True),
    "dtype": ("float32", "float16"),
}


class _Reserve(TorchDispatchMode):
    """The reserve tensors aten._cudnn_rnn returns (its 4th output) while active."""

    def __init__(self):
        super().__init__()
        self.bytes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._cudnn_rnn.default:
            self.bytes.append(out[3].numel() * out[3].element_size())
        return out


def measure(mode: str, num_layers: int, hidden: int, batch: int, seq: int, bidirectional: bool, dtype: str) -> dict:
    dt = getattr(torch, dtype)
    model = MODES[mode](hidden, hidden, num_layers=num_layers, bidirectional=bidirectional).cuda().to(dt)
    x = torch.randn(seq, batch, hidden, device="cuda", dtype=dt)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    watch = _Reserve()
    with watch:
        out, _ = model(x)
    out.float().sum().backward()
    torch.cuda.synchronize()
    dirs = 2 if bidirectional else 1
    return {"mode": mode, "num_layers": num_layers, "hidden": hidden, "batch": batch, "seq": seq,
            "bidirectional": int(bidirectional), "dtype": dtype,
            "reserve_bytes": sum(watch.bytes), "cudnn_calls": len(watch.bytes),
            # the unit a rule would be written in: elements of one layer-direction's state over the sequence
            "state_elems": num_layers * dirs * seq * batch * hidden,
            "step_peak_bytes": torch.cuda.max_memory_allocated() - base,
            "cudnn": torch.backends.cudnn.version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/gpu/rnn-reserve.csv")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("measure_rnn_reserve.py: no CUDA GPU here; run it where one is (scripts/gpu-check.sh)", file=sys.stderr)
        return 2
    torch.backends.cudnn.enabled = True
    rows = []
    for mode in MODES:
        for values in itertools.product(*GRID.values()):
            row = measure(mode, *values)
            rows.append(row)
            print(f"{mode:8} " + " ".join(f"{k}={row[k]}" for k in (*GRID, "reserve_bytes", "state_elems")))
    with open(ns.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"results: {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
