#!/bin/bash
# Benchmarks on a GPU host that reaches no package registry, from this source tree.
#
#   bash bench/offline.sh wheels DIR      # here: fetch the wheels such a host lacks into DIR
#   bash bench/offline.sh run DIR CMD...  # there: install DIR's wheels into /tmp/site, check
#                                         # the project's imports, run CMD (PYTHONPATH set)
#
# The host is assumed to have a CUDA build of torch and triton, transformers and tokenizers
# for its python3 (3.12); DIR then holds everything else the whole stack, the tests and
# py-spy need (about 30 MB, no torch). Copy DIR and the tokenizer a benchmark reads (e.g.
# .bench/tok150k.json) beside the tree, then e.g.:
#   bash bench/offline.sh run .whl python3 bench/serve.py --tokenizer .bench/tok150k.json ...
set -euo pipefail
cmd=${1:-}
dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { sed -n '2,12p' "$0"; exit 2; }

case "$cmd" in
wheels)
    mkdir -p "$dir"
    # The project's pins where it has them (pyproject.toml); fastapi needs opentelemetry-api.
    pip download -q --only-binary=:all: --no-deps --python-version 3.12 -d "$dir" \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_31_x86_64 \
        xgrammar==0.2.9 apache-tvm-ffi pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \
        typing-inspection 'typing-extensions>=4.16' llguidance==1.9.1 'grpcio>=1.85.1' \
        'grpcio-health-checking>=1.85.1' 'grpcio-reflection>=1.85.1' 'protobuf>=7.35.1' \
        jsonschema jsonschema-specifications referencing rpds-py attrs jsonschema-rs \
        fastapi starlette uvicorn anyio sniffio h11 click annotated-doc opentelemetry-api \
        importlib-metadata zipp fqdn isoduration arrow jsonpointer rfc3339-validator \
        rfc3986-validator rfc3987-syntax lark uri-template webcolors cryptography cffi pycparser \
        pytest pluggy iniconfig packaging pytest-timeout py-spy
    du -sh "$dir"
    ;;
run)
    shift 2
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$dir"/*.whl
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
    python3 -c "import gateway.commands, gateway.loadgen, gateway.openai_api, \
gpu_worker.control.server, grammar_service.server, xgrammar, llguidance, transformers"
    "$@"
    ;;
*)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
