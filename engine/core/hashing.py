"""Chained, keyed, tenant-salted block hashes (torch-free: the router computes the same).

hash(block i) = BLAKE2b-128 keyed with the cluster secret over
    hash(block i-1) || little-endian uint32 token ids of block i
and the chain starts from a root hash over (model id, tenant). So equal prefixes
share hashes only inside one model and one tenant, and nobody without the
secret can forge or probe a hash. Only full blocks are hashed.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from engine.types import BlockHash

_DIGEST_BYTES = 16
_DOMAIN = b"splitserve/block-hash/v1"


@dataclass(frozen=True)
class BlockHasher:
    """Computes block hashes for one model under one cluster secret."""

    secret: bytes
    """Cluster-wide key (1..64 bytes); every worker and router must share it."""
    model_id: str
    """Identifies the weights; hashes never match across models."""
    block_size: int
    """Tokens per block."""

    def __post_init__(self) -> None:
        if not 1 <= len(self.secret) <= 64:
            raise ValueError(f"secret must be 1..64 bytes, got {len(self.secret)}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    def root(self, tenant: str) -> BlockHash:
        """The parent hash of a tenant's first block."""
        h = hashlib.blake2b(key=self.secret, digest_size=_DIGEST_BYTES)
        for part in (_DOMAIN, self.model_id.encode(), tenant.encode()):
            h.update(struct.pack("<I", len(part)))
            h.update(part)
        return BlockHash(h.digest())

    @cached_property
    def _keyed(self) -> Any:
        """BLAKE2b keyed with the secret and nothing hashed yet: each block copies it (cheaper
        than keying a new one, same digest)."""
        return hashlib.blake2b(key=self.secret, digest_size=_DIGEST_BYTES)

    def chain(self, parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
        """Hash of one full block given its parent's hash."""
        if len(token_ids) != self.block_size:
            raise ValueError(f"a block has {self.block_size} tokens, got {len(token_ids)}")
        return self.extend_tail([parent], token_ids, "")[1]

    def extend(
        self, hashes: list[BlockHash], token_ids: Sequence[int], tenant: str
    ) -> list[BlockHash]:
        """Append the hashes of every newly full block of `token_ids` to `hashes`."""
        return self.extend_tail(hashes, token_ids[len(hashes) * self.block_size:], tenant)

    def extend_tail(self, hashes: list[BlockHash], tail: Sequence[int], tenant: str) -> list[BlockHash]:
        """As `extend`, given only the tokens after the last hashed block (a long request's
        whole token list is not copied for each block its output fills). The full blocks'
        token ids are packed once; each block then costs one copy of the keyed state and
        two updates."""
        width = self.block_size * 4
        num_tokens = len(tail) // self.block_size * self.block_size
        if not num_tokens:
            return hashes
        data = memoryview(struct.pack(f"<{num_tokens}I", *tail[:num_tokens]))
        parent = hashes[-1] if hashes else self.root(tenant)
        keyed = self._keyed
        for start in range(0, len(data), width):
            h = keyed.copy()
            h.update(parent)
            h.update(data[start:start + width])
            parent = h.digest()
            hashes.append(parent)  # type: ignore[arg-type]  # a BlockHash (NewType of bytes)
        return hashes

    def hash_prompt(self, token_ids: Sequence[int], tenant: str = "") -> list[BlockHash]:
        """Hashes of all full blocks of a prompt."""
        return self.extend([], token_ids, tenant)
