"""An engine's own FlashInfer MoE preparation of a DeepSeek-V3-sized layer, without and with
``fimoe_lab.integrations.<engine>.install()``: same inputs, same run, time, memory peak, bytes compared.

Formats (E 256, H 7168, I 2048, TRT-LLM, the entry points the engine calls at load time):

- vLLM 0.34: ``fp8-block`` (DeepSeek FP8 128x128), ``fp8-tensor`` (in place) and ``mxfp8``:
  ``prepare_fp8_moe_layer_for_fi``; ``nvfp4``: ``prepare_nvfp4_moe_layer_for_fi_or_cutlass``;
  ``bf16``: ``align_moe_weights_for_fi`` + ``convert_moe_weights_to_flashinfer_trtllm_block_layout`` (in place);
  ``mxfp4-gptoss``: ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format`` (TRT-LLM MXFP4 x BF16,
  with biases; gpt-oss's format at the DeepSeek-V3 sizes).
- SGLang 0.5.23: ``fp8-tensor``: ``align_fp8_moe_weights_for_flashinfer_trtllm``; ``mxfp8``:
  ``align_mxfp8_moe_weights_for_flashinfer_trtllm``; ``nvfp4``: ``align_fp4_moe_weights_for_flashinfer_trtllm``;
  ``bf16``: ``UnquantizedFusedMoEMethod._apply_trtllm_bf16_block_layout`` on both weights (in place).
  (SGLang's DeepSeek FP8 block path is not a FlashInfer TRT-LLM preparation helper.)

Neither the engine nor FlashInfer has to be installed: ``--stage VENV`` copies the engine's
preparation files and FlashInfer's from an environment that has them into
``build/engine_src/<engine>`` (git-ignored, < 1 MB each; carry ``build/engine_src`` to the
device), with the versions read from that environment's package metadata. At run time the
engine's files load alone (``tests/engine_oracles/_isolate.py``: its other modules are stubs;
SGLang's ``copy_or_rebind_param`` is a ``setattr``) and FlashInfer's index helpers (``get_shuffle_matrix_a_row_indices``,
``_maybe_get_cached_w3_w1_permute_indices``, ``get_w2_permute_indices_with_cache``,
``get_reorder_rows_for_gated_act_gemm_row_indices``, ``reorder_rows_for_gated_act_gemm``,
``shuffle_matrix_a``, ``convert_to_block_layout``, ...) are FlashInfer's own function definitions taken from its staged
source files (decorators dropped). FlashInfer's ``block_scale_interleave`` is a JIT-built CUDA
kernel; it is served by the 128x4 swizzle written as vLLM's ``swizzle_blockscale`` reshape-permute
(torch on the same device): one or two launches per call like the kernel, so the per-expert
loop it sits in keeps its cost. ``install(force=True)``: the versions are the staged files',
printed in the table.

    python benchmarks/integration_bench.py --stage .venv-vllm --stage .venv-sglang   # here, once
    python benchmarks/integration_bench.py --engine vllm --small --device cpu         # CPU smoke run
    python benchmarks/integration_bench.py --engine sglang --device cuda --out sglang.json  # on the device

Prints a markdown table; ``--out`` writes the JSON (one record per format and side, plus the
environment). The installed side's first call builds its index maps (and compiles kernels):
it is shown on its own, and its median is over the later calls (a model's layers share one
shape, so only the first layer pays). Peak = ``max_memory_allocated`` during the call minus what was allocated before
it (CUDA only; inputs excluded).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import math
import platform
import shutil
import statistics
import sys
import time
import types
import typing
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from checkout import on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

on_path()
STAGE_ROOT = ROOT / "build" / "engine_src"

import torch  # noqa: E402

L = "vllm/model_executor/layers/"
ENGINE_FILES = {
    "vllm": [
        "vllm/utils/math_utils.py",
        L + "quantization/utils/flashinfer_utils.py",
        L + "quantization/utils/flashinfer_fp4_moe.py",
        L + "quantization/utils/nvfp4_utils.py",
        L + "quantization/utils/quant_utils.py",
        L + "fused_moe/oracle/nvfp4.py",
        L + "fused_moe/oracle/mxfp4.py",
    ],
    "sglang": [
        "sglang/srt/layers/quantization/utils.py",
        "sglang/srt/layers/moe/moe_runner/flashinfer_trtllm.py",
        "sglang/srt/layers/quantization/unquant.py",
    ],
}
FI_DEFS = {
    "flashinfer/utils.py": ["get_shuffle_matrix_a_row_indices", "get_shuffle_matrix_sf_a_row_indices"],
    "flashinfer/fused_moe/core.py": [
        "_maybe_get_cached_w3_w1_permute_indices",
        "get_w2_permute_indices_with_cache",
        "get_reorder_rows_for_gated_act_gemm_row_indices",
        "reorder_rows_for_gated_act_gemm",
        "convert_to_block_layout",
    ],
    "flashinfer/quantization/fp4_quantization.py": ["shuffle_matrix_a"],
}
FORMATS = {"vllm": "fp8-block,fp8-tensor,mxfp8,nvfp4,bf16,mxfp4-gptoss", "sglang": "fp8-tensor,mxfp8,nvfp4,bf16"}
FI_MODULES = (
    "flashinfer",
    "flashinfer.utils",
    "flashinfer.fused_moe",
    "flashinfer.fused_moe.core",
    "flashinfer.fp4_quantization",
    "flashinfer.quantization",
    "flashinfer.quantization.fp4_quantization",
)


# ----------------------------------------------------------------------------- staging
def stage(venv: Path) -> None:
    site = next((venv / "lib").glob("python3*/site-packages"))
    engine = next(e for e in ENGINE_FILES if (site / e).is_dir())
    dest = STAGE_ROOT / engine
    if dest.exists():
        shutil.rmtree(dest)
    for rel in ENGINE_FILES[engine] + list(FI_DEFS):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(site / rel, dest / rel)
    versions = {}
    for dist in (engine, "flashinfer_python"):
        info = next(site.glob(f"{dist}-*.dist-info"))
        versions[dist] = info.name[len(dist) + 1 : -len(".dist-info")]
    (dest / "versions.json").write_text(json.dumps(versions))
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(
        f"staged {len(ENGINE_FILES[engine]) + len(FI_DEFS)} files ({size / 1e3:.0f} kB) from {site} into {dest}: {versions}"
    )


def _flashinfer_defs(stage_dir: Path, ns: dict) -> None:
    """FlashInfer's own definitions of ``FI_DEFS`` (and the module-level names they use) into ``ns``."""
    for rel, names in FI_DEFS.items():
        tree = ast.parse((stage_dir / rel).read_text())
        funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        want: set[str] = set()
        todo = list(names)
        while todo:
            name = todo.pop()
            if name in funcs and name not in want:
                want.add(name)
                todo += [x.id for x in ast.walk(funcs[name]) if isinstance(x, ast.Name)]
        body: list[ast.stmt] = []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in want:
                node.decorator_list = []
                body.append(node)
            elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
                try:
                    ast.literal_eval(node.value)
                except ValueError:
                    continue
                body.append(node)
        exec(compile(ast.Module(body=body, type_ignores=[]), str(stage_dir / rel), "exec"), ns)


