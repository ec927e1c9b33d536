from __future__ import annotations

import subprocess
import sys

import pytest

from engine.core.hashing import BlockHasher

H = BlockHasher(b"secret", "model-a", 4)


def test_full_blocks_only_and_deterministic() -> None:
    tokens = list(range(10))
    hashes = H.hash_prompt(tokens)
    assert len(hashes) == 2  # 10 tokens -> two full blocks of 4
    assert hashes == BlockHasher(b"secret", "model-a", 4).hash_prompt(tokens)
    assert all(len(h) == 16 for h in hashes)


def test_chained_so_equal_blocks_after_different_prefixes_differ() -> None:
    a = H.hash_prompt([1, 2, 3, 4, 9, 9, 9, 9])
    b = H.hash_prompt([5, 6, 7, 8, 9, 9, 9, 9])
    assert a[1] != b[1]
    c = H.hash_prompt([1, 2, 3, 4, 9, 9, 9, 9, 0, 0])
    assert c == a  # a shared prefix shares hashes


def test_tenants_never_share_hashes() -> None:
    tokens = list(range(16))
    a = H.hash_prompt(tokens, tenant="alice")
    b = H.hash_prompt(tokens, tenant="bob")
    assert not set(a) & set(b)
    assert H.hash_prompt(tokens, tenant="alice") == a


def test_secret_and_model_change_every_hash() -> None:
    tokens = list(range(8))
    base = set(H.hash_prompt(tokens))
    assert not base & set(BlockHasher(b"other", "model-a", 4).hash_prompt(tokens))
    assert not base & set(BlockHasher(b"secret", "model-b", 4).hash_prompt(tokens))


def test_extend_matches_one_shot() -> None:
    tokens = list(range(23))
    hashes = H.extend([], tokens[:9], "t")
    H.extend(hashes, tokens, "t")
    assert hashes == H.hash_prompt(tokens, "t")


def test_token_encoding_is_unambiguous() -> None:
    assert H.hash_prompt([1, 256, 0, 0]) != H.hash_prompt([256, 1, 0, 0])


def test_bad_config_refused() -> None:
    with pytest.raises(ValueError, match="secret"):
        BlockHasher(b"", "m", 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(b"s", "m", 0)


def test_hashing_does_not_import_torch() -> None:
    code = "import sys, engine.core.hashing, engine.core.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
