#!/usr/bin/env bash
# ./run.sh demo | test | bench  -- set up everything this checkout needs, then run it.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
what="${1:-demo}"

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  # Never let a plain `torch` requirement pull a multi-GB CUDA build: install a CPU build first.
  "$PY" -m pip install --quiet --index-url https://download.pytorch.org/whl/cpu --timeout 15 --retries 0 \
      "torch>=2.11" 2>/dev/null || "$PY" -m pip install --quiet "torch==2.13.0"
fi

case "$what" in
  demo)  "$PY" -m pip install --quiet -e ".[demo]" && exec "$PY" examples/train_digits.py ;;
  test)  "$PY" -m pip install --quiet -e ".[test]" && exec "$PY" -m pytest -q tests ;;
  bench) "$PY" -m pip install --quiet -e ".[test]" && exec "$PY" bench/run.py ;;
  *) echo "usage: ./run.sh demo|test|bench" >&2; exit 2 ;;
esac
