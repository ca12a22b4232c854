#!/usr/bin/env python3
"""Generate engine/testdata/fingerprint_golden.json, the fingerprint golden vectors.

The vectors pin the frozen token fingerprint (spec: fingerprint.md). They are computed here,
directly on the PyPI ``xxhash`` package (pinned in requirements.txt), never by the Rust code
under test, and the JSON file is never edited by hand: change this script and regenerate.

Usage:
    python3 engine/testdata/gen_golden.py            # (re)write the golden file
    python3 engine/testdata/gen_golden.py --check    # exit 1 if regeneration would change it
"""

from __future__ import annotations

import argparse
import base64
import json
import struct
import sys
from pathlib import Path

import xxhash

SEED = 1337
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "fingerprint_golden.json"

SCHEME = {
    "name": "xxh3-64 block prefix chain",
    "hash": "XXH3-64",
    "seed": SEED,
    "content_hash": "content(block) = XXH3_64(seed, concatenation of each token id as little-endian u32)",
    "chaining": "next(prev, c) = XXH3_64(seed, le_u64(prev) || le_u64(c)), 16 bytes",
    "prefix_hashes": (
        "prefix[0] = content[0] without a parent, next(parent, content[0]) with one; "
        "prefix[i] = next(prefix[i-1], content[i]) for i >= 1"
    ),
    "full_blocks_only": "n = len(tokens) // block_size; the partial tail is dropped; block_size <= 0 or n == 0 gives no hashes",
    "hash_encoding": "each u64 as {dec: decimal string, b64be: standard base64 of its 8 big-endian bytes}",
    "wire_form": "8 bytes big-endian",
}

# (name, description, tokens, block_size, parent prefix hash or None); fingerprint.md §3.
CASES = [
    ("single_full_block", "tokens 1..=16, one full block", list(range(1, 17)), 16, None),
    (
        "partial_tail_dropped",
        "tokens 100..=119: one full block, the 4-token tail is dropped",
        list(range(100, 120)),
        16,
        None,
    ),
    ("two_block_chain", "tokens 1..=32, two chained blocks", list(range(1, 33)), 16, None),
    ("multi_block_chain", "tokens 0..=63, four chained blocks", list(range(0, 64)), 16, None),
    (
        "parent_chain",
        "tokens 50..=81 continuing a parent prefix hash 0xDEADBEEF",
        list(range(50, 82)),
        16,
        0xDEADBEEF,
    ),
    (
        "partial_only_no_blocks",
        "tokens 0..=9, shorter than one block: no hashes",
        list(range(0, 10)),
        16,
        None,
    ),
]


def xxh3(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=SEED)


def content_hash(block: list[int]) -> int:
    return xxh3(struct.pack(f"<{len(block)}I", *block))


def next_prefix(prev: int, content: int) -> int:
    return xxh3(struct.pack("<QQ", prev, content))


def hashes(tokens: list[int], bs: int, parent: int | None) -> tuple[list[int], list[int]]:
    if bs <= 0:
        return [], []
    contents = [content_hash(tokens[i * bs : (i + 1) * bs]) for i in range(len(tokens) // bs)]
    prefixes = []
    prev = parent
    for c in contents:
        prev = c if prev is None else next_prefix(prev, c)
        prefixes.append(prev)
    return contents, prefixes


def encode(h: int) -> dict[str, str]:
    return {"dec": str(h), "b64be": base64.b64encode(h.to_bytes(8, "big")).decode("ascii")}


def build() -> dict:
    cases = []
    for name, description, tokens, bs, parent in CASES:
        contents, prefixes = hashes(tokens, bs, parent)
        cases.append(
            {
                "name": name,
                "description": description,
                "tokens": tokens,
                "block_size": bs,
                "parent_prefix": None if parent is None else encode(parent),
                "content_hashes": [encode(h) for h in contents],
                "prefix_hashes": [encode(h) for h in prefixes],
            }
        )
    return {
        "generated_by": "engine/testdata/gen_golden.py (do not edit by hand)",
        "scheme": SCHEME,
        "cases": cases,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="golden file path")
    args = parser.parse_args()

    text = render()
    if args.check:
        try:
            current = args.output.read_text(encoding="utf-8")
        except FileNotFoundError:
            current = None
        if current != text:
            print(
                f"{args.output} is out of date; regenerate it with "
                "`python3 engine/testdata/gen_golden.py`",
                file=sys.stderr,
            )
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
