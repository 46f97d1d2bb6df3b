#!/usr/bin/env bash
# One-time (and idempotent) set-up: a virtual environment in .venv with distro-opt and everything
# its tests and experiments need. Re-running it is cheap: it only reinstalls when pyproject.toml changed.
#
# PyTorch: by default the CPU build (torch==2.13.0), since an unpinned torch pulls a multi-GB CUDA
# build. GPU users override it, e.g.
#   TORCH_SPEC="torch==2.13.0" TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-p2p,experiments,test}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.distro-opt-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $TORCH_SPEC $EXTRAS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
# (sed drops a harmless warning some pip mirrors print; pipefail still reports pip's own failure)
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" 2>&1 | sed '/is ignored: it is neither/d'; }
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    pip_install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
else
    pip_install "$TORCH_SPEC"
fi
pip_install -e ".[$EXTRAS]"
"$VENV/bin/python" -c "import torch, distro_opt.comm; print('distro-opt ready: torch', torch.__version__)"
echo "$want" > "$stamp"