def _swizzle_128x4(sf: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """Stand-in for FlashInfer's CUDA ``block_scale_interleave``: pad to (128, 4), vLLM's reshape-permute, flat."""
    mats = sf if sf.ndim == 3 else sf.reshape(1, *sf.shape[-2:])
    e, rows, cols = mats.shape
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = torch.zeros((e, pr, pc), dtype=mats.dtype, device=mats.device)
    padded[:, :rows, :cols] = mats
    return padded.reshape(e, pr // 128, 4, 32, pc // 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(-1)


def load_engine(engine: str) -> dict:
    """The engine's staged preparation modules, with FlashInfer's staged helpers registered as ``flashinfer``."""
    stage_dir = STAGE_ROOT / engine
    if not (stage_dir / "versions.json").exists():
        raise SystemExit(
            f"nothing staged in {stage_dir}: run with --stage VENV first (a venv with {engine} and flashinfer)"
        )
    ns: dict = {
        "torch": torch,
        "math": math,
        **{n: getattr(typing, n) for n in ("Union", "Optional", "Tuple", "List", "Dict", "Any")},
    }
    _flashinfer_defs(stage_dir, ns)
    ns["block_scale_interleave"] = ns["nvfp4_block_scale_interleave"] = _swizzle_128x4
    for name in FI_MODULES:
        module = types.ModuleType(name)
        module.__dict__.update({k: v for k, v in ns.items() if not k.startswith("__")})
        module.__path__ = []  # type: ignore[attr-defined]
        sys.modules[name] = module
    sys.path.insert(0, str(stage_dir))
    sys.path.insert(0, str(ROOT / "tests" / "engine_oracles"))
    from _isolate import isolate

    isolate(engine, [p[:-3].replace("/", ".") for p in ENGINE_FILES[engine]])
    mods = {p.rsplit("/", 1)[1][:-3]: importlib.import_module(p[:-3].replace("/", ".")) for p in ENGINE_FILES[engine]}
    if engine == "sglang":
        mods["flashinfer_trtllm"].copy_or_rebind_param = lambda layer, name, t: setattr(layer, name, t)
    mods["versions"] = json.loads((stage_dir / "versions.json").read_text())
    return mods


# ----------------------------------------------------------------------------- the layer
def make_inputs(fmt: str, e: int, h: int, i: int, dev: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        raw = torch.randint(1, 255, shape, dtype=torch.uint8, device=dev, generator=g)
        return raw.view(dtype)

    if fmt in ("fp8-block", "fp8-tensor", "mxfp8"):
        t = {"w13": rnd((e, 2 * i, h), torch.float8_e4m3fn), "w2": rnd((e, h, i), torch.float8_e4m3fn)}
        if fmt == "fp8-block":
            t["s13"] = torch.rand((e, 2 * i // 128, h // 128), device=dev, generator=g)
            t["s2"] = torch.rand((e, h // 128, i // 128), device=dev, generator=g)
        elif fmt == "mxfp8":
            t["s13"], t["s2"] = rnd((e, 2 * i, h // 32), torch.uint8), rnd((e, h, i // 32), torch.uint8)
        else:
            t["s13"], t["s2"] = torch.rand(e, device=dev, generator=g), torch.rand(e, device=dev, generator=g)
        return t
    if fmt == "mxfp4-gptoss":
        return {
            "w13": rnd((e, 2 * i, h // 2), torch.uint8),
            "s13": rnd((e, 2 * i, h // 32), torch.uint8),
            "w2": rnd((e, h, i // 2), torch.uint8),
            "s2": rnd((e, h, i // 32), torch.uint8),
            "b13": torch.randn((e, 2 * i), dtype=torch.bfloat16, device=dev, generator=g),
            "b2": torch.randn((e, h), dtype=torch.bfloat16, device=dev, generator=g),
        }
    if fmt == "nvfp4":
        return {
            "w13": rnd((e, 2 * i, h // 2), torch.uint8),
            "s13": rnd((e, 2 * i, h // 16), torch.float8_e4m3fn),
            "w2": rnd((e, h, i // 2), torch.uint8),
            "s2": rnd((e, h, i // 16), torch.float8_e4m3fn),
        }
    g16 = torch.randn((e, 2 * i, h), dtype=torch.bfloat16, device=dev, generator=g)
    return {"w13": g16, "w2": torch.randn((e, h, i), dtype=torch.bfloat16, device=dev, generator=g)}


def prepare(engine: str, fmt: str, mods: dict, t: dict[str, torch.Tensor], h: int, i: int) -> list[torch.Tensor]:
    """The engine's entry point for ``fmt`` (module lookups at call time: the installed state counts)."""
    e = t["w13"].shape[0]
    ones = torch.ones(e, device=t["w13"].device)
    if engine == "sglang":
        return prepare_sglang(fmt, mods, t, ones)
    fu, fp4 = mods["flashinfer_utils"], mods["flashinfer_fp4_moe"]
    block = {"fp8-block": [128, 128], "mxfp8": [1, 32]}.get(fmt)
    config = SimpleNamespace(
        is_act_and_mul=True,
        intermediate_size_per_partition=i,
        hidden_dim=h,
        hidden_dim_unpadded=None,
        moe_parallel_config=SimpleNamespace(enable_eplb=False),
    )
    layer = SimpleNamespace(moe_config=config, activation=SimpleNamespace(is_gated=True), weight_block_size=block)
    if fmt in ("fp8-block", "fp8-tensor", "mxfp8"):
        return list(
            fu.prepare_fp8_moe_layer_for_fi(layer, t["w13"], t["w2"], t["s13"], ones, t["s2"], ones, is_trtllm=True)
        )
    if fmt == "mxfp4-gptoss":
        mx = mods["mxfp4"]
        return list(
            mx.convert_gpt_oss_weight_to_mxfp4_moe_kernel_format(
                mx.Mxfp4MoeBackend.FLASHINFER_TRTLLM_MXFP4_BF16,
                layer,
                t["w13"],
                t["w2"],
                t["s13"],
                t["s2"],
                t["b13"],
                t["b2"],
                _cache_permute_indices={},
            )
        )
    if fmt == "nvfp4":
        r = fp4.prepare_nvfp4_moe_layer_for_fi_or_cutlass(
            backend=mods["nvfp4"].NvFp4MoeBackend.FLASHINFER_TRTLLM,
            layer=layer,
            w13=t["w13"],
            w13_scale=t["s13"],
            w13_scale_2=ones,
            a13_scale=ones,
            w2=t["w2"],
            w2_scale=t["s2"],
            w2_scale_2=ones,
            a2_scale=ones,
            is_act_and_mul=True,
            trtllm_hidden_alignment=fu.trtllm_nvfp4_hidden_alignment(False, True),
        )
        return [r[0], r[1], r[4], r[5]]
    w13, w2, _ = fu.align_moe_weights_for_fi(t["w13"], t["w2"], True, min_alignment=128)
    return list(fu.convert_moe_weights_to_flashinfer_trtllm_block_layout({}, w13, w2, True))


def prepare_sglang(fmt: str, mods: dict, t: dict[str, torch.Tensor], ones: torch.Tensor) -> list[torch.Tensor]:
    ft, uq = mods["flashinfer_trtllm"], mods["unquant"]
    cfg = SimpleNamespace(is_gated=True, activation="silu")
    if fmt == "fp8-tensor":
        layer = SimpleNamespace(
            w13_weight=t["w13"],
            w2_weight=t["w2"],
            moe_runner_config=cfg,
            w13_input_scale=ones[0],
            w2_input_scale=ones[0],
            w13_weight_scale=t["s13"],
            w2_weight_scale=t["s2"],
        )
        ft.align_fp8_moe_weights_for_flashinfer_trtllm(layer)
        return [layer.w13_weight, layer.w2_weight, layer.output1_scales_scalar, layer.output2_scales_scalar]
    if fmt == "mxfp8":
        layer = SimpleNamespace(
            w13_weight=t["w13"],
            w2_weight=t["w2"],
            w13_weight_scale_inv=t["s13"],
            w2_weight_scale_inv=t["s2"],
            moe_runner_config=cfg,
        )
        ft.align_mxfp8_moe_weights_for_flashinfer_trtllm(layer)
        return [layer.w13_weight, layer.w2_weight, layer.w13_weight_scale_inv, layer.w2_weight_scale_inv]
    if fmt == "nvfp4":
        layer = SimpleNamespace(
            w13_weight=t["w13"],
            w2_weight=t["w2"],
            w13_weight_scale=t["s13"],
            w2_weight_scale=t["s2"],
            w2_input_scale_quant=ones,
            g1_alphas=ones,
            moe_runner_config=cfg,
        )
        ft.align_fp4_moe_weights_for_flashinfer_trtllm(
            layer, hidden_alignment=ft.trtllm_nvfp4_hidden_alignment(False, True)
        )
        return [layer.w13_weight, layer.w13_weight_scale, layer.w2_weight, layer.w2_weight_scale]
    method = SimpleNamespace(_cache_permute_indices={})
    method._trtllm_bf16_row_permutation = types.MethodType(
        uq.UnquantizedFusedMoEMethod._trtllm_bf16_row_permutation, method
    )
    layer = SimpleNamespace(num_local_experts=t["w13"].shape[0], moe_runner_config=cfg)
    params = [torch.nn.Parameter(t[k], requires_grad=False) for k in ("w13", "w2")]
    for name, param in zip(("w13_weight", "w2_weight"), params):
        uq.UnquantizedFusedMoEMethod._apply_trtllm_bf16_block_layout(method, layer, param, name)
    return [p.data for p in params]


def measure(
    engine: str, fmt: str, mods: dict, master: dict[str, torch.Tensor], h: int, i: int, dev: torch.device
) -> tuple[float, int, list[torch.Tensor]]:
    t = {k: v.clone() for k, v in master.items()}  # in-place paths consume their inputs
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    start = time.perf_counter()
    out = prepare(engine, fmt, mods, t, h, i)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else 0
    return seconds, peak, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--stage",
        type=Path,
        metavar="VENV",
        action="append",
        help="copy an engine's and FlashInfer's files from VENV, then exit (repeatable)",
    )
    ap.add_argument("--engine", choices=sorted(ENGINE_FILES), default="vllm")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="E 4, H 512, I 256 (a smoke run)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per side, alternating (median reported)")
    ap.add_argument("--formats", help="comma-separated (default: every format of the engine)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.stage:
        for venv in args.stage:
            stage(venv)
        return
    mods = load_engine(args.engine)
    from fimoe_lab.integrations import FALLBACKS

    integration = importlib.import_module(f"fimoe_lab.integrations.{args.engine}")

    dev = torch.device(args.device)
    e, h, i = (4, 512, 256) if args.small else (256, 7168, 2048)
    records = []
    for fmt in (args.formats or FORMATS[args.engine]).split(","):
        master = make_inputs(fmt, e, h, i, dev)
        sides: dict[str, list[tuple[float, int]]] = {"engine": [], "installed": []}
        outs: dict[str, list[torch.Tensor]] = {}
        for _ in range(args.repeats):
            for side in ("engine", "installed"):
                if side == "installed":
                    integration.install(force=True)
                try:
                    s, peak, out = measure(args.engine, fmt, mods, master, h, i, dev)
                finally:
                    integration.uninstall()
                sides[side].append((s, peak))
                outs[side] = [o.contiguous().view(torch.uint8).reshape(-1) for o in out]
                del out
        same = all(torch.equal(a, b) for a, b in zip(outs["engine"], outs["installed"]))
        del outs, master
        for side, runs in sides.items():
            records.append(
                {
                    "format": fmt,
                    "side": side,
                    "experts": e,
                    "hidden": h,
                    "intermediate": i,
                    "seconds": [r[0] for r in runs],
                    "first_s": runs[0][0],
                    "median_s": statistics.median(
                        r[0] for r in (runs[1:] if side == "installed" and len(runs) > 1 else runs)
                    ),
                    "peak_extra_bytes": max(r[1] for r in runs),
                    "same_bytes": same,
                }
            )
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    env = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "engine": args.engine,
        "staged": mods["versions"],
        "fallbacks": dict(FALLBACKS),
        "repeats": args.repeats,
    }
    print(table(records, env))
    if args.out:
        args.out.write_text(json.dumps({"env": env, "records": records}, indent=1))


def table(records: list[dict], env: dict) -> str:
    name = {"vllm": "vLLM", "sglang": "SGLang"}[env["engine"]]
    lines = [
        f"{name} {env['staged'][env['engine']]} preparation (FlashInfer {env['staged']['flashinfer_python']} helpers), "
        f"{env['device']}, torch {env['torch']}; median of {env['repeats']}, alternating; fallbacks {env['fallbacks'] or 'none'}",
        "",
        f"| format | E x H x I | {name} s | installed s | speed-up | installed first call s | {name} peak GB | installed peak GB | same bytes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["format"], r["side"]): r for r in records}
    for fmt in dict.fromkeys(r["format"] for r in records):
        a, b = by[(fmt, "engine")], by[(fmt, "installed")]
        lines.append(
            f"| {fmt} | {a['experts']} x {a['hidden']} x {a['intermediate']} | {a['median_s']:.3f} | {b['median_s']:.3f} | "
            f"{a['median_s'] / b['median_s']:.1f}x | {b['first_s']:.3f} | {a['peak_extra_bytes'] / 1e9:.2f} | {b['peak_extra_bytes'] / 1e9:.2f} | "
            f"{'yes' if a['same_bytes'] else 'NO'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
