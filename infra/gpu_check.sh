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
# Then (vllm and hf) routed experts of a Mixture-of-Experts model: the `moe` preset served with
# `--routed-experts` (vllm: vLLM's model runner V2, which vLLM 0.32's CPU build cannot run:
# "Model Runner V2 requires Triton"), tests/gpu/test_routed_experts.py against it (the routing
# of prompt and tokens against a transformers forward of the same weights, a prefix-cache hit,
# a generation resumed across /update_weights keeping the old weights' routing). ROUTING_CHECK=0
# skips it.
#   BACKEND=sglang infra/gpu_check.sh  # ... against the sglang backend (SGLang's own server)
#
# Weights over NCCL (vllm; before the routing check, on the contract replica, whose vLLM runs
# on PORT+1 with `--weight-transfer-config {"backend":"nccl"}`): tests/gpu/test_weight_transfer.py
# drives vLLM's native NCCL weight-transfer engine (/init_weight_transfer_engine,
# /start_weight_update, /update_weights, /finish_weight_update) and the project's broadcast
# (`weights.mode: broadcast`, `weights.backend: nccl`) into it. These need two
# GPUs (NCCL refuses two ranks on one device: "Duplicate GPU detected"); with one the step is
# reported as skipped with that reason, not failed. TRANSFER_CHECK=0 skips it.
#
# What one GPU can check of the GPU-only paths (issue 46; steps 1c and 1d, any BACKEND, no vLLM
# needed): the sharded trainer under torchrun with one rank on NCCL for two steps
# (tests/gpu/test_sharded_nccl.py; SHARDED_CHECK=0 skips it), and the project's broadcast from
# a trainer with its weights on cuda:0 to a second process receiving into GPU memory, fp32 and
# bf16, over NCCL where a second GPU exists, else over gloo with CUDA tensors
# (tests/gpu/test_weight_transfer.py -k second_process; BROADCAST_CHECK=0 skips it).
#
# Sleep mode (vllm, step 4c; what hybrid lending needs of a vLLM engine on the trainer's GPU):
# vLLM's server alone with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1,
# tests/gpu/test_vllm_sleep.py: /sleep?level=1 frees most of its GPU memory, /wake_up gives the
# same greedy tokens, level 2 wakes by tags (weights, then kv_cache). SLEEP_CHECK=0 skips it.
#
# SGLang (BACKEND=sglang) runs in an interpreter of its own: $SGLANG_PYTHON, else $PYTHON when
# it has the sglang package, else .venv-sglang/bin/python of this checkout when that has it;
# else the check installs it (infra/sglang/install.sh, into $GPU_CHECK_DIR/venv-sglang) from
# $SGLANG_WHEELS (a folder of wheels: `pip download -d DIR sglang==0.5.23` for this machine's
# Python, on a machine with network) or from PyPI where the machine reaches it, and stops with
# the reason where neither works. The sglang adapter has never run against a real SGLang
# before this check (SGLang's server does not start on the development CPUs; README "SGLang"),
# so its first run here is its proof, or the list of what to fix.
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
#   BACKEND          vllm (default), hf or sglang
#   SGLANG_PYTHON    interpreter with SGLang (BACKEND=sglang; see above)
#   SGLANG_WHEELS    folder of wheels to install SGLang from when no interpreter has it
#   EXTRA_SGLANG_ARGS more SGLang server arguments, e.g. "--attention-backend triton"
#   PYTHON           interpreter (default python3)
#   PORT             adapter port (default 8100)
#   GPU_CHECK_DIR    work dir for models, unpacked wheels and logs (default /tmp/rollout_gpu_check);
#                    the logs are also copied to $OUT when that is set
#   EXTRA_VLLM_ARGS  more `vllm serve` arguments, e.g. "--attention-backend FLEX_ATTENTION"
#   TRAINER_CHECK    0 skips the trainer check (default 1)
#   ROUTING_CHECK    0 skips the MoE routed-experts check (default 1; vllm and hf)
#   TRANSFER_CHECK   0 skips the NCCL weight-transfer check (default 1; vllm)
#   SLEEP_CHECK      0 skips the sleep-mode check (default 1; vllm)
#   VL_CHECK         0 skips the vision-language check (default 1; vllm): the `vl` preset
#                    (tiny LLaVA) through vLLM's offline engine, tests/gpu/test_vl_vllm.py
#   BENCH_CHECK      0 skips step 1e (default 1): `rollout bench train-step --geometry
#                    qwen2-0.5b --batch rl` (the trainer's tokens/s against bare padded and
#                    packed passes, MFU; bench-train-step.json)
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
SGLANG_PY=""
TRAINER_RESULT="not run"
ROUTING_RESULT="not run"
TRANSFER_RESULT="not run"
SLEEP_RESULT="not run"
VL_RESULT="not run"
SHARDED_RESULT="not run"
BROADCAST_RESULT="not run"
BENCH_RESULT="not run"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
PY=${PYTHON:-python3}

