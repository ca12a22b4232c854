"""The content fingerprint: token ids to the chain of per-block prefix hashes.

This is the frozen construction of ``shared/spec/fingerprint.md`` (the server's
``engine/src/fingerprint.rs``): XXH3-64 with seed 1337; a block's content hash covers its token
ids as little-endian u32; each prefix hash chains the previous prefix hash and the block's
content hash as two little-endian u64; only full blocks count; on the wire each hash is 8
big-endian bytes. A gateway that computes these locally sends the same ``block_hashes`` the
server would compute from ``token_ids``.
"""

from __future__ import annotations

import struct
from typing import Iterable, List, Optional, Sequence, Tuple

import xxhash

SEED = 1337
"""XXH3-64 seed shared by every implementation of the fingerprint."""

DEFAULT_BLOCK_SIZE = 16
"""The server's default ``--engine-block-size`` (and vLLM's default block size)."""

_U64 = struct.Struct("<QQ")


def content_hash(block: Sequence[int]) -> int:
    """XXH3-64 of one block's token ids, each as a little-endian u32.

    Raises ``ValueError`` for a token id outside the u32 range (it has no wire form).
    """
    try:
        data = struct.pack(f"<{len(block)}I", *block)
    except struct.error as err:
        raise ValueError(f"token ids must be in 0..2**32-1: {err}") from None
    return xxhash.xxh3_64_intdigest(data, seed=SEED)


def next_prefix(previous: int, content: int) -> int:
    """Chains a block's content hash onto the previous prefix hash."""
    return xxhash.xxh3_64_intdigest(_U64.pack(previous, content), seed=SEED)


def prefix_hashes(
    token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE, parent: Optional[int] = None
) -> List[int]:
    """Prefix hashes (u64) of every full block of ``token_ids``.

    The partial tail is dropped; ``block_size <= 0`` gives no hashes. With ``parent`` (the prefix
    hash the sequence continues) the first block is chained onto it.
    """
    if block_size <= 0:
        return []
    hashes: List[int] = []
    previous = parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        content = content_hash(token_ids[start : start + block_size])
        previous = content if previous is None else next_prefix(previous, content)
        hashes.append(previous)
    return hashes


def to_wire(value: int) -> bytes:
    """The wire form of a prefix hash: 8 bytes, big-endian."""
    return value.to_bytes(8, "big")


def fingerprint(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> List[bytes]:
    """The ``block_hashes`` the server computes from ``token_ids`` (wire form, one per block)."""
    return [to_wire(h) for h in prefix_hashes(token_ids, block_size)]


def chain(
    token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE
) -> Tuple[List[bytes], List[int]]:
    """``(block_hashes, block_token_counts)`` for a lookup or a report of ``token_ids``."""
    hashes = fingerprint(token_ids, block_size)
    return hashes, [block_size] * len(hashes)


def parse_token_list(text: str) -> List[int]:
    """Parses ``"1,2,3"``, ``"0-255"`` (inclusive) or a mix (``"7,10-12"``) into token ids."""
    tokens: List[int] = []
    for part in _nonempty(text.replace(" ", "").split(",")):
        low, sep, high = part.partition("-")
        if sep:
            first, last = int(low), int(high)
            if last < first:
                raise ValueError(f"empty token range {part!r}")
            if last - first >= 1 << 20:
                raise ValueError(f"token range {part!r} is longer than 2**20")
            tokens.extend(range(first, last + 1))
        else:
            tokens.append(int(part))
    for token in tokens:
        if not 0 <= token <= 0xFFFFFFFF:
            raise ValueError(f"token id {token} is outside 0..2**32-1")
    return tokens


def _nonempty(parts: Iterable[str]) -> Iterable[str]:
    return (p for p in parts if p)
