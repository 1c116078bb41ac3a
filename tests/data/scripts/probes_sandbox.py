"""Tries what an estimate must not do; each attempt that gets through is written to stdout."""
import os
import socket
import subprocess
import sys
import threading
import time

import torch

port = int(os.environ["VEST_TEST_PORT"])
marker = os.environ["VEST_TEST_MARKER"]
try:
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    print("NETWORK-OK")
except PermissionError as e:
    print("network refused:", e)
try:
    # a Python child running a file: its GPU work would be missing from the estimate (children.py)
    subprocess.Popen([sys.executable, "train_worker.py", marker])
    print("SPAWN-OK")
except PermissionError as e:
    print("spawn refused:", e)
threading.Thread(target=time.sleep, args=(300,), daemon=False).start()   # must not outlive the estimate
with open(os.path.join(os.environ["VEST_TEST_OUTSIDE"], "leak.txt"), "w") as f:   # redirected
    f.write("should land in the temp dir")
model = torch.nn.Linear(4, 4).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(2, 4, device="cuda")).sum().backward()
opt.step()
opt.step()
opt.step()