log() { printf '[gpu_check +%3ss] %s\n' "$(($(date +%s) - START))" "$*"; }
die() { log "FAILED: $*"; RESULT="failed: $*"; exit 1; }
# save_logs FILE...: copies logs to $OUT when the device tool gave one.
save_logs() { if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then cp -f "$@" "$OUT"/ 2>/dev/null; fi; return 0; }
# verdict VAR LOG RC: VAR becomes "passed: <pytest's summary>" or "failed: ..."; a skipped test
# counts as failed, since a check that skipped proved nothing.
verdict() {
  local summary
  summary=$(grep -E '^=+ .*(passed|failed|error|skipped).* =+$' "$2" | tail -1 | tr -d '=')
  if [[ "$3" == 0 ]] && ! grep -q skipped <<<"$summary"; then
    printf -v "$1" 'passed:%s' "$summary"
  else
    printf -v "$1" 'failed: pytest exit %s,%s' "$3" "${summary:- no summary}"
  fi
}
# check VAR NAME TIMEOUT TEST [ENV=VALUE ...]: one test file under `timeout`, with those
# variables set, its output in $WORK/NAME.log (and $OUT), its verdict in VAR.
check() {
  local var=$1 name=$2 limit=$3 test=$4
  shift 4
  log "running ${PYTEST[*]} -s $test"
  # shellcheck disable=SC2086  # TEST may carry pytest options: "FILE -k EXPR"
  env "$@" timeout "$limit" "${PYTEST[@]}" -s $test 2>&1 | tee "$WORK/$name.log"
  verdict "$var" "$WORK/$name.log" "${PIPESTATUS[0]}"
  log "$name check: ${!var}"
  save_logs "$WORK/$name.log"
}
# stop_replica: SIGTERM (the replica stops its own children), SIGKILL after 45 s.
stop_replica() {
  [[ -n "$REPLICA_PID" ]] && kill -0 "$REPLICA_PID" 2>/dev/null || return 0
  log "stopping the replica (pid $REPLICA_PID); it stops its own children"
  kill -TERM "$REPLICA_PID" 2>/dev/null
  for _ in $(seq 1 45); do kill -0 "$REPLICA_PID" 2>/dev/null || return 0; sleep 1; done
  log "replica did not stop; SIGKILL"
  kill -KILL "$REPLICA_PID" 2>/dev/null
  return 0
}
# healthy URL PID: waits up to 300 s for URL/health while PID lives.
healthy() {
  "$PY" -c 'import os, sys, time, urllib.request
url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 300
while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
    try:
        urllib.request.urlopen(url + "/health", timeout=5).close()
        sys.exit(0)
    except OSError:
        time.sleep(2)
sys.exit(1)' "$1" "$2"
}
# models PRESET NAME...: checkpoints of the preset in $WORK/models, the first of seed 0, the
# next of seed 1 (the weights /update_weights loads), ...
models() {
  "$PY" - "$WORK/models" "$@" <<'EOF'
import sys
from pathlib import Path
from pipeline.harness.models.tiny import init_model
out, preset = Path(sys.argv[1]), sys.argv[2]
for seed, name in enumerate(sys.argv[3:]):
    init_model(out / name, preset=preset, seed=seed)
    print("  wrote", out / name)
EOF
}

