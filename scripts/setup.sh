#!/usr/bin/env bash
# One-time (and idempotent) set-up: a virtual environment in .venv with distro-opt and everything
# its tests and experiments need. Re-running it is cheap: it only reinstalls when pyproject.toml changed.
#
# PyTorch: torch==2.13.0 pinned, since an unpinned torch pulls a multi-GB CUDA build. Which build the pin
# gives depends on pip's configuration: this project's machines serve the CPU build from local disk,
# while PyPI's Linux x86_64 wheel is the CUDA one. Choose a build with its index, e.g.
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh     (CPU)
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh   (CUDA 12.8)
# A re-run with another index replaces the installed build (pip would take 2.13.0+cpu for ==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-p2p,experiments,hf,test}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.distro-opt-setup"
# (setup.py and distro_opt/csrc: the native DCT kernel, compiled by the editable install below)
sources="$(cat pyproject.toml setup.py scripts/setup.sh distro_opt/csrc/* | sha256sum | cut -d' ' -f1)"
want="$sources $TORCH_SPEC $EXTRAS ${TORCH_INDEX_URL:-}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
# (sed drops a harmless warning some pip mirrors print; pipefail still reports pip's own failure)
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" 2>&1 | sed '/is ignored: it is neither/d'; }
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    # the build an index serves (+cpu, +cu128) is a local version that ==2.13.0 does not tell apart
    current=$("$VENV/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null || true)
    suffix=${TORCH_INDEX_URL%/}; suffix=${suffix##*/}
    if [ -n "$current" ] && [ "${current#*+}" != "$suffix" ]; then
        pip_install --force-reinstall "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
    else
        pip_install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
    fi
else
    pip_install "$TORCH_SPEC"
fi
pip_install -e ".[$EXTRAS]"
"$VENV/bin/python" -c "import torch, distro_opt.comm, distro_opt.native as n
print('distro-opt ready: torch', torch.__version__, '| native DCT kernel:', n.status())"
echo "$want" > "$stamp"
