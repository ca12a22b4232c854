#!/usr/bin/env bash
# Puts Debian's promtool (package `prometheus`) under $HOME/.cache/inferencecache-ci/promtool and
# prints its path. Only the .deb is downloaded and promtool extracted from it: installing the
# package would also set up a Prometheus daemon nothing here needs. The .deb is cached.
set -euo pipefail
cache="${HOME}/.cache/inferencecache-ci/promtool"
tool="$cache/usr/bin/promtool"
if [ ! -x "$tool" ]; then
  mkdir -p "$cache"
  if ! ls "$cache"/prometheus_*.deb >/dev/null 2>&1; then
    (cd "$cache" && { apt-get download prometheus >/dev/null 2>&1 ||
      { apt-get update -qq && apt-get download prometheus >/dev/null 2>&1; }; })
  fi
  deb="$(ls "$cache"/prometheus_*.deb | head -n1)"
  (cd "$cache" && dpkg-deb --fsys-tarfile "$deb" | tar -x ./usr/bin/promtool)
fi
"$tool" --version >/dev/null
echo "$tool"