cleanup() {
  local rc=$?
  stop_replica
  save_logs "$WORK"/replica.log "$WORK"/pytest.log "$WORK"/junit.xml "$WORK"/trainer.log
  echo
  echo "================ gpu_check summary ================"
  echo "backend:   $BACKEND"
  echo "trainer:   $TRAINER_RESULT"
  echo "sharded:   $SHARDED_RESULT"
  echo "broadcast: $BROADCAST_RESULT"
  echo "bench:     $BENCH_RESULT"
  echo "routing:   $ROUTING_RESULT"
  echo "transfer:  $TRANSFER_RESULT"
  echo "sleep:     $SLEEP_RESULT"
  echo "vl:        $VL_RESULT"
  echo "result:    $RESULT"
  echo "elapsed:   $(($(date +%s) - START)) s"
  echo "python:    $PY ($("$PY" -V 2>&1))"
  echo "vllm:      $("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null || echo 'not installed')"
  if [[ "$BACKEND" == sglang ]]; then
    echo "sglang:    $("${SGLANG_PY:-$PY}" -c 'import sglang; print(sglang.__version__)' 2>/dev/null || echo 'not installed') (${SGLANG_PY:-none})"
  fi
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
[[ "$BACKEND" =~ ^(vllm|hf|sglang)$ ]] || die "BACKEND must be vllm, hf or sglang, not $BACKEND"
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
  check TRAINER_RESULT trainer 300 tests/gpu/test_trainer_device.py
fi
# ------------------------------------------------------------------ 1c. the sharded trainer on NCCL
if [[ "${SHARDED_CHECK:-1}" != 0 ]]; then
  check SHARDED_RESULT sharded 600 tests/gpu/test_sharded_nccl.py
fi
# ------------------------------------------------------------------ 1d. broadcast to a second process
if [[ "${BROADCAST_CHECK:-1}" != 0 ]]; then
  check BROADCAST_RESULT broadcast 600 "tests/gpu/test_weight_transfer.py -k second_process"
fi
# ------------------------------------------------------------------ 1e. the trainer's pace
if [[ "${BENCH_CHECK:-1}" != 0 ]]; then
  log "rollout bench train-step --geometry qwen2-0.5b --batch rl (log: $WORK/bench-train-step.log)"
  if timeout 900 "$PY" -m pipeline.cli.main bench train-step --device cuda --geometry qwen2-0.5b \
      --batch rl --rounds 3 --json >"$WORK/bench-train-step.json" 2>"$WORK/bench-train-step.log"; then
    BENCH_RESULT="passed: $(tail -n 1 "$WORK/bench-train-step.json")"
  else
    tail -n 20 "$WORK/bench-train-step.log"
    BENCH_RESULT="failed: see the end of $WORK/bench-train-step.log above"
  fi
  log "bench: $BENCH_RESULT"
  save_logs "$WORK/bench-train-step.json" "$WORK/bench-train-step.log"
fi
if [[ "$BACKEND" == vllm ]] && ! "$PY" -c 'import vllm' >/dev/null 2>&1; then
  die "$PY lacks: vllm (it has to be in the image; see the header of $0)"
fi
has_sglang() {  # finds the package without importing it (SGLang's import takes seconds)
  [[ -x "$1" ]] && "$1" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("sglang") is None)' 2>/dev/null
}
if [[ "$BACKEND" == sglang ]]; then
  for candidate in "${SGLANG_PYTHON:-}" "$(command -v "$PY")" "$ROOT/.venv-sglang/bin/python"; do
    if [[ -n "$candidate" ]] && has_sglang "$candidate"; then SGLANG_PY=$candidate; break; fi
  done
  if [[ -z "$SGLANG_PY" ]]; then
    log "no interpreter has sglang; installing it into $WORK/venv-sglang (log: $WORK/sglang-install.log)"
    if PYTHON="$PY" PIP_DEFAULT_TIMEOUT=20 PIP_RETRIES=1 \
        timeout 1800 infra/sglang/install.sh "$WORK/venv-sglang" >"$WORK/sglang-install.log" 2>&1; then
      SGLANG_PY="$WORK/venv-sglang/bin/python"
    else
      tail -n 5 "$WORK/sglang-install.log"
      die "SGLang is not installable here (no SGLANG_PYTHON, no SGLANG_WHEELS, no PyPI); see $WORK/sglang-install.log"
    fi
  fi
  log "SGLang: $SGLANG_PY ($("$SGLANG_PY" -c 'import sglang; print(sglang.__version__)' 2>&1))"
fi

# ------------------------------------------------------------------ 2. tiny models
log "building the tiny model (seed 0) and a second checkpoint (seed 1) for update_weights"
models tiny base alt || die "model build failed"

