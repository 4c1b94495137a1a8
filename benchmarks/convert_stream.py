"""Streaming convert and restore at real size: throughput against `cp`, peak memory against one layer.

    PYTHONPATH=. python benchmarks/convert_stream.py [--dir DIR] [--layers 4] [--experts 16]
        [--backend trtllm] [--device cpu[,cuda]] [--lanes 1,2] [--shard-size BYTES] [--json OUT.json] [--keep]

Generates a checkpoint with DeepSeek-V3 dimensions (FP8 block-128, hidden 7168, MoE intermediate
2048; ``--experts`` routed experts per layer, ``--layers`` MoE layers, one source shard per
layer; the defaults give 4 x 0.70 GB = 2.8 GB), then, each in a child process of its own:

- ``cp``: ``cp --reflink=never`` of the source shards, then ``sync`` of the copies (convert and
  restore fsync what they write, so the copy is fsynced too), and ``cp`` alone;
- ``convert``: ``convert_checkpoint`` into a sharded directory (after the device's start and the
  kernels' load, timed apart as ``startup_s``), once per ``--device`` (a comma
  list: ``cpu,cuda`` converts on both, and the two outputs must be byte-identical); with
  ``--lanes 1,2``, once per number of writer threads (``FIMOE_WRITE_LANES``) too, outputs
  again byte-identical;
- ``restore``: ``restore_checkpoint`` of the last one;

then checks that the restored expert tensors equal the source's byte for byte. Each convert and the
restore is also paired with a ``cp`` + ``sync`` of its own input timed right before it (``cp_pair_s``,
``of_cp_pair``): on a disk whose speed drifts between runs that pair is the fair comparison. Every run reads
a source the page cache has just seen (generated or copied), so the figures compare the tools,
not a cold disk. Peak memory: ``VmHWM`` of the child, and the peak of ``RssAnon`` (anonymous
memory: what the process allocated, without the memory-mapped input pages the kernel can drop)
sampled every 2 ms, both also above the child's baseline after imports. Prints a table and
the JSON (also to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from checkout import child_env, on_path  # noqa: E402  (PYTHONPATH=TREE measures TREE)

HIDDEN, INTERMEDIATE, BLOCK = 7168, 2048, 128
"""DeepSeek-V3's hidden size, MoE intermediate size and FP8 scale block."""


def _status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


