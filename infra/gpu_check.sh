#!/usr/bin/env bash
# GPU check: the trainer on the GPU (tests/gpu/test_trainer_device.py: a PPO step on CUDA
# against the same step on the CPU, checkpoints written from the GPU resumed on the CPU), then
# the vllm replica backend: build the tiny model, serve it through
# `rollout replica serve --backend vllm` (as `$PYTHON -m pipeline.cli.main`), run the replica
# contract tests
# (tests/gpu/test_replica_contract.py, marker `gpu`) against it, print a summary, stop
# everything. Meant for one GPU machine (e.g. an H200) with no network; takes a few minutes
# (most of it vLLM's start).
#
#   infra/gpu_check.sh                 # the vllm backend
#   BACKEND=hf infra/gpu_check.sh      # the same contract tests against the hf backend
#
# Python: $PYTHON (default python3) runs everything, with this checkout on PYTHONPATH (the
# project is not installed). Modules it lacks are taken from wheels carried in .whl/: every
# wheel there is unpacked with `pip install --no-deps --no-index --target` into the work dir,
# so carry the complete set, made on a machine with network for the GPU machine's Python, e.g.
#   pip download -d .whl --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 pydantic pydantic-core annotated-types \
#       typing-inspection orjson pybase64 pydantic-settings python-dotenv kafka-python pyyaml
# vLLM itself must match the machine's torch/CUDA; its wheels are far larger than what a
# device run can carry, so on such machines it has to be in the image already. Without it
# the script stops after the trainer check and says so.
#
# Environment (all optional):
#   BACKEND          vllm (default) or hf
#   PYTHON           interpreter (default python3)
#   PORT             adapter port (default 8100)
#   GPU_CHECK_DIR    work dir for models, unpacked wheels and logs (default /tmp/rollout_gpu_check);
#                    the logs are also copied to $OUT when that is set
#   EXTRA_VLLM_ARGS  more `vllm serve` arguments, e.g. "--attention-backend FLEX_ATTENTION"
#   TRAINER_CHECK    0 skips the trainer check (default 1)
# Exit status: 0 when the trainer check and every contract test passed.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BACKEND=${BACKEND:-vllm}
PORT=${PORT:-8100}
WORK=${GPU_CHECK_DIR:-/tmp/rollout_gpu_check}
mkdir -p "$WORK"
START=$(date +%s)
REPLICA_PID=""
RESULT="not run"
TRAINER_RESULT="not run"
PY=${PYTHON:-python3}

log() { printf '[gpu_check +%3ss] %s\n' "$(($(date +%s) - START))" "$*"; }
die() { log "FAILED: $*"; RESULT="failed: $*"; exit 1; }

