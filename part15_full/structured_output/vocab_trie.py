"""The vocabulary as bytes, in a trie, walked alongside a DFA to find a state's allowed tokens.

Token bytes. A byte-level BPE vocabulary (GPT-2, Llama 3, SmolLM, Qwen) stores each token as a
string of stand-in characters: GPT-2's table maps every byte to a printable character (space is
'Ġ', newline 'Ċ'), so "Ġthe" is the bytes b" the" and "Ã" alone is the byte C3, half of 'é'.
Inverting that table gives each token's true bytes. SentencePiece-style vocabularies (Llama 2,
Mistral) use '▁' for space and <0xHH> tokens for raw bytes. Special tokens (<|im_end|>, ...)
are not text: they get no bytes, so no walk can ever allow them; EOS is added by the caller,
only at accepting states. Non-special added tokens are their literal text.

The walk. Which tokens can follow DFA state s? Token t is allowed iff walking its bytes from s
never hits a dead entry. Tokens share prefixes ("Ġthe", "Ġthere", "Ġtheir"), so the vocabulary
goes in a trie and the walk descends it with the DFA state in hand: when a byte is dead, the
whole subtree below it (every token with that prefix) is cut at once. The walk goes one trie
depth at a time, all live branches together in numpy arrays, so a mask for a permissive state
(`.*`, visiting most of the trie's ~100k nodes for SmolLM2) still costs milliseconds.

In vLLM: xgrammar builds the same thing in C++ (TokenizerInfo decodes the vocabulary; its
compiler precomputes per-state token masks), vllm/v1/structured_output/backend_xgrammar.py;
vllm/v1/structured_output/utils.py (_reduced_vocabulary: the same byte decoding for outlines)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from .regex_dfa import ByteDFA

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def gpt2_unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte <-> character table, inverted: printable Latin-1 bytes stand for themselves,
    the other 68 bytes (controls, space, ...) are moved to code points 256 and up, in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = [b for b in range(256) if b not in keep]
    table = {chr(b): b for b in keep}
    table.update({chr(256 + i): b for i, b in enumerate(moved)})
    return table


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return hasattr(tokenizer, "byte_decoder")  # a slow GPT-2 style tokenizer
    # The decoder alone (the whole tokenizer's JSON would carry the vocabulary too).
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(p.get("type") == "ByteLevel" for p in parts)


def vocabulary_bytes(tokenizer: Any, num_tokens: int) -> list[bytes | None]:
    """Each id's bytes (None for special tokens and ids the tokenizer lacks), ids < num_tokens."""
    n = min(len(tokenizer), num_tokens)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    added = {i: tok for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if i < n}
    special = set(getattr(tokenizer, "all_special_ids", [])) | \
        {i for i, tok in added.items() if getattr(tok, "special", False)}
    byte_level = _is_byte_level(tokenizer)
    to_byte = gpt2_unicode_to_byte()
    # str.translate to one Latin-1 character per byte, then encode: C speed for 49k tokens.
    to_latin1 = {ord(c): b for c, b in to_byte.items()}
    foreign = re.compile("[^" + re.escape("".join(to_byte)) + "]")
    out: list[bytes | None] = [None] * num_tokens
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            continue
        if i in added:  # plain text, not byte-mapped
            out[i] = added[i].content.encode()
        elif byte_level:
            out[i] = piece.encode() if foreign.search(piece) \
                else piece.translate(to_latin1).encode("latin-1")
        elif m := _BYTE_TOKEN.fullmatch(piece):
            out[i] = bytes([int(m[1], 16)])
        else:
            out[i] = piece.replace("\u2581", " ").encode()
    return out


@dataclass
class VocabTrie:
    """CSR trie: node n's children are edges child_start[n] .. child_start[n + 1] - 1, edge e
    reads byte child_byte[e] into node child_node[e]. Node 0 is the root (the empty prefix).
    token_node[t] is the node where token t's bytes end; -1 for a token with no bytes."""
    child_start: np.ndarray
    child_byte: np.ndarray
    child_node: np.ndarray
    token_node: np.ndarray

    @property
    def num_nodes(self) -> int:
        return len(self.child_start) - 1

    @classmethod
    def build(cls, token_bytes: list[bytes | None]) -> "VocabTrie":
        children: list[dict[int, int]] = [{}]
        token_node = np.full(len(token_bytes), -1, dtype=np.int64)
        for tid, data in enumerate(token_bytes):
            if not data:
                continue
            node = 0
            for b in data:
                nxt = children[node].get(b)
                if nxt is None:
                    nxt = children[node][b] = len(children)
                    children.append({})
                node = nxt
            token_node[tid] = node
        counts = np.fromiter((len(c) for c in children), dtype=np.int64, count=len(children))
        child_start = np.concatenate([[0], np.cumsum(counts)])
        child_byte = np.fromiter((b for c in children for b in c), dtype=np.int64,
                                 count=int(child_start[-1]))
        child_node = np.fromiter((n for c in children for n in c.values()), dtype=np.int64,
                                 count=int(child_start[-1]))
        return cls(child_start, child_byte, child_node, token_node)

    def allowed_tokens(self, dfa: ByteDFA, state: int) -> np.ndarray:
        """bool [num_tokens]: tokens whose bytes, walked from `state`, never hit a dead entry."""
        # One slot past the last node stays False: token_node == -1 indexes it.
        reached = np.zeros(self.num_nodes + 1, dtype=bool)
        nodes = np.zeros(1, dtype=np.int64)
        states = np.full(1, state, dtype=np.int64)
        while nodes.size:
            first = self.child_start[nodes]
            counts = self.child_start[nodes + 1] - first
            parent = np.repeat(np.arange(nodes.size), counts)  # which frontier entry owns each edge
            offset = np.arange(parent.size) - np.repeat(np.cumsum(counts) - counts, counts)
            edges = first[parent] + offset
            nxt = dfa.trans[states[parent], self.child_byte[edges]]
            alive = nxt >= 0  # a dead byte prunes that child and its whole subtree
            nodes, states = self.child_node[edges[alive]], nxt[alive].astype(np.int64)
            reached[nodes] = True
        return reached[self.token_node]
