"""torch strided copies of the engine layouts against a contiguous copy (plain torch, no fimoe_lab).

One DeepSeek-V3 TP8 W13 (256 experts x 512 rows x 7168 bytes): the FP8 rotate (gated interleave +
epilogue shuffle), the DeepSeek block shuffle (shuffle + BlockMajorK), BlockMajorK alone and the
W13 -> W31 swap, each a permute of a view copied with ``copy_`` in 16-byte (``complex128``), 8-
and 4-byte words; an ``index_select`` row gather; in place as copy-aside + strided copy back in
chunks of 5 to 256 experts (with the host's time); the same strided copy while Triton is imported
on another thread. Medians of 5 calls timed with events; ``first_s``: the first call of each,
host clock.

    python3 benchmarks/probe_strided_copies.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch

E, M, C = 256, 512, 7168
WORDS = {"c128": (torch.complex128, 16), "i64": (torch.int64, 8), "i32": (torch.int32, 4)}


def event_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def layouts(x: torch.Tensor, out: torch.Tensor, dtype: torch.dtype, wb: int) -> dict:
    """name -> a function copying ``x`` into ``out`` in that layout, in words of ``wb`` bytes."""
    xv, ov = x.view(torch.uint8).view(dtype), out.view(torch.uint8).view(dtype)
    cw, kb, bw, half = C // wb, C // 128, 128 // wb, M // 2

    def rotate():  # in (E, a0:2, b:M/32, c:8, a1:2, C) -> out (E, b, a1, a0, c, C)
        ov.view(E, M // 32, 2, 2, 8, cw).copy_(xv.view(E, 2, M // 32, 8, 2, cw).permute(0, 2, 4, 1, 3, 5))

    def deepseek():  # shuffle (tile 64) + BlockMajorK: out (E, kb, b, a, c, 128 B) from row b*16 + c*2 + a
        ov.view(E, kb, M // 16, 2, 8, bw).copy_(xv.view(E, M // 16, 8, 2, kb, bw).permute(0, 4, 1, 3, 2, 5))

    def block_major_k():
        ov.view(E, kb, M, bw).copy_(xv.view(E, M, kb, bw).permute(0, 2, 1, 3))

    def swap():
        src, dst = xv.view(E, 2, half, cw), ov.view(E, 2, half, cw)
        dst[:, 0].copy_(src[:, 1])
        dst[:, 1].copy_(src[:, 0])

    return {"rotate_w13": rotate, "deepseek_w13": deepseek, "bmk_only": block_major_k, "swap": swap}


def in_place(x: torch.Tensor, chunk: int):
    """The rotate in place: each chunk of experts copied aside, then strided-copied back."""
    per = M * C // 8
    scratch = torch.empty(chunk * per, dtype=torch.int64, device=x.device)
    xv = x.view(E, per)

    def run():
        for start in range(0, E, chunk):
            n = min(chunk, E - start)
            part, sc = xv[start : start + n], scratch[: n * per].view(n, per)
            sc.copy_(part)
            src = sc.view(n, 2, M // 32, 8, 2, C // 8).permute(0, 2, 4, 1, 3, 5)
            part.view(n, M // 32, 2, 2, 8, C // 8).copy_(src)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    res: dict = {"torch": torch.__version__, "dev": torch.cuda.get_device_name(), "python": sys.version}
    x = torch.randint(-(2**62), 2**62, (E * M * C // 8,), dtype=torch.int64, device="cuda")
    out = torch.empty_like(x)
    t = time.perf_counter()
    out.copy_(x)
    torch.cuda.synchronize()
    res["first_copy_s"] = time.perf_counter() - t
    res["copy_ms"] = event_ms(lambda: out.copy_(x))

    def alloc_copy() -> float:  # a fresh cudaMalloc and a copy, host clock
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        t = time.perf_counter()
        torch.empty_like(x).copy_(x)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    res["alloc_copy_ms"] = sorted(alloc_copy() for _ in range(5))[2]
    for word, (dtype, wb) in WORDS.items():
        for name, fn in layouts(x, out, dtype, wb).items():
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            first = time.perf_counter() - t
            ms = event_ms(fn)
            res[f"{name}/{word}"] = dict(ms=ms, ratio=res["copy_ms"] / ms, first_s=first)
    layouts(x, out, torch.complex128, 16)["rotate_w13"]()
    wide = out.clone()
    layouts(x, out, torch.int64, 8)["rotate_w13"]()
    res["c128_bitexact"] = bool(torch.equal(wide, out))
    idx = torch.randperm(M, device="cuda")
    xr, outr = x.view(E, M, C // 8), out.view(E, M, C // 8)
    ms = event_ms(lambda: torch.index_select(xr, 1, idx, out=outr))
    res["index_select_rows/i64"] = dict(ms=ms, ratio=res["copy_ms"] / ms)
    for chunk in (5, 16, 64, 256):
        fn = in_place(x, chunk)
        fn()
        ms = event_ms(fn)
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        host = time.perf_counter() - t
        torch.cuda.synchronize()
        res[f"inplace_chunk{chunk}"] = dict(ms=ms, ratio=res["copy_ms"] / ms, host_ms=host * 1e3)
    rotate = layouts(x, out, torch.int64, 8)["rotate_w13"]

    def loop(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            rotate()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e3

    res["loop_ms_alone"] = loop(20)

    def import_triton() -> None:
        import triton  # noqa: F401
        from triton.runtime.cache import triton_key

        triton_key()

    thread, t = threading.Thread(target=import_triton), time.perf_counter()
    thread.start()
    res["loop_ms_with_triton_import"] = loop(20)
    thread.join()
    res["triton_import_s"] = time.perf_counter() - t
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