cleanup() {
  local rc=$?
  if [[ -n "$REPLICA_PID" ]] && kill -0 "$REPLICA_PID" 2>/dev/null; then
    log "stopping the replica (pid $REPLICA_PID); it stops its own children"
    kill -TERM "$REPLICA_PID" 2>/dev/null
    for _ in $(seq 1 45); do kill -0 "$REPLICA_PID" 2>/dev/null || break; sleep 1; done
    if kill -0 "$REPLICA_PID" 2>/dev/null; then
      log "replica did not stop; SIGKILL"
      kill -KILL "$REPLICA_PID"
    fi
  fi
  if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
    cp -f "$WORK"/replica.log "$WORK"/pytest.log "$WORK"/junit.xml "$WORK"/trainer.log \
      "$OUT"/ 2>/dev/null
  fi
  echo
  echo "================ gpu_check summary ================"
  echo "backend:   $BACKEND"
  echo "trainer:   $TRAINER_RESULT"
  echo "result:    $RESULT"
  echo "elapsed:   $(($(date +%s) - START)) s"
  echo "python:    $PY ($("$PY" -V 2>&1))"
  echo "vllm:      $("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null || echo 'not installed')"
  echo "torch:     $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null || echo missing)"
  echo "gpu:       $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)"
  echo "logs:      $WORK/{trainer.log,replica.log,pytest.log,junit.xml}"
  if [[ "$RESULT" != passed* && -f "$WORK/replica.log" ]]; then
    echo "---- last 60 lines of replica.log ----"
    tail -n 60 "$WORK/replica.log"
  fi
  echo "==================================================="
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------ 1. GPU and Python
log "GPU: $(nvidia-smi -L 2>/dev/null | head -1 || true)"
[[ "$BACKEND" == vllm || "$BACKEND" == hf ]] || die "BACKEND must be vllm or hf, not $BACKEND"
command -v "$PY" >/dev/null || die "no interpreter $PY"
NEEDED="aiohttp pydantic pydantic_settings dotenv yaml prometheus_client orjson pybase64 numpy pytest safetensors torch transformers tokenizers jinja2 kafka"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
missing() {
  # shellcheck disable=SC2086
  "$PY" -c 'import importlib.util, sys; print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' $NEEDED
}
MISSING=$(missing)
if [[ -n "$MISSING" ]] && compgen -G ".whl/*.whl" >/dev/null; then
  log "missing: $MISSING; unpacking the wheels in .whl/ into $WORK/pydeps"
  "$PY" -m pip install -q --no-deps --no-index --target "$WORK/pydeps" --upgrade .whl/*.whl \
    >"$WORK/pip.log" 2>&1 || { tail -n 20 "$WORK/pip.log"; die "pip could not unpack .whl/ (see $WORK/pip.log)"; }
  export PYTHONPATH="$WORK/pydeps:$PYTHONPATH"
  MISSING=$(missing)
fi
[[ -z "$MISSING" ]] || die "$PY lacks: $MISSING (carry wheels in .whl/; see the header of $0)"
log "python $("$PY" -V 2>&1); all of: $NEEDED"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
PYTEST=("$PY" -m pytest -m gpu -o addopts="" --noconftest -p no:cacheprovider -v -rA)

# ------------------------------------------------------------------ 1b. the trainer on the GPU
if [[ "${TRAINER_CHECK:-1}" != 0 ]]; then
  log "running ${PYTEST[*]} tests/gpu/test_trainer_device.py"
  timeout 300 "${PYTEST[@]}" -s tests/gpu/test_trainer_device.py 2>&1 | tee "$WORK/trainer.log"
  TRAINER_RC=${PIPESTATUS[0]}
  TRAINER_SUMMARY=$(grep -E '^=+ .*(passed|failed|error|skipped).* =+$' "$WORK/trainer.log" | tail -1 | tr -d '=')
  if [[ "$TRAINER_RC" == 0 ]] && ! grep -q skipped <<<"$TRAINER_SUMMARY"; then
    TRAINER_RESULT="passed:${TRAINER_SUMMARY}"
  else
    TRAINER_RESULT="failed: pytest exit $TRAINER_RC,${TRAINER_SUMMARY:- no summary}"
  fi
  log "trainer check: $TRAINER_RESULT"
fi
if [[ "$BACKEND" == vllm ]] && ! "$PY" -c 'import vllm' >/dev/null 2>&1; then
  die "$PY lacks: vllm (it has to be in the image; see the header of $0)"
fi

# ------------------------------------------------------------------ 2. tiny models
log "building the tiny model (seed 0) and a second checkpoint (seed 1) for update_weights"
"$PY" - "$WORK/models" <<'EOF' || die "model build failed"
import sys
from pathlib import Path
from workers.llm.model_init import init_model
out = Path(sys.argv[1])
for name, seed in (("base", 0), ("alt", 1)):
    init_model(out / name, preset="tiny", seed=seed)
    print("  wrote", out / name)
EOF

# ------------------------------------------------------------------ 3. replica
CMD=("$PY" -m pipeline.cli.main replica serve --backend "$BACKEND" --model "$WORK/models/base"
     --port "$PORT" --host 127.0.0.1 --replica-id gpu-check --served-model-name tiny
     --max-model-len 2048)
if [[ "$BACKEND" == vllm ]]; then
  # vLLM runs in this interpreter too; each word of EXTRA_VLLM_ARGS is one `vllm serve` argument
  CMD+=(--vllm-python "$PY" --vllm-arg=--gpu-memory-utilization=0.25 --vllm-arg=--enforce-eager)
  for arg in ${EXTRA_VLLM_ARGS:-}; do CMD+=("--vllm-arg=$arg"); done
fi
log "starting: ${CMD[*]} (log: $WORK/replica.log)"
"${CMD[@]}" >"$WORK/replica.log" 2>&1 &
REPLICA_PID=$!
URL="http://127.0.0.1:$PORT"
"$PY" - "$URL" "$REPLICA_PID" <<'EOF' || die "replica did not become healthy within 300 s"
import json, os, sys, time, urllib.request
url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("replica process exited")
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            print("  health:", json.loads(r.read()))
            sys.exit(0)
    except OSError:
        time.sleep(2)
sys.exit(1)
EOF
log "replica healthy"

# ------------------------------------------------------------------ 4. contract tests
log "running ${PYTEST[*]} tests/gpu/test_replica_contract.py"
ROLLOUT_REPLICA_URL="$URL" ROLLOUT_MODEL_PATH="$WORK/models/base" \
ROLLOUT_UPDATE_WEIGHTS_PATH="$WORK/models/alt" \
  timeout 300 "${PYTEST[@]}" --junitxml "$WORK/junit.xml" tests/gpu/test_replica_contract.py \
  2>&1 | tee "$WORK/pytest.log"
TEST_RC=${PIPESTATUS[0]}
SUMMARY=$(grep -E '^=+ .*(passed|failed|error).* =+$' "$WORK/pytest.log" | tail -1 | tr -d '=')
if [[ "$TEST_RC" == 0 ]]; then
  RESULT="passed:${SUMMARY}"
  log "contract tests passed"
else
  RESULT="failed: pytest exit $TEST_RC,${SUMMARY:- no summary}"
  exit 1
fi
if [[ "${TRAINER_CHECK:-1}" != 0 && "$TRAINER_RESULT" != passed* ]]; then
  exit 1
fi