class AnonPeak:
    """The peak of ``RssAnon`` (``/proc/self/status``), sampled every 2 ms on a thread."""

    def __init__(self) -> None:
        self.peak, self._stop = _status("RssAnon"), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _status("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status("RssAnon"))


# ============================================================================ the source checkpoint
def generate(out: Path, layers: int, experts: int) -> int:
    """Write the checkpoint (config.json, one shard per layer, index); returns one layer's expert bytes."""
    import torch
    from safetensors.torch import save_file

    from fimoe_lab.checkpoints import MoELayer, open_checkpoint, sample_path

    with open_checkpoint(sample_path("deepseek-v3-fp8")) as sample:  # the DeepSeek-V3 convention and config keys
        conv, config = sample.convention, dict(sample.config)
    config.update(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        n_routed_experts=experts,
        num_hidden_layers=layers,
        first_k_dense_replace=0,
    )
    out.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    weight_map, total, layer_bytes = {}, 0, 0
    sb_i, sb_h = INTERMEDIATE // BLOCK, HIDDEN // BLOCK
    for layer in range(layers):
        # random bytes with the NaN codes (0x7f, 0xff) cleared: only bytes move, so any values do
        w13 = (torch.randint(0, 256, (experts, 2 * INTERMEDIATE, HIDDEN), dtype=torch.uint8, generator=g) & 0x7E).view(
            torch.float8_e4m3fn
        )
        w2 = (torch.randint(0, 256, (experts, HIDDEN, INTERMEDIATE), dtype=torch.uint8, generator=g) & 0x7E).view(
            torch.float8_e4m3fn
        )
        s13 = torch.rand(experts, 2 * sb_i, sb_h, generator=g) + 0.5
        s2 = torch.rand(experts, sb_h, sb_i, generator=g) + 0.5
        moe = MoELayer("fp8-block", w13, w2, s13, s2, INTERMEDIATE, HIDDEN)
        tensors = conv.to_tensors("model.layers.", layer, moe)
        name = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        total, layer_bytes = total + size, size
        del w13, w2, tensors, moe
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return layer_bytes


# ============================================================================ the child processes
def child(args: argparse.Namespace) -> None:
    """One measured run: prints ``{"seconds", "startup_s", "vm_hwm", "anon_peak", "anon_base"}`` as JSON.

    A convert first starts its device and loads the kernels it will run (``fimoe_lab.warmup``, as a
    long run pays once): ``startup_s``; ``seconds`` is the convert itself."""
    from fimoe_lab.checkpoints import convert_checkpoint, restore_checkpoint

    startup = time.perf_counter()
    if args.child == "convert":  # the device's start and the kernels' load, once per process: timed apart
        from fimoe_lab.warmup import warmup

        warmup(
            formats=["fp8-block"],
            backends=[args.backend],
            devices=[args.device],
            hidden=HIDDEN,
            intermediate=INTERMEDIATE,
            experts=1,
        )
    startup = time.perf_counter() - startup
    base = _status("RssAnon")
    peak = AnonPeak()
    start = time.perf_counter()
    if args.child == "convert":
        convert_checkpoint(
            args.src, args.dst, args.backend, shard_size=args.shard_size, device=args.device, single_file=False
        )
    else:
        restore_checkpoint(args.src, args.dst, shard_size=args.shard_size)
    seconds = time.perf_counter() - start
    anon = peak.stop()
    out = {"seconds": seconds, "startup_s": startup, "vm_hwm": _status("VmHWM"), "anon_peak": anon, "anon_base": base}
    print(json.dumps(out))


def run_child(kind: str, src: Path, dst: Path, a: argparse.Namespace, device: str, lanes: str = "") -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--src", str(src), "--dst", str(dst)]
    cmd += ["--backend", a.backend, "--device", device, "--shard-size", str(a.shard_size)]
    env = child_env()
    if lanes:
        env["FIMOE_WRITE_LANES"] = lanes
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed_cp(src: Path, dst: Path, fsync: bool) -> float:
    dst.mkdir()
    files = sorted(src.glob("*.safetensors"))
    start = time.perf_counter()
    subprocess.run(["cp", "--reflink=never", *map(str, files), str(dst)], check=True)
    if fsync:
        subprocess.run(["sync", *(str(dst / f.name) for f in files)], check=True)
    return time.perf_counter() - start


def paired_cp(src: Path, work: Path) -> float:
    """``cp`` + ``sync`` of ``src``'s shards timed right before a run (then deleted): the disk's figure under the
    same conditions as that run. Where a disk's speed drifts (a VM's write bursts, writeback of the previous
    run), the pair is the fair comparison; ``cp_s`` (measured once, first) is not."""
    dst = work / "cp-pair"
    seconds = timed_cp(src, dst, fsync=True)
    shutil.rmtree(dst)
    return seconds


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    if names != sorted(p.name for p in b.iterdir()):
        return False
    return all(subprocess.run(["cmp", "-s", str(a / n), str(b / n)]).returncode == 0 for n in names)


def same_experts(src: Path, restored: Path) -> bool:
    """Whether restore wrote every source tensor, each equal to the source's of the same name, byte for byte."""
    import torch
    from safetensors import safe_open

    def tensors(d: Path) -> dict[str, Path]:
        return {n: d / f for n, f in json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].items()}

    want, got = tensors(src), tensors(restored)
    if sorted(want) != sorted(got):
        return False
    for n in want:
        with safe_open(str(want[n]), "pt") as a, safe_open(str(got[n]), "pt") as b:
            x, y = a.get_tensor(n), b.get_tensor(n)
        if x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            return False
    return True


