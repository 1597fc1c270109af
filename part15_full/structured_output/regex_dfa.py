"""Syntax tree -> Thompson NFA over bytes -> DFA by subset construction, dead states pruned.

Why bytes and not characters: a BPE token is a byte string, and it may end in the middle of a
multi-byte UTF-8 character ('é' is C3 A9; a vocabulary can hold C3 and A9 as separate tokens).
An automaton over code points cannot say whether "C3" is a good next token; one over bytes
walks it like any other. So each code-point set is lowered to UTF-8 byte-range sequences
(`utf8_sequences`), and both automata read one byte per step.

Thompson's construction gives each syntax node a fragment (start, end) joined by epsilon edges:
easy to build, but many states can be active at once. Subset construction turns it into a DFA:
a DFA state is the set of NFA states reachable after some bytes, so matching is one table look-up
per byte: `trans[state, byte]`. Bytes that no edge tells apart (all of 0x3A-0x40 in \\d{3}, say)
form one class, and the construction loops over classes, not over 256 bytes.

Pruning: a DFA state from which no accepting state can be reached is dead, and the transitions
into it become -1 (as do bytes no edge reads). In a Thompson NFA every state reaches the end
unless a class that matches nothing lies ahead ([^\x00-\U0010FFFF]), so such states are rare,
but pruning is what makes the guarantee: "the walk did not hit -1" means "the text is still a
prefix of some match", the test the token masks need (a token is allowed iff its bytes avoid -1).

In vLLM: xgrammar does the equivalent in C++ (its regex becomes a grammar; its matcher is a
pushdown automaton over bytes), reached via vllm/v1/structured_output/backend_xgrammar.py."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .regex_parser import Alternate, CharSet, Concat, Repeat

MAX_NFA_STATES = 200_000
MAX_DFA_STATES = 20_000  # a [states, 256] int32 table: at most 20 MB
SURROGATES = (0xD800, 0xDFFF)  # not characters: UTF-8 never encodes them
LENGTH_LIMITS = (0x7F, 0x7FF, 0xFFFF)  # last code point encoded in 1, 2, 3 bytes


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """Code points lo..hi as UTF-8: a list of byte-range sequences whose products cover exactly
    the encodings. A range is split until its bytes vary independently: first by encoded length,
    then so that each trailing 6-bit group is either shared or spans its full 0x80-0xBF range."""
    out, todo = [], [(lo, hi)]
    while todo:
        lo, hi = todo.pop()
        if lo > hi:
            continue
        if lo <= SURROGATES[1] and hi >= SURROGATES[0]:
            todo += [(lo, SURROGATES[0] - 1), (SURROGATES[1] + 1, hi)]
            continue
        split = next((m for m in LENGTH_LIMITS if lo <= m < hi), None)
        if split is not None:
            todo += [(lo, split), (split + 1, hi)]
            continue
        for k in (1, 2, 3):  # the last k bytes carry the low 6k bits
            low = (1 << (6 * k)) - 1
            if lo & ~low == hi & ~low:
                continue  # they share everything above: these bytes are fine
            if lo & low:
                todo += [(lo, lo | low), ((lo | low) + 1, hi)]
                break
            if hi & low != low:
                todo += [(lo, (hi & ~low) - 1), (hi & ~low, hi)]
                break
        else:
            out.append(list(zip(chr(lo).encode(), chr(hi).encode())))
    return out


class _NFA:
    def __init__(self) -> None:
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []  # (byte_lo, byte_hi, target)

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise ValueError(f"regex too large for the course backend (over {MAX_NFA_STATES} "
                             "NFA states); use the xgrammar backend")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node) -> tuple[int, int]:
        """A fragment for `node`: (start, end) states, fresh every call (Repeat copies it)."""
        if isinstance(node, CharSet):
            start, end = self.state(), self.state()
            for lo, hi in node.ranges:
                for seq in utf8_sequences(lo, hi):
                    cur = start
                    for j, (blo, bhi) in enumerate(seq):
                        nxt = end if j == len(seq) - 1 else self.state()
                        self.edges[cur].append((blo, bhi, nxt))
                        cur = nxt
            return start, end
        if isinstance(node, Concat):
            start = cur = self.state()
            for part in node.parts:
                a, b = self.build(part)
                self.eps[cur].append(a)
                cur = b
            return start, cur
        if isinstance(node, Alternate):
            start, end = self.state(), self.state()
            for option in node.options:
                a, b = self.build(option)
                self.eps[start].append(a)
                self.eps[b].append(end)
            return start, end
        if isinstance(node, Repeat):
            start = cur = self.state()
            for _ in range(node.min):  # the mandatory copies, in a row
                a, b = self.build(node.child)
                self.eps[cur].append(a)
                cur = b
            if node.max is None:  # a hub that loops through one more copy
                hub = self.state()
                a, b = self.build(node.child)
                self.eps[cur] += [hub]
                self.eps[hub].append(a)
                self.eps[b].append(hub)
                return start, hub
            exits = []
            for _ in range(node.max - node.min):  # optional copies: each may be skipped to the end
                exits.append(cur)
                a, b = self.build(node.child)
                self.eps[cur].append(a)
                cur = b
            end = self.state()
            for s in exits + [cur]:
                self.eps[s].append(end)
            return start, end
        raise TypeError(f"unknown regex node {node!r}")

    def closure(self, states) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)


@dataclass
class ByteDFA:
    trans: np.ndarray  # int32 [num_states, 256]; -1 = dead (no match can follow)
    accepting: np.ndarray  # bool [num_states]
    start: int

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    def walk(self, state: int, data: bytes) -> int:
        """The state after `data`, or -1 once a byte leads nowhere."""
        for b in data:
            state = int(self.trans[state, b])
            if state < 0:
                return -1
        return state

    def fullmatch(self, data: bytes) -> bool:
        s = self.walk(self.start, data)
        return s >= 0 and bool(self.accepting[s])


def build_dfa(node) -> ByteDFA:
    """Subset construction over byte classes, then keep only states that can still accept."""
    nfa = _NFA()
    nfa_start, nfa_end = nfa.build(node)
    cuts = sorted({0, 256} | {b for es in nfa.edges for lo, hi, _ in es for b in (lo, hi + 1)})
    class_of = np.zeros(256, dtype=np.int64)
    for c, (a, b) in enumerate(zip(cuts, cuts[1:])):
        class_of[a:b] = c
    num_classes = len(cuts) - 1
    start = nfa.closure([nfa_start])
    index, order, rows = {start: 0}, [start], []
    while len(rows) < len(order):
        subset = order[len(rows)]
        targets: list[set[int]] = [set() for _ in range(num_classes)]
        for s in subset:
            for lo, hi, t in nfa.edges[s]:
                for c in range(class_of[lo], class_of[hi] + 1):
                    targets[c].add(t)
        row = []
        for tset in targets:
            if not tset:
                row.append(-1)
                continue
            nxt = nfa.closure(tset)
            if nxt not in index:
                if len(order) >= MAX_DFA_STATES:
                    raise ValueError(f"regex too large for the course backend (over "
                                     f"{MAX_DFA_STATES} DFA states); use the xgrammar backend")
                index[nxt] = len(order)
                order.append(nxt)
            row.append(index[nxt])
        rows.append(row)
    trans = np.asarray(rows, dtype=np.int64)[:, class_of]  # [states, 256]
    accepting = np.array([nfa_end in s for s in order], dtype=bool)
    # Live = can reach an accepting state: grow backwards from the accepting states.
    live = accepting.copy()
    while True:
        grown = live | (live[trans] & (trans >= 0)).any(axis=1)
        if (grown == live).all():
            break
        live = grown
    if not live[0]:
        raise ValueError("regex matches no string")
    renumber = np.full(len(order) + 1, -1, dtype=np.int64)  # slot -1 keeps dead at -1
    renumber[np.flatnonzero(live)] = np.arange(int(live.sum()))
    pruned = renumber[trans[live]]  # a dead target maps to -1 too
    return ByteDFA(pruned.astype(np.int32), accepting[live], int(renumber[0]))
