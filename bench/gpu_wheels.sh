#!/bin/sh
# The wheels `make gpu-check GPU_PYTHON=... WHEELS=DIR` needs on a GPU host without network whose Python already
# has CUDA torch (and numpy, xxhash, rich, pyyaml, jinja2, prometheus-client, threadpoolctl, pytest,
# pytest-timeout, hypothesis, as NVIDIA's and most CUDA images do): reshard's other runtime dependencies, at the
# versions this checkout's .venv runs, for that host's Python and platform, and NIXL for that host's CUDA (the
# nixl transport's GPU tests and bench row; its wheel is 59 MB, 31 MB once bench/_wheels.py drops its
# expert-parallel kernels, which reshard never imports; "none" leaves it out). Run it here, carry DIR
# over, then
#   make gpu-check GPU_PYTHON=python3 WHEELS=DIR
#
#   bench/gpu_wheels.sh [PYTHON_VERSION (3.12)] [DIR (.whl)] [NIXL (nixl-cu13; nixl-cu12 for CUDA 12, or none)]
set -eu
version=${1:-3.12}
dir=${2:-.whl}
nixl=${3:-nixl-cu13}
pip="${PIP:-.venv/bin/python -m pip}"
# name==version of each package as the .venv has it (make test installs it)
pins=$($pip list --format=freeze 2>/dev/null | grep -i -E '^(grpcio|grpcio-health-checking|protobuf|fastapi|starlette|pydantic|pydantic[-_]core|uvicorn|cryptography|cffi|pycparser|annotated-types|typing-inspection)==' || true)
if [ -z "$pins" ]; then
    echo "error: no versions to pin: run make test first (it creates .venv), or set PIP to a pip that has them" >&2
    exit 1
fi
if [ "$nixl" != none ]; then  # the NIXL release the .venv's nixl-cu12 is, built for that host's CUDA
    release=$($pip list --format=freeze 2>/dev/null | sed -n 's/^nixl-cu12==//p')
    pins="$pins $nixl${release:+==$release}"
fi
mkdir -p "$dir"
# shellcheck disable=SC2086 # one argument per pin
$pip download --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" $pins
if [ "$nixl" != none ]; then  # its expert-parallel kernels, which reshard never imports: 31 of the wheel's 59 MB
    for wheel in "$dir"/$(echo "$nixl" | tr - _)-*.whl; do
        [ -e "$wheel" ] && ${PYTHON:-.venv/bin/python} "$(dirname "$0")/_wheels.py" "$wheel" "$(echo "$nixl" | sed 's/^nixl-/nixl_ep_/; s/-/_/g')"
    done
fi
echo "gpu_wheels: $(ls "$dir"/*.whl | wc -l) wheels in $dir for Python $version ($(du -sh "$dir" | cut -f1)); now, on the GPU host:"
echo "  make gpu-check GPU_PYTHON=python3 WHEELS=$dir"
