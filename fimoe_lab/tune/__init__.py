"""Tuning: which TRTLLM-Gen MoE tactics a shape has, and which padding is fastest and one convert applies.

    from fimoe_lab.tune import TacticOracle
    from fimoe_lab.tune.sweep import run, sweep
    o = TacticOracle()                      # GPU, else built module + shim, else the validity model
    o.query("nvfp4", "swiglu", hidden=3072, intermediate=1920, experts=128, top_k=6,
            tokens=8, per_token=True).count            # 528
    s = run("qwen3-30b-a3b", "nvfp4", tp=8)            # rows + attrs, no torch or pandas
    df = sweep("qwen3-30b-a3b", "nvfp4", tp=8)         # the same as a pandas DataFrame

Formats, activations and layouts are the rows of :mod:`fimoe_lab.specs`
(``specs.tuner_formats()``); the rank shards and the padding ``convert`` applies come from
:mod:`fimoe_lab.shapes` (torch-free), the predicted times from :mod:`fimoe_lab.tune.cost`,
live GEMM timings on a CUDA GPU from :mod:`fimoe_lab.tune.timing`; ``sweep`` needs pandas,
its figures are drawn by :mod:`fimoe_lab.viz.figures` (matplotlib).
"""

from .oracle import OracleError, TacticAnswer, TacticOracle, TacticQuery  # noqa: F401
