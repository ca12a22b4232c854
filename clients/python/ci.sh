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
# A plain (non-editable) install, as a user would do it: the wheel is built from proto/.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "./clients/python[test]"
# The installed stubs import from the venv, not from the source tree.
(cd "$venv" && "$venv/bin/python" -c "import inferencecache, inferencecache.v1alpha1.inferencecache_pb2 as pb; assert 'site-packages' in inferencecache.__file__; print('installed', inferencecache.__version__, pb.DESCRIPTOR.package)")

# promtool for tests/test_alerts.py (Debian's `prometheus` package; only the .deb is fetched).
PROMTOOL="$(bash "$repo/deploy/prometheus/prepare-promtool.sh")"
export PROMTOOL

cd "$here"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests
