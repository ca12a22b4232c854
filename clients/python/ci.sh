#!/usr/bin/env bash
# Python checks of the client package and the operator-facing files, against the REAL binaries:
#   - the package installs in a fresh venv (stubs generated from proto/ at build time);
#   - pytest: client (sync + asyncio, fail-open), fingerprint golden vectors, the CLI,
#     docs/metrics.md vs a live /metrics, the Grafana dashboard's PromQL, the Kubernetes
#     manifests (schemas offline, every flag run through the real server and sidecar), the alert
#     rules (promtool check rules / test rules, Debian's promtool extracted and cached), the
#     container images' runtime layout (podman build FROM scratch, run under unshare + chroot).
# Called by one step of .ci/run; runnable locally from anywhere: bash clients/python/ci.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"

# The debug binaries the tests run: the ones `cargo test --workspace` builds, so in CI (after
# that step) this is a no-op (`cargo build -p …` would resolve other dependency features and
# rebuild the server and the sidecar, ~2 min on 2 cores).
cargo test --workspace --no-run --quiet

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
venv="$scratch/venv"
python3 -m venv "$venv"
# The package is built as a user would publish it: `python -m build` in a copy of the package
# directory alone (no repository around it), an sdist first and the wheel from that sdist, so
# both carry what they need (the proto copy; the stubs generated at build time).
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check build==1.3.0
package="$scratch/package"
mkdir -p "$package"
(cd "$here" && tar -c --exclude=build --exclude=dist --exclude='*.egg-info' --exclude=__pycache__ .) | tar -x -C "$package"
"$venv/bin/python" -m build --outdir "$scratch/dist" "$package" >"$scratch/build.log" 2>&1 || { cat "$scratch/build.log"; exit 1; }
sdist="$(ls "$scratch"/dist/inferencecache_client-*.tar.gz)"
wheel="$(ls "$scratch"/dist/inferencecache_client-*.whl)"
# (Listings captured first: `grep -q` closing a pipe early would fail the pipeline.)
sdist_files="$(tar -tzf "$sdist")"
wheel_files="$("$venv/bin/python" -m zipfile -l "$wheel")"
grep -q '/proto/inferencecache/v1alpha1/inferencecache.proto$' <<<"$sdist_files"
grep -q 'inferencecache/v1alpha1/inferencecache_pb2_grpc.py' <<<"$wheel_files"
echo "built $(basename "$sdist") and $(basename "$wheel") from the package directory alone"
# A plain install of that wheel, as a user would do it.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$wheel[test]"
# The installed stubs import from the venv, not from the source tree.
(cd "$venv" && "$venv/bin/python" -c "import inferencecache, inferencecache.v1alpha1.inferencecache_pb2 as pb; assert 'site-packages' in inferencecache.__file__; print('installed', inferencecache.__version__, pb.DESCRIPTOR.package)")

# promtool for tests/test_alerts.py (Debian's `prometheus` package; only the .deb is fetched).
PROMTOOL="$(bash "$repo/deploy/prometheus/prepare-promtool.sh")"
export PROMTOOL

cd "$here"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests
