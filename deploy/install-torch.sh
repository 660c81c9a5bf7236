#!/bin/sh
# Install CPU torch (the version given, e.g. 2.13.0+cpu) into the active environment
# (deploy/Dockerfile's builder stage; docs/deploy.md, "Builds behind a mirror or offline"):
# - from a wheel file in $WHEELS when one of that version is there: no torch index is
#   needed (air-gapped builds; put the wheel in deploy/wheels/);
# - else from $TORCH_INDEX_URL, by its +cpu name, so nothing can resolve a CUDA build.
# torch's own requirements (filelock, sympy, ...) come from $PIP_INDEX_URL either way.
set -eu
version=$1
if ls "$WHEELS"/torch-"$version"-*.whl > /dev/null 2>&1; then
    exec pip install --find-links "$WHEELS" --index-url "$PIP_INDEX_URL" "torch==$version"
fi
exec pip install --index-url "$TORCH_INDEX_URL" --extra-index-url "$PIP_INDEX_URL" "torch==$version"
