"""`tune` on a preset answers without torch or pandas (what makes a cold start fast), in a fresh process."""

import json
import subprocess
import sys

import pytest

PROBE = (
    "import runpy, sys; sys.argv = ['fimoe-lab'] + sys.argv[1:]\n"
    "try:\n    runpy.run_module('fimoe_lab', run_name='__main__')\n"
    "except SystemExit as e:\n    code = e.code\n"
    "print(json.dumps({'code': code, 'heavy': sorted(m for m in ('torch', 'pandas') if m in sys.modules)}), "
    "file=sys.stderr)"
)


def run_cli(*argv: str) -> tuple[str, dict]:
    r = subprocess.run(
        [sys.executable, "-c", "import json\n" + PROBE, *argv], capture_output=True, text=True, timeout=120
    )
    return r.stdout, json.loads(r.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "argv",
    [
        ("--model", "kimi-k2", "--format", "nvfp4", "--tp", "8"),
        ("--model", "gpt-oss-120b", "--format", "mxfp4", "--tp", "4", "--json"),
        ("--model", "qwen3-30b-a3b", "--format", "fp8", "--tp", "8", "--gpu", "h200"),
    ],
)
def test_tune_on_a_preset_imports_neither_torch_nor_pandas(argv):
    out, probe = run_cli("tune", *argv, "--source", "model")
    assert probe == {"code": 0, "heavy": []}
    assert "recommended" in out


def test_measure_without_a_gpu_is_one_clear_error(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: --measure would time")
    from fimoe_lab.cli import main

    argv = ["tune", "--model", "qwen3-30b-a3b", "--format", "bf16", "--tp", "8", "--gpu", "h200", "--measure"]
    assert main(argv + ["--source", "model"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("error: tune: not measured on this device: no CUDA GPU") and "(fix: " in err
