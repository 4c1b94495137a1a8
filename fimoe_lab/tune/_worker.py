"""Tactic-query worker: runs in its own process, one JSON request per stdin line.

Started by :class:`fimoe_lab.tune.oracle.TacticOracle`; not a public API.  FlashInfer's
runner may ``exit(1)`` (e.g. when the CUDA runtime cannot be asked for the SM
version), so it must never run inside the caller's process.

Modes (argv[1]):
  ``shim``   load the module built by ``fimoe_lab.tune.build`` (argv[2] = path of the
             .so); the parent sets LD_PRELOAD to our SM100 device shim.
  ``native`` let FlashInfer JIT-build / load the module on a real Blackwell GPU.

Requests:  {"id": n, "dtype_act": "E2m1", "dtype_weights": "E2m1",
            "fp8_quantization_type": "NoneFp8", "activation": "Swiglu",
            "weight_layout": "MajorK", "use_shuffled_weight": true,
            "use_per_token_scaling": false, "top_k": 6, "hidden": 3072,
            "intermediate": 1920, "experts": 128, "tokens": 8}
Enum *member names* come in; values are looked up in the installed
``flashinfer.tllm_enums`` here.  Answers: {"id": n, "ok": true, "configs": [[tile, cfg], ...]}
or {"id": n, "ok": false, "error": "..."}.
"""

from __future__ import annotations

import json
import sys


def _clean(e: BaseException) -> str:
    """FlashInfer's message without the C++ source location and traceback lines."""
    import re

    lines = [m for m in str(e).strip().splitlines() if m.strip() and not m.startswith("  File ")]
    msg = " ".join(lines[-3:])
    msg = re.sub(r"Error in function '[^']*' at \S+:\d+:\s*", "", msg)
    if "No kernel found" in msg:
        keep = [
            kv
            for kv in re.findall(r"(m\w+): ([^,]+)", msg)
            if kv[0]
            in (
                "mDtypeA",
                "mDtypeB",
                "mDtypeC",
                "mActType",
                "mEltwiseActType",
                "mFusedAct",
                "mUseDeepSeekFp8",
                "mUsePerTokenSfA",
                "mUsePerTokenSfB",
            )
        ]
        msg = "no kernel in this kernel set for these options (" + ", ".join(f"{k}={v}" for k, v in keep) + ")"
    return f"{type(e).__name__}: {msg[:300]}"


def _load(mode: str, so_path: str | None):
    if mode == "native":
        from flashinfer.fused_moe.core import get_trtllm_moe_sm100_module

        return get_trtllm_moe_sm100_module()
    import tvm_ffi

    return tvm_ffi.load_module(so_path)


def main() -> int:
    mode = sys.argv[1]
    so_path = sys.argv[2] if len(sys.argv) > 2 else None
    out = sys.stdout
    # Anything FlashInfer prints must not corrupt our protocol: protocol on a dup of
    # fd 1, FlashInfer's stdout sent to stderr.
    import os

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    out = proto
    if mode == "shim":
        # The built module needs no cubins at query time; a missing or mismatched
        # flashinfer-cubin package must not stop `import flashinfer`.
        sys.modules.setdefault("flashinfer_cubin", None)
    try:
        import flashinfer
        from flashinfer import tllm_enums as te

        op = _load(mode, so_path)
        fn = op.trtllm_get_valid_moe_configs
    except BaseException as e:  # report, then exit: the parent says what failed
        out.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        return 3
    try:
        from fimoe_lab.tune.build import kernel_set_id

        kset = kernel_set_id()
    except Exception:
        kset = "unknown"
    out.write(
        json.dumps({"ready": True, "flashinfer": flashinfer.__version__, "mode": mode, "kernel_set": kset}) + "\n"
    )
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        rid = req.get("id")
        try:
            args = (
                int(te.DtypeTrtllmGen[req["dtype_act"]]),
                int(te.DtypeTrtllmGen[req["dtype_weights"]]),
                int(te.Fp8QuantizationType[req["fp8_quantization_type"]]),
                int(req["top_k"]),
                int(req["hidden"]),
                int(req["intermediate"]),
                int(req["experts"]),
                int(te.ActivationType[req["activation"]]),
                bool(req["use_shuffled_weight"]),
                int(te.WeightLayout[req["weight_layout"]]),
                bool(req["use_per_token_scaling"]),
                int(req["tokens"]),
                bool(req.get("has_gemm1_lora_delta", False)),
            )
            res = fn(*args)
            configs = [[int(x) for x in pair] for pair in res]
            out.write(json.dumps({"id": rid, "ok": True, "configs": configs}) + "\n")
        except Exception as e:
            out.write(json.dumps({"id": rid, "ok": False, "error": _clean(e)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
