#!/usr/bin/env bash
# Fill .wheels/ (an ignored folder) with the py3.12 x86-64 wheels that bench/gpu_session.sh installs
# on a GPU machine that has torch with CUDA but not hivemind and its dependencies, and cannot reach a
# package index. Each package at the version installed here (so the GPU run uses what CI tests), or
# the newest the index holds where it is not installed here. Run it here, where pip reaches an index:
#
#     bash bench/gpu_wheels.sh            # then carry .wheels with the device run
#
# The list is what the GPU image lacked when last read (docs/operations.md#tests); py-spy is added
# where the index has it (gpu_session.sh samples a GPU peer with it).
set -eu
DEST=${DEST:-.wheels}
PY=${PY:-python3}
PACKAGES="hivemind base58 configargparse cryptography cffi pycparser netaddr prefetch_generator py-cid
py-multihash py-multibase py-multicodec varint blake3 python-baseconv morphys mmh3 multiaddr dnspython
trio outcome sniffio pydantic pydantic-core annotated-types typing-inspection typing-extensions protobuf
py-spy"
mkdir -p "$DEST"  # .wheels/ is in .gitignore
pinned() {  # NAME -> NAME==VERSION where installed here, else NAME
    $PY - "$1" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    print(f"{sys.argv[1]}=={version(sys.argv[1])}")
except PackageNotFoundError:
    print(sys.argv[1])
EOF
}
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
missing=""
for name in $PACKAGES; do
    spec=$(pinned "$name")
    # shellcheck disable=SC2086
    if $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            $PLATFORMS -d "$DEST" "$spec" > /dev/null 2>&1; then
        continue
    fi
    # a package published only as source: its wheel built here serves on 3.12 only if it is pure Python
    built=$(mktemp -d)
    if $PY -m pip wheel -q --no-deps -w "$built" "$spec" > /dev/null 2>&1 && ls "$built"/*-none-any.whl > /dev/null 2>&1; then
        mv "$built"/*-none-any.whl "$DEST"/
        rm -rf "$built"
        continue
    fi
    rm -rf "$built"
    missing="$missing $spec"
done
# two versions of one package stop the install on the GPU machine: keep the newest file of each
$PY - "$DEST" <<'EOF'
import os, re, sys
dest = sys.argv[1]
by_name = {}
for f in sorted(os.listdir(dest)):
    if f.endswith(".whl"):
        by_name.setdefault(re.split(r"-\d", f, maxsplit=1)[0].lower().replace("_", "-"), []).append(f)
for name, files in by_name.items():
    for stale in sorted(files, key=lambda f: os.path.getmtime(os.path.join(dest, f)))[:-1]:
        os.remove(os.path.join(dest, stale))
        print(f"removed an older wheel of {name}: {stale}")
EOF
echo "$(ls "$DEST"/*.whl | wc -l) wheels in $DEST, $(du -sh "$DEST" | cut -f1) (the device run carries at most 64 MiB)"
if [ -n "$missing" ]; then
    echo "no wheel could be had for:$missing" >&2
    [ "$missing" = " py-spy" ] || exit 1
fi
