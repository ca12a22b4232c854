"""Build hook: generates the gRPC stubs from the package's own copy of the contract into the
wheel.

``proto/inferencecache/v1alpha1/inferencecache.proto`` here is a byte-for-byte copy of the
repository's ``proto/`` file (``tests/test_packaging.py`` fails when they differ; refresh it with
``cp proto/inferencecache/v1alpha1/inferencecache.proto clients/python/proto/inferencecache/v1alpha1/``
from the repository root), so the sdist and the wheel build from this directory alone. The
generated modules land in ``inferencecache/v1alpha1/`` (the proto package is
``inferencecache.v1alpha1``, so the generated absolute imports resolve inside this package).
Set ``INFERENCECACHE_PROTO_ROOT`` to build from a proto tree elsewhere.
"""

import os
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
PROTO = "inferencecache/v1alpha1/inferencecache.proto"


def proto_root() -> pathlib.Path:
    root = pathlib.Path(os.environ.get("INFERENCECACHE_PROTO_ROOT", HERE / "proto"))
    if not (root / PROTO).is_file():
        raise SystemExit(
            f"inferencecache-client: {root / PROTO} not found; build from the package directory "
            "(python -m build clients/python) or set INFERENCECACHE_PROTO_ROOT"
        )
    return root


class BuildPyWithStubs(build_py):
    """Runs protoc (bundled with grpcio-tools) before copying the sources."""

    def run(self):
        from grpc_tools import protoc

        out = pathlib.Path(self.build_lib)
        out.mkdir(parents=True, exist_ok=True)
        root = proto_root()
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{root}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                PROTO,
            ]
        )
        if status != 0:
            raise SystemExit(f"inferencecache-client: protoc failed with status {status}")
        # protoc writes no __init__.py; the generated package must be importable.
        (out / "inferencecache" / "v1alpha1" / "__init__.py").write_text(
            '"""Stubs generated from proto/inferencecache/v1alpha1/inferencecache.proto."""\n'
        )
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
