"""In place at TP8 sizes: the cycle kernel against copy-then-gather in chunks of 1-16 experts, kernel time.

For each map (``plan_layer(fmt, "trtllm", 256, H)``'s ``w13`` and ``w2``: Qwen3-235B TP8 BF16 block, H 4096, 128
experts; DeepSeek-V3 TP8 FP8 block, H 7168, 256 experts) it times ``copy_`` of the layer's bytes, the prebuilt cycle
kernel in place, and the prebuilt executor's ``copy-then-gather`` with chunks of 1, 2, 4, 8 and 16 experts (each chunk
copied aside and gathered back), as ratios of the copy's kernel time (and with the gaps between a call's kernels).
Each chunked result is checked against the out-of-place gather first. Needs a CUDA device.

    PYTHONPATH=. python3 benchmarks/inplace_chunks.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from in_stream import stream  # noqa: E402  (the kernel-time measure every in-place figure uses)

from fimoe_lab.kernels import default_scratch_experts, execute, execute_in_place, prebuilt  # noqa: E402
from fimoe_lab.recipes import plan_layer  # noqa: E402

MAPS = (("qwen3-tp8 bf16", "bf16", 256, 4096, 128), ("v3-tp8 fp8-block", "fp8-block", 256, 7168, 256))
CHUNKS = (1, 2, 4, 8, 16)


def main() -> None:
    dev = torch.device("cuda")
    for label, fmt, inter, hidden, experts in MAPS:
        for tensor in ("w13", "w2"):
            m = getattr(plan_layer(fmt, "trtllm", inter, hidden), tensor)
            em = m.compiled()
            prebuilt.build_plan(em, True)
            prebuilt.build_plan(em, False)
            x = torch.randint(0, 256, (experts, m.in_bytes), dtype=torch.uint8, device=dev)
            ref = torch.empty((experts, m.out_bytes), dtype=torch.uint8, device=dev)
            execute(em, x, ref, "prebuilt")
            dst = torch.empty_like(x)
            copy = stream(lambda: dst.copy_(x), 8)["kernel_us"]
            y = x.clone()
            scratch = default_scratch_experts(experts, m.in_bytes)
            cycles = stream(lambda: execute_in_place(em, y, scratch, "prebuilt"), 8)["kernel_us"]
            line = f"{label} {tensor}: {m.in_bytes / 2**20:.2f} MB/expert, copy {copy:7.1f} us"
            line += f" | cycles {copy / cycles:.3f}"
            for k in CHUNKS:
                y = x.clone()
                config = {"inplace": "copy-then-gather"}
                execute_in_place(em, y, k, "prebuilt", config=config)
                torch.cuda.synchronize()
                if not torch.equal(y, ref.view_as(y)):
                    raise SystemExit(f"{label} {tensor}: copy-then-gather in chunks of {k} gave other bytes")
                s = stream(lambda: execute_in_place(em, y, k, "prebuilt", config=config), 4)
                line += f" | {k}: {copy / s['kernel_us']:.3f} (+gaps {copy / (s['kernel_us'] + s['gap_us']):.3f})"
            print(line, flush=True)
            del x, y, dst, ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
