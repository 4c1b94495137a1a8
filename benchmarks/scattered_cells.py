"""What the H200's memory gives for scattered cells: the ceiling of an in-place cell permutation.

An in-place permutation of 128-byte cells (the BlockMajorK layouts: DeepSeek FP8 block, BF16 block)
reads and writes cells scattered over each expert. This measures, on Qwen3-235B W13-sized experts
(128 x 25 MB), a kernel that moves every cell of each expert once, out of place, with its reads
and/or writes at random cells of 128-1024 B, against ``copy_`` of the same bytes in the same run; then
128-byte cells scattered both ways within experts of ``--expert-mb`` sizes (how far apart scattered
cells may lie); then the shipped cycle plan of the BF16 block W13 map run the same way out of place
(its access pattern without the in-place order) and in place (``execute_in_place``).

    PYTHONPATH=. python3 benchmarks/scattered_cells.py --out benchmarks/results/h200_scattered_cells.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bench_transforms import ratio_to_copy, save_results  # noqa: E402

from fimoe_lab import builders  # noqa: E402
from fimoe_lab.kernels import default_scratch_experts, execute_in_place  # noqa: E402
from fimoe_lab.kernels.cycles import cycle_plan  # noqa: E402


@triton.jit
def _move_cells(x_ptr, y_ptr, src_ptr, dst_ptr, n_cells, expert_words, W: tl.constexpr, BM: tl.constexpr):
    """``y[e, dst[k]] = x[e, src[k]]`` for ``BM`` slots ``k`` of expert ``program_id(1)``; cells of ``W`` words."""
    k = tl.program_id(0) * BM + tl.arange(0, BM)
    m = k < n_cells
    e = tl.program_id(1).to(tl.int64)
    s = tl.load(src_ptr + k, mask=m, other=0).to(tl.int64)
    d = tl.load(dst_ptr + k, mask=m, other=0).to(tl.int64)
    c = tl.arange(0, W)
    v = tl.load(x_ptr + e * expert_words + s[:, None] * W + c[None, :], mask=m[:, None])
    tl.store(y_ptr + e * expert_words + d[:, None] * W + c[None, :], v, mask=m[:, None])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--expert-mb", type=int, nargs="*", default=[2, 8, 16, 32, 64, 256], help="expert sizes to scatter within"
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    experts, expert_bytes = 128, 3072 * 8192
    x = torch.randint(-(2**31), 2**31 - 1, (experts, expert_bytes // 4), dtype=torch.int32, device=dev)
    y = torch.empty_like(x)
    g = torch.Generator().manual_seed(1)
    out: dict[str, float] = {}
    for cell in (128, 256, 512, 1024):
        n, w, bm = expert_bytes // cell, cell // 4, max(1, 16384 // cell)
        ident = torch.arange(n, dtype=torch.int32, device=dev)
        rp, rq = (torch.randperm(n, generator=g).to(torch.int32).to(dev) for _ in range(2))
        for name, s, d in (
            ("sequential", ident, ident),
            ("reads scattered", rp, ident),
            ("writes scattered", ident, rq),
            ("both scattered", rp, rq),
        ):

            def move(s=s, d=d, n=n, w=w, bm=bm):
                _move_cells[(triton.cdiv(n, bm), experts)](x, y, s, d, n, expert_bytes // 4, W=w, BM=bm, num_warps=4)

            out[f"{cell} B cells, {name}"] = ratio_to_copy(move, lambda: y.copy_(x), dev, args.rounds)
            print(f"{cell:>5} B cells, {name:<17} {out[f'{cell} B cells, {name}']:.3f}", flush=True)
    # 128-byte cells scattered both ways within experts of other sizes, the same total bytes
    del y
    for mb in args.expert_mb:
        eb = mb << 20
        xs = x.view(-1)[: (x.numel() * 4 // eb) * eb // 4].view(-1, eb // 4)
        ys = torch.empty_like(xs)
        n = eb // 128
        rp, rq = (torch.randperm(n, generator=g).to(torch.int32).to(dev) for _ in range(2))

        def scattered(xs=xs, ys=ys, rp=rp, rq=rq, n=n, eb=eb):
            _move_cells[(triton.cdiv(n, 128), xs.shape[0])](xs, ys, rp, rq, n, eb // 4, W=32, BM=128, num_warps=4)

        out[f"128 B cells, both scattered, {mb} MB experts"] = ratio_to_copy(
            scattered, lambda: ys.copy_(xs), dev, args.rounds
        )
        print(
            f"128 B cells, both scattered, {mb:>3} MB experts {out[f'128 B cells, both scattered, {mb} MB experts']:.3f}"
        )
        del xs, ys
    y = torch.empty_like(x)
    em = builders.plan_trtllm_bf16_block_layout(3072, 4096, 1536, True).w13.compiled()
    plan = cycle_plan(em, 128)
    d, s, _ = plan.on(dev)
    s = torch.where(s >= 0, s, d)  # a saved cell: read it where it is (out of place nothing is overwritten)

    def along_plan():
        _move_cells[(triton.cdiv(plan.moved, 128), experts)](
            x, y, s, d, plan.moved, expert_bytes // 4, W=32, BM=128, num_warps=4
        )

    out["BF16 block W13 cycle plan, out of place"] = ratio_to_copy(along_plan, lambda: y.copy_(x), dev, args.rounds)
    xb, sc = x.view(torch.uint8), default_scratch_experts(experts)
    out["BF16 block W13, in place"] = ratio_to_copy(
        lambda: execute_in_place(em, xb, sc), lambda: y.copy_(x), dev, args.rounds
    )
    for k in list(out)[-2:]:
        print(f"{k:<45} {out[k]:.3f}", flush=True)
    if args.out:
        save_results(args.out, ratio_to_copy=out)


if __name__ == "__main__":
    main()