# ============================================================================ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="working directory on the disk to measure (default: a temporary one)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--backend", default="trtllm")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lanes", default="", help="writer threads to compare, e.g. 1,2 (default: the library's choice)")
    ap.add_argument("--repeat", type=int, default=1, help="convert runs per device and lane count (alternated)")
    ap.add_argument("--shard-size", type=int, default=5 * 10**9)
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--child", choices=("convert", "restore"), help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return 0
    on_path()
    work = Path(tempfile.mkdtemp(prefix="convert-stream-", dir=a.dir))
    try:
        src = work / "src"
        t = time.perf_counter()
        layer_bytes = generate(src, a.layers, a.experts)
        gen_s = time.perf_counter() - t
        total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        results = {
            "checkpoint": {
                "layers": a.layers,
                "experts": a.experts,
                "hidden": HIDDEN,
                "moe_intermediate": INTERMEDIATE,
                "format": "fp8-block",
                "bytes": total,
                "layer_bytes": layer_bytes,
                "generate_s": gen_s,
            },
            "backend": a.backend,
            "cpus": os.cpu_count(),
        }
        cp_sync = timed_cp(src, work / "cp-sync", fsync=True)
        cp_only = timed_cp(src, work / "cp", fsync=False)
        shutil.rmtree(work / "cp")
        shutil.rmtree(work / "cp-sync")
        runs = [(d, n) for d in a.device.split(",") for n in (a.lanes.split(",") if a.lanes else [""])]
        converts, outs = {}, []
        for i in range(a.repeat):
            for dev, n in runs:
                key = dev + (f" lanes={n}" if n else "") + (f" #{i + 1}" if a.repeat > 1 else "")
                outs.append(work / f"kernel-{dev}-{n or 'default'}-{i}")
                paired = paired_cp(src, work)
                converts[key] = run_child("convert", src, outs[-1], a, dev, n)
                converts[key]["cp_pair_s"] = paired
                if len(outs) > 1:  # compare, then keep one output at a time on the disk
                    same = _same_files(outs[-2], outs[-1])
                    results["kernel_outputs_identical"] = results.get("kernel_outputs_identical", True) and same
                    shutil.rmtree(outs[-2])
        last = outs[-1]
        paired = paired_cp(last, work)
        rest = run_child("restore", last, work / "restored", a, "cpu")
        rest["cp_pair_s"] = paired
        same_kernels = results.get("kernel_outputs_identical", True)
        ok = same_experts(src, work / "restored") and same_kernels
        results.update(
            cp_s=cp_sync,
            cp_nosync_s=cp_only,
            convert=converts,
            restore=rest,
            kernel_outputs_identical=same_kernels,
            restored_byte_exact=ok,
        )
        for r in (*converts.values(), rest):
            r["gb_per_s"] = total / r["seconds"] / 1e9
            r["of_cp"] = cp_sync / r["seconds"]
            r["of_cp_with_startup"] = cp_sync / (r["seconds"] + r["startup_s"])
            r["of_cp_pair"] = r["cp_pair_s"] / r["seconds"]
            r["of_plain_cp"] = cp_only / r["seconds"]
            r["anon_over_layer"] = (r["anon_peak"] - r["anon_base"]) / layer_bytes
            r["hwm_over_layer"] = r["vm_hwm"] / layer_bytes
        print(table(results))
        print(json.dumps(results, indent=2))
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=2) + "\n")
        return 0 if ok else 1
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def table(r: dict) -> str:
    c = r["checkpoint"]
    gb, layer = c["bytes"] / 1e9, c["layer_bytes"] / 1e9
    lines = [
        f"checkpoint: {c['layers']} layers x {c['experts']} experts, hidden {c['hidden']}, MoE intermediate "
        f"{c['moe_intermediate']}, FP8 block: {gb:.2f} GB ({layer:.2f} GB per layer); {r['backend']}, "
        f"{r['cpus']} CPUs",
        f"{'step':<14} {'s':>7} {'GB/s':>6} {'x cp':>6} {'anon peak-base GB':>18} {'/layer':>7} {'VmHWM GB':>9} "
        f"{'start s':>8} {'paired cp s':>12} {'x paired':>9} {'x plain cp':>11}",
        f"{'cp+sync':<14} {r['cp_s']:>7.2f} {gb / r['cp_s']:>6.2f} {1:>6.2f}",
        f"{'cp':<14} {r['cp_nosync_s']:>7.2f} {gb / r['cp_nosync_s']:>6.2f} {r['cp_s'] / r['cp_nosync_s']:>6.2f}",
    ]
    steps = [(f"convert {d}", x) for d, x in r["convert"].items()] + [("restore", r["restore"])]
    for step, x in steps:
        lines.append(
            f"{step:<14} {x['seconds']:>7.2f} {x['gb_per_s']:>6.2f} {x['of_cp']:>6.2f} "
            f"{(x['anon_peak'] - x['anon_base']) / 1e9:>18.2f} {x['anon_over_layer']:>7.2f} {x['vm_hwm'] / 1e9:>9.2f} "
            f"{x['startup_s']:>8.2f} {x['cp_pair_s']:>12.2f} {x['of_cp_pair']:>9.2f} {x['of_plain_cp']:>11.2f}"
        )
    if len(r["convert"]) > 1:
        lines.append(f"kernel outputs of {', '.join(r['convert'])} byte-identical: {r['kernel_outputs_identical']}")
    lines.append(f"restored expert tensors byte-identical to the source: {r['restored_byte_exact']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
