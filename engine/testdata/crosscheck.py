#!/usr/bin/env python3
"""Independent fingerprint implementation for the F03 cross-check (fingerprint.md §4).

Built directly on ``xxhash.xxh3_64`` (PyPI ``xxhash``, see requirements.txt), sharing no code with
the Rust implementation. Driven by engine/tests/fingerprint_crosscheck.rs.

Input (the file named on the command line), JSON:
    {"cases": [{"tokens": [u32, ...], "block_size": int, "parent": null | "<decimal u64>"}, ...]}
Output (stdout), JSON, one result per input case, in order:
    {"results": [{"content": ["<decimal u64>", ...],
                  "prefix": ["<decimal u64>", ...],
                  "wire_hex": ["<16 hex digits, big-endian>", ...]}, ...]}
"""

from __future__ import annotations

import json
import sys

import xxhash

SEED = 1337


def h(data: bytes) -> int:
    return xxhash.xxh3_64(data, seed=SEED).intdigest()


def le32(tokens: list[int]) -> bytes:
    out = bytearray()
    for t in tokens:
        if not 0 <= t <= 0xFFFFFFFF:
            raise ValueError(f"token id out of u32 range: {t}")
        out += t.to_bytes(4, "little")
    return bytes(out)


def run_case(tokens: list[int], bs: int, parent: int | None) -> dict:
    contents: list[int] = []
    prefixes: list[int] = []
    if bs > 0:
        prev = parent
        for start in range(0, len(tokens) - bs + 1, bs):
            c = h(le32(tokens[start : start + bs]))
            p = c if prev is None else h(prev.to_bytes(8, "little") + c.to_bytes(8, "little"))
            contents.append(c)
            prefixes.append(p)
            prev = p
    return {
        "content": [str(c) for c in contents],
        "prefix": [str(p) for p in prefixes],
        "wire_hex": [p.to_bytes(8, "big").hex() for p in prefixes],
    }


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: crosscheck.py <cases.json>", file=sys.stderr)
        return 2
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    results = []
    for case in cases:
        parent = case.get("parent")
        results.append(
            run_case(case["tokens"], int(case["block_size"]), None if parent is None else int(parent))
        )
    json.dump({"results": results}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
