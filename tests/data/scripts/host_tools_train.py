"""Host tools a library starts while it imports or introspects (a `python -c` query of sys.path as
jsonargparse makes, ctypes.util.find_library's ldconfig/gcc, a shell pipeline): they run, and the
script uses their real answers. A Python child running a training file is refused, whether
started directly or through a shell. --site-packages DIR: a library's own host query (a file of
an installed package naming no torch) runs. Then three optimizer steps."""
import ctypes.util
import json
import subprocess
import sys

import torch

out = subprocess.check_output([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path))"])
assert isinstance(json.loads(out), list)
assert ctypes.util.find_library("c"), "find_library ran no ldconfig"
assert subprocess.run("echo host | tr a-z A-Z", shell=True, capture_output=True, text=True).stdout == "HOST\n"
for cmd, shell in (([sys.executable, "worker.py"], False), ("cd . && python3 worker.py --rank 1", True)):
    try:
        subprocess.run(cmd, shell=shell)
        raise SystemExit(f"{cmd!r} started: its GPU work would be missing from the estimate")
    except PermissionError as e:
        assert "GPU work" in str(e), e
if len(sys.argv) > 2 and sys.argv[1] == "--site-packages":
    # a file of an installed package run as a host query (py-cpuinfo's `python cpuinfo.py --json`)
    # runs; one that names torch (a launcher, a library's worker) is refused
    import os

    tool = os.path.join(sys.argv[2], "cpuq", "cpuq.py")
    assert json.loads(subprocess.check_output([sys.executable, tool, "--json"])) == {"brand": "host cpu"}
    try:
        subprocess.run([sys.executable, os.path.join(sys.argv[2], "launchy", "run.py")])
        raise SystemExit("a library file that names torch started")
    except PermissionError as e:
        assert "GPU work" in str(e), e
model = torch.nn.Linear(16, 4).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(10):
    model(torch.randn(8, 16, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
