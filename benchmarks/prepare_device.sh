#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what benchmarks/gpu_session.sh installs on the GPU machine, which has
# no network (Python 3.12, torch 2.11, transformers 5.17, no DeepSpeed): run here, where pip reaches
# the package index, then name .whl in the device call's `carry`.
#
#   bash benchmarks/prepare_device.sh [--peers]
#
# Always: transformers 5.24.0, the tests' pin (on 5.17 the golden graphs' mask ops differ).
# --peers: DeepSpeed 0.19.8 for benchmarks/peers.py (a wheel built from its sdist with no ops
# compiled: the device JIT-builds DeepSpeedCPUAdam on first use) and the packages it needs that the
# device lacks (pydantic and its own, hjson). MegaTrain's code is not a package: bring it with the
# agent's fetch tool (github:DLYuanGod/MegaTrain) and export its tree into .peers/MegaTrain (git-ignored)
# with its commit hash in .peers/MegaTrain/MEGATRAIN_COMMIT. The stored mirror lacks the blobs of its
# committed csrc/build binaries (aarch64), so a checkout fails: export the files one by one without
# csrc/build/ (git ls-tree -r --name-only HEAD | grep -v '^csrc/build/', then git show HEAD:<file>);
# its verl/ and build/ folders are not imported (leave them out: the tree that travels is smaller).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
exclude="$(git rev-parse --git-path info/exclude)"
for path in /.whl/ /.peers/; do
    grep -qxF "$path" "$exclude" 2>/dev/null || echo "$path" >>"$exclude"
done
mkdir -p .whl
device_wheel() {  # wheels for the device's CPython 3.12 on x86-64 Linux
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$@"
}
device_wheel transformers==5.24.0
if [ "${1:-}" = --peers ]; then
    device_wheel pydantic==2.14.3 pydantic-core==2.50.4 annotated-types typing-inspection typing-extensions hjson
    work="$(mktemp -d)"
    "$PY" -m pip download -q --no-deps --no-binary=:all: deepspeed==0.19.8 -d "$work"
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation "$work"/deepspeed-0.19.8.tar.gz -w .whl
    rm -rf "$work"
fi
ls -l .whl
du -sh .whl
