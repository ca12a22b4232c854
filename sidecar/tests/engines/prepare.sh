#!/usr/bin/env bash
# Fetches vLLM's and SGLang's published wheels (cached between runs) and extracts their own
# KV-event publisher files for sidecar/tests/engines.rs, plus the Python packages those files
# import. Prints where the files went; the test finds them there (or in
# $INFERENCECACHE_ENGINE_SOURCES).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${INFERENCECACHE_CI_CACHE:-$HOME/.cache/inferencecache-ci}"
vllm_version="${VLLM_VERSION:-0.33.0}"
sglang_version="${SGLANG_VERSION:-0.5.23}"
wheels="$cache/wheels"
sources="${INFERENCECACHE_ENGINE_SOURCES:-$cache/engine-sources}"
mkdir -p "$wheels" "$sources"

python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
  -r "$here/requirements.txt"

fetch() {
  local name="$1" version="$2"
  if ls "$wheels/$name-$version-"*.whl >/dev/null 2>&1; then
    echo "cached: $(ls "$wheels/$name-$version-"*.whl)"
    return
  fi
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --dest "$wheels" "$name==$version" ||
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.11 --platform manylinux_2_34_x86_64 --dest "$wheels" "$name==$version"
}
fetch vllm "$vllm_version"
fetch sglang "$sglang_version"

python3 - "$wheels" "$sources" "$vllm_version" "$sglang_version" <<'PY'
import glob, os, sys, zipfile
wheels, sources, vllm_version, sglang_version = sys.argv[1:]
wanted = {
    f"vllm-{vllm_version}-": ["vllm/distributed/kv_events.py"],
    f"sglang-{sglang_version}-": [
        "sglang/srt/disaggregation/kv_events.py",
        "sglang/srt/mem_cache/events.py",
    ],
}
for prefix, members in wanted.items():
    (wheel,) = glob.glob(os.path.join(wheels, prefix + "*.whl"))
    with zipfile.ZipFile(wheel) as z:
        for member in members:
            z.extract(member, sources)
    print(f"extracted {', '.join(members)} from {os.path.basename(wheel)}")
with open(os.path.join(sources, "VERSIONS"), "w") as f:
    f.write(f"vllm {vllm_version}\nsglang {sglang_version}\n")
PY
echo "engine sources: $sources"
