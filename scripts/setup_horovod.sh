#!/usr/bin/env bash
# Build Horovod 0.28.1 (PyTorch + MPI, CPU) from its PyPI source into .venv, for `backend="horovod"` and for the
# tests that compare collsync.torch with horovod.torch. Needs .venv (scripts/setup.sh) first. Idempotent: a second
# run only checks that `import horovod.torch` works.
#
# Horovod 0.28.1 (its last release) hard-codes C++14, and the headers of torch >= 2.1 require C++17; its
# CMakeLists.txt strips any -std= flag from CXXFLAGS, so the standard is changed in the two CMakeLists.txt of the
# source instead. About 3.5 minutes on 2 cores. Builds against the MPI whose `mpicc`/`mpicxx` come first on PATH:
# the venv's (the mpich wheel) here.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "setup_horovod: run scripts/setup.sh first" >&2; exit 1; }
VERSION=0.28.1
check() { .venv/bin/python -c "import horovod.torch as hvd, horovod; print('setup_horovod: ok, horovod', horovod.__version__)"; }
if .venv/bin/python -c "import horovod.torch" 2>/dev/null; then
    check
    exit 0
fi
command -v cmake >/dev/null || .venv/bin/python -m pip install -q cmake
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "setup_horovod: fetching horovod==$VERSION source"
.venv/bin/python -m pip download -q --no-deps --no-binary :all: --no-build-isolation "horovod==$VERSION" -d "$work"
tar -xzf "$work/horovod-$VERSION.tar.gz" -C "$work"
src="$work/horovod-$VERSION"
for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    grep -q 'CMAKE_CXX_STANDARD 14' "$f" || { echo "setup_horovod: no C++14 line in $f" >&2; exit 1; }
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
done
# Horovod's setup.py imports these while building (no build isolation: it must see the venv's torch).
.venv/bin/python -m pip install -q -c constraints.txt "setuptools<81" wheel cloudpickle psutil pyyaml packaging
echo "setup_horovod: building (PyTorch + MPI, no TensorFlow/MXNet/GPU): about 3.5 minutes on 2 cores"
PATH="$PWD/.venv/bin:$PATH" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS="-j$(nproc)" \
    .venv/bin/python -m pip install -q -c constraints.txt --no-build-isolation --no-deps "$src" \
    > "$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; echo "setup_horovod: build failed" >&2; exit 1; }
check
