#!/usr/bin/env bash
# The stamped virtual environment that infra/vllm/install.sh and infra/sglang/install.sh build:
# sourced by them (after ROOT and PYTHON are set), not run.
#
#   venv_begin NAME VENV DESCRIPTION FILE...
#     VENV is up to date when it holds the stamp named after the hash of FILE... (the installer,
#     this file, infra/uv-install.sh, whatever else pins the environment): then the script ends
#     here (exit 0). Else VENV is made again from nothing with $PYTHON, and INSTALL is the
#     command that installs into it (infra/uv-install.sh VENV).
#   venv_done
#     writes the stamp and says how long the build took.

venv_begin() {
  VENV_NAME=$1
  VENV=$2
  local what=$3 hash
  shift 3
  hash=$(cat "$@" | sha256sum | cut -c1-12)
  VENV_STAMP="$VENV/.installed-$hash"
  if [[ -f "$VENV_STAMP" ]]; then
    echo "$VENV_NAME env: $VENV is up to date ($hash)"
    exit 0
  fi
  VENV_STARTED=$(date +%s)
  echo "$VENV_NAME env: building $VENV ($what)"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  INSTALL=("$ROOT/infra/uv-install.sh" "$VENV")
}

venv_done() {
  touch "$VENV_STAMP"
  echo "$VENV_NAME env: ready in $(($(date +%s) - VENV_STARTED))s"
}
