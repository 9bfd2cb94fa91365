#!/usr/bin/env bash
# Build the SGLang environment (`make sglang`): a virtual environment of its own, because SGLang
# pins torch, transformers and its CUDA kernel packages to versions the project's .venv does
# not use.
#
#   infra/sglang/install.sh [VENV]       # default VENV: .venv-sglang in the repository root
#
# Steps:
#   1. a venv from $PYTHON (default python3; sglang 0.5.23 needs CPython >= 3.11);
#   2. sglang==$SGLANG_VERSION with its own pinned dependencies (torch 2.14.1, sglang-kernel
#      0.4.10, flashinfer, ...: about 11 GB, 10 minutes here with pip), installed by uv
#      (infra/uv-install.sh: linked from uv's cache on a rebuild), from PyPI, or with
#      SGLANG_WHEELS=DIR only from the wheels in DIR (`pip download -d DIR sglang==VERSION
#      uv==UV_VERSION` on a machine with network, for a GPU machine without: uv comes from DIR
#      too);
#   3. a check that `sglang` imports and reports that version.
# What it gives is PyPI's build: CUDA kernels only. It installs on a CPU-only machine but its
# server does not start there (README "SGLang" has the exact failures): SGLang's CPU engine
# needs sgl-kernel's CPU build, which PyPI does not carry (it is built from SGLang's git
# sources, sgl-kernel/pyproject_cpu.toml, or comes in the lmsysorg/sglang:*-xeon images).
# A stamp named after the hash of this script, infra/venv.sh and infra/uv-install.sh makes a
# rerun a no-op; a change rebuilds it (infra/venv.sh: the stamped venv, as for vLLM).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${1:-"$ROOT/.venv-sglang"}
PYTHON=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
# shellcheck source=infra/venv.sh
source "$ROOT/infra/venv.sh"
venv_begin sglang "$VENV" "sglang $SGLANG_VERSION" \
  "$ROOT/infra/sglang/install.sh" "$ROOT/infra/venv.sh" "$ROOT/infra/uv-install.sh"
if [[ -n "${SGLANG_WHEELS:-}" ]]; then
  # uv's own wheel from DIR as well: the venv's pip reads these variables.
  PIP_NO_INDEX=1 PIP_FIND_LINKS="$SGLANG_WHEELS" \
    "${INSTALL[@]}" -q --no-index --find-links "$SGLANG_WHEELS" "sglang==$SGLANG_VERSION"
else
  "${INSTALL[@]}" -q "sglang==$SGLANG_VERSION"
fi
"$VENV/bin/python" -c "
import sglang
assert sglang.__version__ == '$SGLANG_VERSION', sglang.__version__
print('sglang env: sglang', sglang.__version__, 'from', sglang.__file__)
"
venv_done
