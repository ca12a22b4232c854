"""The package is publishable on its own: its copy of the contract equals the repository's
(the sdist and wheel are built from that copy, ``ci.sh`` builds them from the package directory
alone), and the metadata states the Python floor its dependencies really have."""

from __future__ import annotations

import importlib.metadata
import pathlib
import sys

from conftest import REPO

PACKAGE = pathlib.Path(__file__).resolve().parents[1]
CONTRACT = pathlib.Path("proto") / "inferencecache" / "v1alpha1" / "inferencecache.proto"


def test_the_packaged_proto_is_the_repository_s():
    packaged = (PACKAGE / CONTRACT).read_bytes()
    assert packaged == (REPO / CONTRACT).read_bytes(), (
        "clients/python/proto is stale: cp proto/inferencecache/v1alpha1/inferencecache.proto "
        "clients/python/proto/inferencecache/v1alpha1/"
    )
    assert "include proto/inferencecache/v1alpha1/inferencecache.proto" in (PACKAGE / "MANIFEST.in").read_text()


def test_python_floor_is_honest():
    metadata = importlib.metadata.metadata("inferencecache-client")
    assert metadata["Requires-Python"] == ">=3.10"
    assert sys.version_info >= (3, 10)
    assert "Python 3.9" not in (PACKAGE / "README.md").read_text()


def test_installed_from_a_wheel_with_generated_stubs():
    import inferencecache
    from inferencecache.v1alpha1 import inferencecache_pb2_grpc

    assert "site-packages" in inferencecache.__file__
    for rpc in ("LookupRoute", "LookupPDRoute", "RenderTemplate", "ReportCacheState", "StreamMetrics"):
        assert hasattr(inferencecache_pb2_grpc.InferenceCacheServicer, rpc), rpc
