"""The core imports without Jupyter, matplotlib or FlashInfer (production code imports it)."""

import subprocess
import sys


def test_core_import_pulls_in_no_lab_or_flashinfer():
    code = (
        "import sys; import fimoe_lab.layout, fimoe_lab.steps, fimoe_lab.plan, fimoe_lab.prepare, "
        "fimoe_lab.kernels, fimoe_lab.formats; "
        "bad = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'matplotlib', 'ipywidgets', 'jupyterlab', 'IPython', 'flashinfer', 'pandas'}); print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"core imported {out.stdout.strip()}"
