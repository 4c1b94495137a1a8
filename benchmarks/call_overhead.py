"""Host time per execute() call on a tiny CUDA map (launch-bound), and GPU time of a 7.5 GB one.

    (cd OLD_TREE && PYTHONPATH=$PWD python3 /path/to/call_overhead.py old)   # e.g. a git archive of 53eb766
    python3 benchmarks/call_overhead.py new

Works with both the 0.1.0 API (execute(IndexMap, ...)) and 0.2.0 (execute(IndexMap.compiled(), ...)).
"""

import sys
import time

import torch

from fimoe_lab import steps
from fimoe_lab.kernels import execute

m = steps.swap_w13_to_w31_rows(256, 64)
em = m.compiled() if hasattr(m, "compiled") else m
x = torch.randint(0, 255, (4, 256, 64), dtype=torch.uint8, device="cuda")
out = torch.empty_like(x)
for _ in range(200):
    execute(em, x, out)
torch.cuda.synchronize()
best = []
for _ in range(5):
    t = time.perf_counter()
    for _ in range(2000):
        execute(em, x, out)
    torch.cuda.synchronize()
    best.append((time.perf_counter() - t) / 2000 * 1e6)
big = steps.swap_w13_to_w31_rows(4096, 7168)
emb = big.compiled() if hasattr(big, "compiled") else big
xb = torch.randint(0, 255, (256, 4096, 7168), dtype=torch.uint8, device="cuda")
ob = torch.empty_like(xb)
for _ in range(3):
    execute(emb, xb, ob)
torch.cuda.synchronize()
ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
ts = []
for _ in range(20):
    ev[0].record()
    execute(emb, xb, ob)
    execute(emb, xb, ob)
    ev[1].record()
    torch.cuda.synchronize()
    ts.append(ev[0].elapsed_time(ev[1]) / 2)
ts.sort()
print(
    sys.argv[1],
    "tiny call us (5 runs):",
    [round(b, 1) for b in best],
    "big call ms median/min:",
    round(ts[10], 4),
    round(ts[0], 4),
)
