#!/usr/bin/env bash
# Brings the pinned onnxruntime-gpu wheel to the lent device machine, which reaches no network.
#
# One call of the device tool carries at most 64 MiB, the wheel is ~255 MB: so it is downloaded and
# cut into parts here, each part sent in its own `run` call (back to back, under 30 s apart, so that
# the machine stays warm and keeps the parts already sent), then put together, checked and installed
# there. docs/cuda.md walks through the calls.
#
#   bash bench/cuda_wheel.sh download        # here: pip download, split into .cudawheel/partNN/chunk
#   bash bench/cuda_wheel.sh receive NN      # there, one call per part, carry [".cudawheel/partNN"]:
#                                            # the part is copied to $CUDA_WHEEL_STASH, outside the tree
#   bash bench/cuda_wheel.sh install         # there, after the last part: reassemble, sha256, pip --target
#   bash bench/cuda_wheel.sh env             # the PYTHONPATH line that puts the install first
#
# Settings (environment): CUDA_WHEEL_DIR (.cudawheel), CUDA_WHEEL_CHUNK_MIB (54: the tracked tree is
# ~6 MiB and rides along in every call), CUDA_WHEEL_STASH (/tmp/cudawheel-parts), CUDA_WHEEL_TARGET
# (/tmp/ortgpu), ORT_GPU_VERSION (the pin in requirements.txt).
#
# Why the stash: a carried path lasts only for its own call. The first run on an H200 (2026-12-04)
# found part00 gone from the tree when part04's call ran, so each part is copied out of the tree,
# where a warm machine keeps it, and `install` reads the stash.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR="${CUDA_WHEEL_DIR:-.cudawheel}"
CHUNK_MIB="${CUDA_WHEEL_CHUNK_MIB:-54}"
TARGET="${CUDA_WHEEL_TARGET:-/tmp/ortgpu}"
VERSION="${ORT_GPU_VERSION:-$(sed -n 's/^onnxruntime-gpu==\([0-9][0-9.]*\).*/\1/p' requirements.txt)}"
MANIFEST="$DIR/part00/MANIFEST"
STASH="${CUDA_WHEEL_STASH:-/tmp/cudawheel-parts}"

python_here() {
    if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo python3; fi
}

download() {
    # The parts must not travel with the working tree unless a call names them in carry.
    case "$DIR" in
        /*) ;;
        *) mkdir -p .git/info && { grep -qxF "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >>.git/info/exclude; } ;;
    esac
    rm -rf "$DIR"
    mkdir -p "$DIR/dl"
    # The device's python3 is CPython 3.12 on x86-64 Linux; the wheel is manylinux_2_27/2_28.
    "$(python_here)" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        -d "$DIR/dl" "onnxruntime-gpu==$VERSION"
    local wheel name sha count
    wheel=$(ls "$DIR"/dl/*.whl)
    name=$(basename "$wheel")
    sha=$(sha256sum "$wheel" | cut -d' ' -f1)
    split -b "${CHUNK_MIB}m" -d -a 2 "$wheel" "$DIR/dl/chunk."
    for chunk in "$DIR"/dl/chunk.*; do
        mkdir -p "$DIR/part${chunk##*.}"
        mv "$chunk" "$DIR/part${chunk##*.}/chunk"
    done
    count=$(find "$DIR" -maxdepth 1 -name 'part*' -type d | wc -l)
    printf '%s\n%s\n%s\n' "$name" "$sha" "$count" >"$MANIFEST"
    rm -rf "$DIR/dl"
    echo "$name: $count parts of at most $CHUNK_MIB MiB, sha256 $sha"
    echo "Send them back to back (each call within 30 s of the last one's end), in this order:"
    local last=$((count - 1)) part
    for part in $(seq -f '%02g' 0 "$last"); do
        if [ "$part" = "$(printf '%02d' "$last")" ]; then
            echo "  run(carry=[\"$DIR/part$part\"], timeout_s=600, command=\"bash bench/cuda_wheel.sh receive $part && bash bench/cuda_wheel.sh install && PYTHONUNBUFFERED=1 PYTHONPATH=$TARGET python3 bench/cuda_proof.py --budget-s 480\")"
        else
            echo "  run(carry=[\"$DIR/part$part\"], command=\"bash bench/cuda_wheel.sh receive $part\")"
        fi
    done
}

receive() {
    local part="$1"
    test -s "$DIR/part$part/chunk" || { echo "part $part did not arrive (carry \"$DIR/part$part\")" >&2; exit 1; }
    mkdir -p "$STASH"
    rm -rf "$STASH/part$part"
    cp -r "$DIR/part$part" "$STASH/part$part"
    ls -l "$STASH"/part*/chunk
}

install() {
    local manifest="$STASH/part00/MANIFEST"
    test -s "$manifest" || { echo "no $manifest: part 00 was not received, or the machine went cold" >&2; exit 1; }
    local name sha count have out
    name=$(sed -n 1p "$manifest")
    sha=$(sed -n 2p "$manifest")
    count=$(sed -n 3p "$manifest")
    have=$(ls "$STASH"/part*/chunk 2>/dev/null | wc -l)
    if [ "$have" != "$count" ]; then
        echo "$have of $count parts here (a cold machine starts bare: send them all again)" >&2
        exit 1
    fi
    out=/tmp/ortgpu-wheel
    mkdir -p "$out"
    # part00, part01, ...: the glob sorts them in order.
    cat "$STASH"/part*/chunk >"$out/$name"
    echo "$sha  $out/$name" | sha256sum -c -
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" "$out/$name"
    rm -f "$out/$name"
    PYTHONPATH="$TARGET" python3 -c 'import onnxruntime as o; print(o.__version__, o.__file__, o.get_available_providers())'
}

case "${1:-}" in
    download) download ;;
    receive) receive "${2:?which part, e.g. 00}" ;;
    install) install ;;
    env) echo "export PYTHONPATH=$TARGET\${PYTHONPATH:+:\$PYTHONPATH}" ;;
    *)
        sed -n '2,17p' "$0"
        exit 2
        ;;
esac
