"""Dump the executable form of the DeepSeek-V3 FP8-block layer's maps, for comparing two trees.

    python benchmarks/compare_compiled.py OLD_TREE old.npz    # e.g. a `git archive 53eb766` copy
    python benchmarks/compare_compiled.py . new.npz
    python benchmarks/compare_compiled.py --diff old.npz new.npz

Works with the 0.1.0 tree (``kernels.compiled.exec_form``) and 0.2.0 (``IndexMap.compiled()``).
"""

import json
import sys


def dump(tree: str, path: str) -> None:
    sys.path.insert(0, tree)
    import numpy as np
    import torch

    from fimoe_lab.prepare import MoELayerSpec, plan_fp8_moe_layer

    inter, hidden = 2048, 7168
    spec = MoELayerSpec(inter, hidden, True, True, [128, 128])
    meta = dict(device="meta")
    w13 = torch.empty(1, 2 * inter, hidden, dtype=torch.float8_e4m3fn, **meta)
    w2 = torch.empty(1, hidden, inter, dtype=torch.float8_e4m3fn, **meta)
    s13 = torch.empty(1, 2 * inter // 128, hidden // 128, **meta)
    s2 = torch.empty(1, hidden // 128, inter // 128, **meta)
    out = {}
    for name, m in plan_fp8_moe_layer(spec, w13, w2, s13, s2, True).maps().items():
        if hasattr(m, "compiled"):
            em = m.compiled()
        else:
            from fimoe_lab.kernels.compiled import exec_form

            em = exec_form(m)
        facts = dict(
            cell=em.cell_bytes,
            word=em.word,
            n_in=em.n_in,
            n_out=em.n_out,
            fills=list(em.fills),
            swizzle=em.swizzle is not None,
            padrows=em.padrows is not None,
        )
        out[f"{name}.src"] = em.src
        out[f"{name}.facts"] = np.frombuffer(json.dumps(facts).encode(), dtype=np.uint8)
    np.savez(path, **out)


def diff(a_path: str, b_path: str) -> int:
    import numpy as np

    a, b = np.load(a_path, allow_pickle=False), np.load(b_path, allow_pickle=False)
    bad = 0
    for key in sorted(a.files):
        same = key in b.files and np.array_equal(a[key], b[key])
        print(f"{key}: {'identical' if same else 'DIFFERENT'}")
        bad += not same
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "--diff":
        sys.exit(diff(sys.argv[2], sys.argv[3]))
    dump(sys.argv[1], sys.argv[2])
