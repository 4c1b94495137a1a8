"""Tuning: which TRTLLM-Gen MoE tactics a shape has, and which padding keeps them all.

    from fimoe_lab.tune import TacticOracle
    from fimoe_lab.tune.sweep import sweep
    o = TacticOracle()                      # GPU, else built module + shim, else snapshot
    o.query("nvfp4", "swiglu", hidden=3072, intermediate=1920, experts=128, top_k=6,
            tokens=8, per_token=True).count            # 528
    df = sweep("qwen3-30b-a3b", "nvfp4", tp=8)         # pandas DataFrame

Build the module once for live answers: ``python -m fimoe_lab.tune.build``.
Formats, activations and layouts are the rows of :mod:`fimoe_lab.specs`
(``specs.tuner_formats()``); ``sweep`` needs pandas; its figures are drawn by
:mod:`fimoe_lab.viz.figures` (matplotlib).
"""

from .oracle import OracleError, TacticAnswer, TacticOracle, TacticQuery  # noqa: F401
