#!/usr/bin/env bash
# Create ./.venv with Python >= 3.12 and install k31jax (editable) with its test extras.
# Finds python3.12/3.13 on PATH, or a pyenv-installed 3.12+ when the default python is older.
# --tpu also installs the `tpu` extra (libtpu: XLA's TPU compiler, for `k31jax compile` on any host).
set -euo pipefail
EXTRAS="test"
for arg in "$@"; do
  case "$arg" in
    --tpu) EXTRAS="test,tpu" ;;
    *) echo "scripts/install.sh: unknown argument $arg (expected --tpu)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
VENV="${K31JAX_VENV:-.venv}"

find_python() {
  for exe in python3.12 python3.13 python3.14 python3; do
    if command -v "$exe" >/dev/null 2>&1 && "$exe" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$exe"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])' | sort -V -r); do
      exe="$(pyenv root)/versions/$v/bin/python3"
      if [ -x "$exe" ]; then echo "$exe"; return 0; fi
    done
  fi
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY="$(find_python)" || { echo "k31jax needs Python >= 3.12 (none found on PATH or in pyenv)" >&2; exit 1; }
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"
"$VENV/bin/python" -c "import k31jax" 
