"""Measured costs of a padding choice, next to the tactic counts of a sweep.

(a) :func:`measure_transform`: what our executors take to lay out w13 and w2 for each
padding (runs anywhere: CPU via numba/torch, CUDA via Triton/torch).
(b) :func:`moe_gemm_us`: one rank's two expert GEMMs on the GPU at hand (replayed from a
CUDA graph, as serving engines run decode) through
``torch._grouped_mm`` (bf16) or ``torch._scaled_grouped_mm`` (FP8 rowwise, where torch has
it and the GPU is SM90+): GEMM1 ``[m_e, H'] x [H', P*I']`` and GEMM2 ``[m_e, I'] x [I', H']``
per touched expert, ``T*k`` rows spread evenly over the ``E_T = round(E * (1 - (1 - k/E)^T))``
experts a batch touches under uniform routing (the cost model's count, at least 1). TRTLLM-Gen kernels run only on Blackwell, so on Hopper
this is the practical timing path (DESIGN §6); per-tactic TRTLLM-Gen timing needs a
Blackwell GPU. :func:`measure_sweep` times every padded shape of a sweep over its token
profile (``measured_us``, next to ``predicted_us``); :func:`measure_grouped_mm` the
padded vs unpadded ratio of a DataFrame sweep. Without a CUDA GPU they raise
:class:`~fimoe_lab.errors.OracleError` ("not measured on this device"): nothing is
estimated.

torch is imported when a function runs (the tuner imports this module only for ``--measure``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Optional

from ..errors import FimoeError, OracleError
from ..presets import ModelPreset, get_preset
from ..specs import FORMATS, get_activation

__all__ = [
    "measure_grouped_mm",
    "measure_sweep",
    "measure_transform",
    "moe_gemm_us",
    "gemm_dtype",
    "require_cuda",
    "timing_status",
]


def timing_status() -> str:
    """Says plainly whether padded-vs-unpadded GEMM timings can be measured here."""
    import torch

    if torch.cuda.is_available():
        return f"timings measurable on {torch.cuda.get_device_name(0)} (torch._grouped_mm)"
    return "not measured on this device: no CUDA GPU"


def require_cuda() -> Any:
    """The CUDA device to time on; :class:`OracleError` without one (nothing is estimated instead)."""
    try:
        import torch
    except ImportError:
        raise OracleError(
            "not measured on this device: torch is not installed", fix="install torch with CUDA"
        ) from None
    if not torch.cuda.is_available():
        raise OracleError(
            "not measured on this device: no CUDA GPU (--measure times torch._grouped_mm live)",
            fix="run --measure on a CUDA GPU (SM90 or newer), or drop --measure for the model estimate",
        )
    return torch.device("cuda")


def gemm_dtype(fmt: str) -> str:
    """``"fp8"`` for formats with FP8 activations and weights of one byte (timed as FP8 rowwise), else ``"bf16"``.

    FP4, MXFP4 and MxInt4 weights have no grouped GEMM in torch: they are timed in bf16 (an upper
    bound of their compute, not of their weight bytes).
    """
    spec = FORMATS[fmt]
    act = spec.tactics.dtype_act.lower() if spec.tactics else ""
    return "fp8" if "e4m3" in act and spec.values_per_byte == 1 else "bf16"


def median_ms(fn: Callable[[], object], device: Any, repeats: int = 10, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in ms: CUDA events on a GPU, ``perf_counter`` on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _shapes(df) -> dict[tuple[int, int], list[int]]:
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, row in enumerate(df.itertuples()):
        shapes.setdefault((int(row.intermediate), int(row.hidden)), []).append(i)
    return shapes


def _fp8_grouped(torch: Any, a: Any, w: Any, offs: Any) -> Callable[[], object]:
    """``a [M, K] x w[g]^T`` in FP8 E4M3 with rowwise float32 scales through ``torch._scaled_grouped_mm``."""
    a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    sa = torch.ones(a.shape[0], device=a.device, dtype=torch.float32)
    sb = torch.ones(w.shape[0], w.shape[1], device=a.device, dtype=torch.float32)
    wt = w8.transpose(-2, -1)
    return lambda: torch._scaled_grouped_mm(a8, wt, sa, sb, offs=offs, out_dtype=torch.bfloat16)


def moe_gemm_us(
    experts: int,
    top_k: int,
    tokens: int,
    intermediate: int,
    hidden: int,
    projections: int = 2,
    dtype: str = "bf16",
    repeats: int = 20,
    device: Optional[Any] = None,
) -> float:
    """Median microseconds of one rank's two expert GEMMs at ``tokens`` tokens (see the module docstring).

    ``intermediate``/``hidden``: the padded per-rank sizes; ``projections``: 2 gated (W13
    holds gate and up), 1 not; ``dtype``: ``bf16`` or ``fp8`` (rowwise scales, SM90+).
    Inputs are seeded random values (finite, never all zeros).
    """
    import torch

    dev = device if device is not None else require_cuda()
    rows = tokens * top_k
    groups = max(1, min(experts, rows, round(experts * (1.0 - (1.0 - top_k / experts) ** tokens))))
    per, extra = divmod(rows, groups)
    sizes = [per + (1 if g < extra else 0) for g in range(groups)]
    offs = torch.tensor(sizes, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    g = torch.Generator(device=dev).manual_seed(intermediate * 7919 + hidden * 31 + tokens)
    a = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16, generator=g)
    w13 = torch.randn(groups, projections * intermediate, hidden, device=dev, dtype=torch.bfloat16, generator=g)
    h = torch.randn(rows, intermediate, device=dev, dtype=torch.bfloat16, generator=g)
    w2 = torch.randn(groups, hidden, intermediate, device=dev, dtype=torch.bfloat16, generator=g)
    if dtype == "fp8":
        g1, g2 = _fp8_grouped(torch, a, w13, offs), _fp8_grouped(torch, h, w2, offs)
    else:
        w13t, w2t = w13.transpose(-2, -1), w2.transpose(-2, -1)

        def g1() -> object:
            return torch._grouped_mm(a, w13t, offs=offs)

        def g2() -> object:
            return torch._grouped_mm(h, w2t, offs=offs)

    def both() -> None:
        g1()
        g2()

    return 1e3 * median_ms(graphed(both), dev, repeats)


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (its replay), so that timing sees the GPU's time and not
    the host's launch gaps, as a serving engine's decode graph would; ``fn`` itself when the
    capture fails (an op that cannot be captured)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        return fn
    return graph.replay


def measure_sweep(s: Any, model: ModelPreset, repeats: int = 20) -> None:
    """Add ``measured_us`` to each row of sweep ``s`` (:class:`~fimoe_lab.tune.sweep.Sweep`).

    Per distinct padded rank shape, :func:`moe_gemm_us` at each token count of the
    profile, weighted like ``predicted_us`` (``sum w_T t_T / sum w_T``, the slowest rank).
    ``attrs["measured"]`` says on what and how. A shape the GEMM refuses gets None and its
    reason in ``measure_note``.
    """
    import torch

    dev = require_cuda()
    a = s.attrs
    dtype = gemm_dtype(a["format"])
    p = get_activation(model.activation).projections
    tokens, weights = a["tokens"], a["weights"]
    cache: dict[tuple[int, int], tuple[Optional[float], str]] = {}

    def profile(inter: int, hidden: int) -> tuple[Optional[float], str]:
        if (inter, hidden) not in cache:
            try:
                ts = [moe_gemm_us(model.experts, model.top_k, t, inter, hidden, p, dtype, repeats, dev) for t in tokens]
                cache[(inter, hidden)] = (sum(w * t for w, t in zip(weights, ts)) / sum(weights), "")
            except (RuntimeError, ValueError) as exc:
                cache[(inter, hidden)] = (None, str(exc).splitlines()[0])
        return cache[(inter, hidden)]

    for r in s.rows:
        got = [profile(i, r["hidden"]) for i in dict.fromkeys((r["intermediate"], r["intermediate_last"]))]
        r["measured_us"] = None if any(t is None for t, _ in got) else max(t for t, _ in got)  # type: ignore[type-var]
        r["measure_note"] = next((n for _, n in got if n), "")
    a["measured"] = (
        f"torch.{'_scaled_grouped_mm fp8 rowwise' if dtype == 'fp8' else '_grouped_mm bf16'} on "
        f"{torch.cuda.get_device_name(dev)} (torch {torch.__version__}): the two expert GEMMs, uniform routing "
        f"(a proxy of the fused MoE kernel, not FlashInfer's CUTLASS MoE)"
    )


def measure_grouped_mm(df, tokens: int = 4096, repeats: int = 20, device: Optional[str] = None):
    """bf16 :func:`moe_gemm_us` (in ms) per padded shape of DataFrame sweep ``df``, at ``tokens`` tokens.

    Adds ``gemm_ms`` and ``gemm_vs_unpadded`` (ratio to the unpadded shape).
    """
    import torch

    dev = require_cuda() if device is None else torch.device(device)
    if dev.type != "cuda":
        raise OracleError(f"not measured on this device: {dev} is not a CUDA device", fix="pass a CUDA device")
    p = get_preset(df.attrs["preset"])
    projections = get_activation(p.activation).projections
    out = df.copy()
    ms = [0.0] * len(df)
    for (inter, hidden), idx in _shapes(df).items():
        t = moe_gemm_us(p.experts, p.top_k, tokens, inter, hidden, projections, "bf16", repeats, dev) / 1e3
        for i in idx:
            ms[i] = t
    out["gemm_ms"] = ms
    base = out.loc[(out.inter_align == 1) & (out.hidden_align == 1), "gemm_ms"].iloc[0]
    out["gemm_vs_unpadded"] = out["gemm_ms"] / base
    out.attrs.update(df.attrs, gemm_device=torch.cuda.get_device_name(dev), gemm_tokens=tokens)
    return out


def measure_transform(
    df, backend: str = "trtllm", experts: Optional[int] = None, device: str = "cpu", repeats: int = 5
):
    """Our executors laying out w13 and w2 (random bytes) for each padded shape of ``df``.

    ``experts``: how many experts to lay out (default: all of the preset's; fewer keeps
    a CPU run short; the time scales with the count). The plan is
    :func:`fimoe_lab.recipes.plan_layer` of the format's layout recipe
    (``specs.FORMATS[f].plan_format``) padded to each row's alignments. Adds
    ``transform_ms`` (median, both tensors) and ``transform_note`` (why a shape has no
    plan, if so).
    """
    import torch

    from ..recipes import plan_layer

    p = get_preset(df.attrs["preset"])
    act = get_activation(p.activation)
    fmt = FORMATS[df.attrs["format"]].plan_format
    n = experts or p.experts
    dev = torch.device(device)
    unpadded = df.loc[(df.inter_align == 1) & (df.hidden_align == 1)].iloc[0]
    out = df.copy()
    ms: list[float] = [float("nan")] * len(df)
    notes = [""] * len(df)
    for (inter, hidden), idx in _shapes(df).items():
        row = df.iloc[idx[0]]
        try:  # the plan pads the checkpoint's (unpadded) sizes to this row's alignments
            plan = plan_layer(
                fmt,
                backend,
                int(unpadded.intermediate),
                int(unpadded.hidden),
                act.is_act_and_mul,
                act.gated,
                int(row.inter_align),
                int(row.hidden_align),
            )
        except FimoeError as exc:
            for i in idx:
                notes[i] = exc.message
            continue
        g = torch.Generator().manual_seed(inter + hidden)
        inputs = {
            name: torch.randint(1, 256, (n,) + m.in_shape, generator=g, dtype=torch.uint8).to(dev)
            for name, m in plan.maps().items()
            if name in ("w13", "w2")
        }
        outputs = {
            name: torch.empty((n,) + plan.maps()[name].out_shape, dtype=torch.uint8, device=dev) for name in inputs
        }

        maps = plan.maps()

        def both(inputs: dict = inputs, outputs: dict = outputs, maps: dict = maps) -> None:
            for name, x in inputs.items():
                maps[name].apply(x, out=outputs[name])

        t = median_ms(both, dev, repeats)
        for i in idx:
            ms[i] = t
    out["transform_ms"] = ms
    out["transform_note"] = notes
    out.attrs.update(df.attrs, transform_device=str(dev), transform_experts=n, transform_backend=backend)
    return out
