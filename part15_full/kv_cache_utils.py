"""Block hashes: the content address of a full KV block.

A block's K/V depend on every token before it, not only on its own tokens (attention mixes the
whole prefix into each layer's hidden states). So a block's hash covers its parent's hash, its
own token ids and its extra keys, and two blocks have the same hash only if they hold the same
tokens *after the same prefix*: a chain, like the commits of a git history.

    hash(block i) = sha256(hash(block i-1) | token ids of block i | extra keys of block i)
    hash(block -1) = NONE_HASH, the root of every chain

Only full blocks are hashed: a partly filled block is still being written. A sequence's hashes are
computed as its blocks fill (`hash_new_full_blocks`), from the token ids the host knows; a token
still in flight (part 05's placeholder) is not among them, so a block is never hashed before all
of its tokens are known.

The encoding is canonical (fixed-width integers, JSON for the extra keys) and the hash is
cryptographic, so a collision between two different prefixes is not a practical worry and any
process computes the same hashes from the same tokens, provided it uses the same root: the root
comes from a seed fixed by configuration, or from os.urandom when none is given (then hashes
mean nothing outside this process, and nobody can precompute them).

In vLLM: vllm/v1/core/kv_cache_utils.py (hash_block_tokens, NONE_HASH, get_request_block_hasher)."""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any

BlockHash = bytes  # a 32-byte sha256 digest


def make_none_hash(seed: str | None) -> BlockHash:
    """The root of every hash chain. Fix `seed` so that other processes (a cache-aware router, a
    shared KV store) compute the same block hashes as this engine."""
    if seed is None:
        return os.urandom(32)
    return hashlib.sha256(b"prefix-cache-root:" + seed.encode()).digest()


def hash_block_tokens(parent: BlockHash, token_ids: list[int], extra_keys: tuple[Any, ...] = ()) -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(json.dumps(extra_keys, separators=(",", ":")).encode())
    return h.digest()


@dataclass
class BlockHasher:
    block_size: int
    none_hash: BlockHash

    def hash_new_full_blocks(self, seq) -> None:
        """Extend `seq.block_hashes` with the hashes of its blocks that are full of known tokens."""
        hashes, size = seq.block_hashes, self.block_size
        for i in range(len(hashes), len(seq.token_ids) // size):
            parent = hashes[-1] if hashes else self.none_hash
            tokens = seq.token_ids[i * size:(i + 1) * size]
            hashes.append(hash_block_tokens(parent, tokens, self.extra_keys(seq, i)))

    @staticmethod
    def extra_keys(seq, block_index: int) -> tuple[Any, ...]:
        """What besides the tokens decides a block's content. Here only the cache salt, in the
        first block: requests with different salts then share no block at all, since every later
        hash chains from the first. (vLLM adds LoRA ids and multimodal inputs here.)"""
        salt = seq.request.cache_salt
        return ("salt", salt) if block_index == 0 and salt is not None else ()