# ------------------------------------------------------------------ 3. replica
CMD=("$PY" -m pipeline.cli.main replica serve --backend "$BACKEND" --model "$WORK/models/base"
     --port "$PORT" --host 127.0.0.1 --replica-id gpu-check --served-model-name tiny
     --max-model-len 2048)
if [[ "$BACKEND" == vllm ]]; then
  # vLLM runs in this interpreter too; each word of EXTRA_VLLM_ARGS is one `vllm serve` argument
  CMD+=(--vllm-python "$PY" --vllm-arg=--gpu-memory-utilization=0.25 --vllm-arg=--enforce-eager)
  # vLLM itself on a known port, its NCCL weight-transfer engine on (step 4b drives its routes)
  CMD+=(--internal-port "$((PORT + 1))" '--vllm-arg=--weight-transfer-config={"backend":"nccl"}')
  for arg in ${EXTRA_VLLM_ARGS:-}; do CMD+=("--vllm-arg=$arg"); done
fi
if [[ "$BACKEND" == sglang ]]; then
  # SGLang runs in its own interpreter; each word of EXTRA_SGLANG_ARGS is one server argument
  # -v: SGLang's own output goes into replica.log too (its first run here is what to read)
  CMD+=(-v --sglang-python "$SGLANG_PY" --sglang-arg=--mem-fraction-static=0.25
        --sglang-arg=--disable-cuda-graph)
  for arg in ${EXTRA_SGLANG_ARGS:-}; do CMD+=("--sglang-arg=$arg"); done
fi
log "starting: ${CMD[*]} (log: $WORK/replica.log)"
"${CMD[@]}" >"$WORK/replica.log" 2>&1 &
REPLICA_PID=$!
URL="http://127.0.0.1:$PORT"
healthy "$URL" "$REPLICA_PID" || die "replica did not become healthy within 300 s (or exited)"
log "replica healthy: $(curl -s "$URL/health" 2>/dev/null)"

# ------------------------------------------------------------------ 4. contract tests
log "running ${PYTEST[*]} tests/gpu/test_replica_contract.py"
ROLLOUT_REPLICA_URL="$URL" ROLLOUT_MODEL_PATH="$WORK/models/base" \
ROLLOUT_UPDATE_WEIGHTS_PATH="$WORK/models/alt" \
  timeout 300 "${PYTEST[@]}" --junitxml "$WORK/junit.xml" tests/gpu/test_replica_contract.py \
  2>&1 | tee "$WORK/pytest.log"
verdict RESULT "$WORK/pytest.log" "${PIPESTATUS[0]}"
log "contract tests: $RESULT"
[[ "$RESULT" == passed* ]] || exit 1

# ------------------------------------------------------------------ 4b. weights over NCCL (vllm)
if [[ "${TRANSFER_CHECK:-1}" != 0 && "$BACKEND" == vllm && "$GPUS" -lt 2 ]]; then
  TRANSFER_RESULT="skipped: $GPUS GPU; NCCL between the trainer and vLLM needs a GPU each (Duplicate GPU detected)"
  log "transfer check: $TRANSFER_RESULT"
elif [[ "${TRANSFER_CHECK:-1}" != 0 && "$BACKEND" == vllm ]]; then
  check TRANSFER_RESULT transfer 600 tests/gpu/test_weight_transfer.py \
    ROLLOUT_REPLICA_URL="$URL" ROLLOUT_VLLM_URL="http://127.0.0.1:$((PORT + 1))" \
    ROLLOUT_MODEL_PATH="$WORK/models/base" ROLLOUT_UPDATE_WEIGHTS_PATH="$WORK/models/alt"
fi

