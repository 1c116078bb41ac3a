"""Tries, from C (ctypes into libc), what an estimate must not do: write outside its temp dir, reach
the network, start a program; and os.posix_spawn from Python. Then trains three steps."""
import ctypes
import os
import socket
import struct

import torch

port = int(os.environ["VEST_TEST_PORT"])
marker = os.environ["VEST_TEST_MARKER"]
outside = os.environ["VEST_TEST_OUTSIDE"]
libc = ctypes.CDLL(None, use_errno=True)

for path in (os.path.join(outside, "c-leak.txt"), os.path.join(os.getcwd(), marker + ".c-leak")):
    fd = libc.open(path.encode(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    if fd >= 0:
        libc.write(fd, b"x", 1)
        libc.close(fd)
        print("C-WRITE-OK", path, flush=True)
    else:
        print("C write refused:", os.strerror(ctypes.get_errno()), flush=True)

fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
addr = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton("127.0.0.1") + bytes(8)
if fd >= 0 and libc.connect(fd, addr, len(addr)) == 0:
    print("C-CONNECT-OK", flush=True)
else:
    print("C connect refused:", os.strerror(ctypes.get_errno()), flush=True)

pid = ctypes.c_int()
script = f"echo x > {outside}/spawned.txt; exec sleep 300".encode()
argv = (ctypes.c_char_p * 5)(b"/bin/sh", b"-c", script, marker.encode(), None)
envp = (ctypes.c_char_p * 1)(None)
if libc.posix_spawn(ctypes.byref(pid), b"/bin/sh", None, None, argv, envp) == 0:
    print("C-SPAWN-OK", pid.value, flush=True)
try:
    os.posix_spawn("/bin/sh", ["/bin/sh", "-c", f"echo x > {outside}/py-spawned.txt; exec sleep 300", marker],
                   dict(os.environ))
    print("PY-SPAWN-OK", flush=True)
except PermissionError as e:
    print("os.posix_spawn refused:", e, flush=True)

model = torch.nn.Linear(4, 4).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(2, 4, device="cuda")).sum().backward()
    opt.step()
