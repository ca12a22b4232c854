"""The client's fingerprint equals the server's: the golden vectors shared with ``engine/``
(``engine/testdata/fingerprint_golden.json``) and the frozen anchors of ``fingerprint.md`` §2."""

import base64
import json

import pytest

from conftest import REPO
from inferencecache import chain, content_hash, fingerprint, prefix_hashes
from inferencecache.fingerprint import parse_token_list

GOLDEN = json.loads((REPO / "engine" / "testdata" / "fingerprint_golden.json").read_text())


def test_golden_file_has_every_case():
    names = {case["name"] for case in GOLDEN["cases"]}
    assert names == {
        "single_full_block",
        "partial_tail_dropped",
        "two_block_chain",
        "multi_block_chain",
        "parent_chain",
        "partial_only_no_blocks",
    }


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_golden_vectors(case):
    tokens, bs = case["tokens"], case["block_size"]
    parent = None if case["parent_prefix"] is None else int(case["parent_prefix"]["dec"])
    prefixes = prefix_hashes(tokens, bs, parent)
    assert [str(p) for p in prefixes] == [h["dec"] for h in case["prefix_hashes"]]
    contents = [content_hash(tokens[i : i + bs]) for i in range(0, len(tokens) - bs + 1, bs)]
    assert [str(c) for c in contents] == [h["dec"] for h in case["content_hashes"]]
    if parent is None:
        wire = fingerprint(tokens, bs)
        assert [base64.b64encode(w).decode() for w in wire] == [h["b64be"] for h in case["prefix_hashes"]]


def test_frozen_anchors():
    assert content_hash(range(1, 17)) == 16863443419780771464
    assert base64.b64encode(fingerprint(list(range(1, 17)))[0]).decode() == "6gb8caXubog="
    assert prefix_hashes(list(range(0, 64)), 16)[3] == 3888788807566526800
    assert prefix_hashes(list(range(50, 82)), 16, 0xDEADBEEF)[1] == 2998384554010166533
    assert base64.b64encode(fingerprint([14990, 1879], 2)[0]).decode() == "I48zwHwdhp4="


def test_chain_counts_tail_and_prefix_property():
    tokens = list(range(1000, 1000 + 16 * 5 + 7))
    hashes, counts = chain(tokens, 16)
    assert len(hashes) == 5 and counts == [16] * 5
    assert chain(tokens[: 16 * 3], 16)[0] == hashes[:3]
    assert chain(tokens, 0) == ([], [])
    assert chain(tokens[:15], 16) == ([], [])


def test_token_ids_outside_u32_are_refused():
    with pytest.raises(ValueError):
        fingerprint([1 << 32] * 16)
    with pytest.raises(ValueError):
        fingerprint([-1] * 16)


def test_parse_token_list():
    assert parse_token_list("0-3") == [0, 1, 2, 3]
    assert parse_token_list("7, 10-12,5") == [7, 10, 11, 12, 5]
    for bad in ["5-1", "x", "4294967296", "0-2000000"]:
        with pytest.raises(ValueError):
            parse_token_list(bad)
