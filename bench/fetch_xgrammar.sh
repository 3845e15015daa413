#!/usr/bin/env bash
# Fills .xgwheels/ (never committed) with xgrammar and what it imports that the GPU machine
# may lack, as wheels for that machine's Python (3.12, x86_64 Linux), so that the structured
# outputs' CUDA tests and `engine_bench.py --structured-rows` can run there: nothing can be
# installed from an index on it. Carry `.xgwheels` with the checkout, then on the machine:
#
#   bench/fetch_xgrammar.sh                          # here
#   python3 -m pip install -q --no-index --no-deps --target /tmp/xg \
#       $(python3 bench/fetch_xgrammar.sh --missing) && export PYTHONPATH=/tmp/xg   # there
#
# `--missing` prints the carried wheels whose module the running Python cannot import
# (pydantic may be there already: it is not put over it).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST="$ROOT/.xgwheels"
PY=${PYTHON:-python3}
# wheel file prefix -> the module it provides
MODULES="xgrammar:xgrammar apache_tvm_ffi:tvm_ffi pydantic-:pydantic pydantic_core:pydantic_core
annotated_types:annotated_types typing_inspection:typing_inspection typing_extensions:typing_extensions"

if [[ "${1:-}" == "--missing" ]]; then
    for pair in $MODULES; do
        prefix=${pair%%:*} module=${pair##*:}
        "$PY" -c "import $module" 2>/dev/null || ls "$DEST"/"$prefix"*.whl
    done
    exit 0
fi

rm -rf "$DEST"
"$PY" -m pip download -q --no-deps --only-binary :all: --implementation cp --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$DEST" "xgrammar${XGRAMMAR_VERSION:+==$XGRAMMAR_VERSION}" apache-tvm-ffi pydantic pydantic-core \
    annotated-types typing-inspection typing-extensions
ls "$DEST"
