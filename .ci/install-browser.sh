#!/usr/bin/env bash
# Install what tests/test_browser.py needs: Debian's chromium (Playwright drives it through
# executable_path; its own browser download is never used) and the playwright Python package.
# Usage: .ci/install-browser.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
if ! command -v chromium >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium
fi
"$PY" -m pip install -q "playwright>=1.40"
chromium --version