# ------------------------------------------------------------------ 4c. sleep mode (vllm)
# Hybrid lending on GPUs (README "Hybrid lending"): a vLLM engine sharing the trainer's GPU
# sleeps while the trainer steps and wakes to generate. vLLM's own server, started with
# --enable-sleep-mode and its development routes (/sleep, /wake_up, /is_sleeping), alone on
# the GPU (the contract replica is stopped first), driven by tests/gpu/test_vllm_sleep.py.
if [[ "${SLEEP_CHECK:-1}" != 0 && "$BACKEND" == vllm ]]; then
  log "stopping the contract replica; starting vLLM with --enable-sleep-mode (log: $WORK/vllm-sleep.log)"
  stop_replica
  SLEEP_PORT=$((PORT + 2))
  # shellcheck disable=SC2086
  VLLM_SERVER_DEV_MODE=1 "$PY" -m vllm.entrypoints.cli.main serve "$WORK/models/base" \
    --port "$SLEEP_PORT" --host 127.0.0.1 --enable-sleep-mode --enforce-eager \
    --gpu-memory-utilization 0.25 --max-model-len 2048 ${EXTRA_VLLM_ARGS:-} \
    >"$WORK/vllm-sleep.log" 2>&1 &
  REPLICA_PID=$!  # the EXIT trap stops it too
  if healthy "http://127.0.0.1:$SLEEP_PORT" "$REPLICA_PID"; then
    check SLEEP_RESULT sleep 300 tests/gpu/test_vllm_sleep.py \
      ROLLOUT_VLLM_SLEEP_URL="http://127.0.0.1:$SLEEP_PORT"
  else
    tail -n 20 "$WORK/vllm-sleep.log"
    SLEEP_RESULT="failed: vLLM with --enable-sleep-mode did not start (the end of $WORK/vllm-sleep.log above)"
    log "sleep check: $SLEEP_RESULT"
  fi
  stop_replica
  save_logs "$WORK"/vllm-sleep.log
fi

# ------------------------------------------------------------------ 5. MoE routed experts
if [[ "${ROUTING_CHECK:-1}" != 0 && ( "$BACKEND" == vllm || "$BACKEND" == hf ) ]]; then
  log "stopping the contract replica; building the moe preset (seeds 0 and 1)"
  stop_replica
  models moe moe-base moe-alt || die "moe model build failed"
  CMD=("$PY" -m pipeline.cli.main replica serve --backend "$BACKEND" --model "$WORK/models/moe-base"
       --port "$PORT" --host 127.0.0.1 --replica-id gpu-check-moe --max-model-len 2048)
  if [[ "$BACKEND" == vllm ]]; then
    CMD+=(--routed-experts --vllm-python "$PY" --vllm-arg=--gpu-memory-utilization=0.25
          --vllm-arg=--enforce-eager)
    for arg in ${EXTRA_VLLM_ARGS:-}; do CMD+=("--vllm-arg=$arg"); done
  fi
  log "starting: ${CMD[*]} (log: $WORK/replica-moe.log)"
  "${CMD[@]}" >"$WORK/replica-moe.log" 2>&1 &
  REPLICA_PID=$!
  if healthy "$URL" "$REPLICA_PID"; then
    check ROUTING_RESULT routing 600 tests/gpu/test_routed_experts.py \
      ROLLOUT_REPLICA_URL="$URL" ROLLOUT_MODEL_PATH="$WORK/models/moe-base" \
      ROLLOUT_UPDATE_WEIGHTS_PATH="$WORK/models/moe-alt"
  else
    tail -n 20 "$WORK/replica-moe.log"
    ROUTING_RESULT="failed: the moe replica did not start (the cause: the end of $WORK/replica-moe.log above)"
    log "routing check: $ROUTING_RESULT"
  fi
  save_logs "$WORK"/replica-moe.log
fi
# ------------------------------------------------------------------ 6. vision-language (vl)
# The `vl` preset in vLLM (issue 32) on a GPU's kernels: the CPU build serves it through the
# contract in make test-vllm (tests/vllm/test_images.py); this checks vLLM's offline engine on
# the GPU against a transformers forward (README "Images").
if [[ "${VL_CHECK:-1}" != 0 && "$BACKEND" == vllm ]]; then
  stop_replica  # the VL check runs vLLM's offline engine, which wants the GPU's memory
  check VL_RESULT vl 600 tests/gpu/test_vl_vllm.py ROLLOUT_VL_MODEL="$WORK/models/vl"
fi
if [[ "${TRAINER_CHECK:-1}" != 0 && "$TRAINER_RESULT" != passed* ]]; then
  exit 1
fi
for result in "$SHARDED_RESULT" "$BROADCAST_RESULT" "$ROUTING_RESULT" "$TRANSFER_RESULT" "$SLEEP_RESULT" "$VL_RESULT" \
    "$BENCH_RESULT"; do
  [[ "$result" != failed* ]] || exit 1
done
