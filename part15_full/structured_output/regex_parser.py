"""Regex text -> a small syntax tree over Unicode code points (the course backend's first step).

The subset is what structured-output requests use in practice: literals; escapes (\\n \\t \\r \\f
\\v \\0 \\xHH \\uHHHH \\UHHHHHHHH, and any escaped punctuation such as \\. \\\\ \\( \\-); the class
escapes \\d \\w \\s and their negations \\D \\W \\S; character classes with ranges and negation
([a-z_], [^"\\\\]); `.` (any character but newline); groups ( ) and (?: ); alternation |;
quantifiers * + ? {m} {m,} {,n} {m,n}, lazy or not (laziness changes which match a search finds,
not which strings match, so it is irrelevant here). The match is always the whole output, so `^`
at the start and `$` at the end are accepted and ignored; anchors anywhere else, backreferences,
lookarounds and \\b raise ValueError.

\\d, \\w and \\s are ASCII ([0-9], [A-Za-z0-9_], [ \\t\\n\\r\\f\\v]), as in JSON Schema
patterns and xgrammar's \\d and \\w; Python's `re` gives them Unicode meanings unless re.ASCII.

Everything is a code-point set (CharSet) or built from them: a literal is a one-point set, so the
next step (regex_dfa.py) lowers a single kind of leaf to UTF-8 bytes.

In vLLM: no own regex engine; xgrammar converts the regex to its grammar in C++
(vllm/v1/structured_output/backend_xgrammar.py, compile_grammar's REGEX branch)."""
from __future__ import annotations

import re
import string
from dataclasses import dataclass

MAX_CODE_POINT = 0x10FFFF
MAX_REPEAT = 1000  # bigger bounds make NFAs with millions of states: refuse them up front


@dataclass(frozen=True)
class CharSet:
    ranges: tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code-point intervals


@dataclass(frozen=True)
class Concat:
    parts: tuple  # of nodes; empty = the empty string


@dataclass(frozen=True)
class Alternate:
    options: tuple


@dataclass(frozen=True)
class Repeat:
    child: object
    min: int
    max: int | None  # None = unbounded


def make_set(ranges) -> CharSet:
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return CharSet(tuple((lo, hi) for lo, hi in merged))


def negate(s: CharSet) -> CharSet:
    out, nxt = [], 0
    for lo, hi in s.ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return CharSet(tuple(out))


def _set(chars: str) -> CharSet:
    return make_set((ord(c), ord(c)) for c in chars)


DIGIT = make_set([(0x30, 0x39)])
WORD = make_set([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE = _set(" \t\n\r\f\v")
DOT = negate(_set("\n"))
CLASS_ESCAPES = {"d": DIGIT, "D": negate(DIGIT), "w": WORD, "W": negate(WORD),
                 "s": SPACE, "S": negate(SPACE)}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "a": "\a"}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_QUANT = re.compile(r"\{(\d*)(,?)(\d*)\}")
# Every character our parser treats specially, escaped when a CHOICE becomes a regex.
META = set("\\.^$|?*+()[]{}-")


def escape(text: str) -> str:
    """A regex matching exactly `text` (CHOICE compiles to an alternation of these)."""
    return "".join("\\" + c if c in META else c for c in text)


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p, self.i = pattern, 0

    def error(self, msg: str) -> ValueError:
        return ValueError(f"invalid regex {self.p!r} at position {self.i}: {msg}")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def quant_at(self, i: int) -> re.Match | None:
        """A {m}, {m,}, {,n} or {m,n} quantifier at i; anything else with '{' is a literal."""
        m = _QUANT.match(self.p, i)
        return m if m and (m[1] or m[2]) else None

    def parse(self):
        if self.peek() == "^":
            self.i += 1
        node = self.alternation()
        if self.i < len(self.p):  # only a stray ')' stops alternation() early
            raise self.error("unbalanced ')'")
        return node

    def alternation(self):
        options = [self.concat()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.concat())
        return options[0] if len(options) == 1 else Alternate(tuple(options))

    def concat(self):
        parts = []
        while self.peek() not in (None, "|", ")"):
            if self.peek() == "$" and self.i == len(self.p) - 1:
                self.i += 1
                break
            parts.append(self.quantified(self.atom()))
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def quantified(self, node):
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            node = Repeat(node, 0 if c != "+" else 1, 1 if c == "?" else None)
        elif c == "{" and (m := self.quant_at(self.i)):
            lo = int(m[1]) if m[1] else 0
            hi = lo if not m[2] else (int(m[3]) if m[3] else None)
            if hi is not None and hi < lo:
                raise self.error(f"min repeat {lo} greater than max {hi}")
            if max(lo, hi or 0) > MAX_REPEAT:
                raise self.error(f"repeat bound over {MAX_REPEAT}")
            self.i = m.end()
            node = Repeat(node, lo, hi)
        else:
            return node
        if self.peek() == "?":  # lazy: same language
            self.i += 1
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self.quant_at(self.i)):
            raise self.error("multiple repeat")
        return node

    def atom(self):
        c = self.p[self.i]
        self.i += 1
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.error("only (?: ) groups are supported")
            node = self.alternation()
            if self.peek() != ")":
                raise self.error("missing ')'")
            self.i += 1
            return node
        if c == "[":
            return self.char_class()
        if c == ".":
            return DOT
        if c == "\\":
            return self.escape()
        if c in "*+?" or (c == "{" and self.quant_at(self.i - 1)):
            raise self.error("nothing to repeat")
        if c in "^$":
            raise self.error(f"anchor {c!r} is only supported at the pattern's start/end")
        return _set(c)

    def escape(self, in_class: bool = False) -> CharSet:
        c = self.peek()
        if c is None:
            raise self.error("trailing backslash")
        self.i += 1
        if c in CLASS_ESCAPES:
            return CLASS_ESCAPES[c]
        if c in CHAR_ESCAPES:
            return _set(CHAR_ESCAPES[c])
        if c == "b" and in_class:  # backspace inside a class, as in Python
            return _set("\b")
        if c in HEX_ESCAPES:
            digits = self.p[self.i: self.i + HEX_ESCAPES[c]]
            if len(digits) != HEX_ESCAPES[c] or not all(d in string.hexdigits for d in digits):
                raise self.error(f"bad \\{c} escape")
            self.i += len(digits)
            cp = int(digits, 16)
            if cp > MAX_CODE_POINT:
                raise self.error("code point out of range")
            return make_set([(cp, cp)])
        if c.isalnum():
            raise self.error(f"unsupported escape \\{c}")
        return _set(c)

    def class_item(self) -> CharSet:
        c = self.p[self.i]
        if c == "\\":
            self.i += 1
            return self.escape(in_class=True)
        self.i += 1
        return _set(c)

    def char_class(self) -> CharSet:
        negated = self.peek() == "^"
        self.i += negated
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.peek() is None:
                raise self.error("unterminated character class")
            if self.peek() == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_item()
            if self.peek() == "-" and self.p[self.i + 1: self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.class_item()
                if len(lo.ranges) != 1 or lo.ranges[0][0] != lo.ranges[0][1] or \
                        len(hi.ranges) != 1 or hi.ranges[0][0] != hi.ranges[0][1]:
                    raise self.error("bad character range")
                if hi.ranges[0][0] < lo.ranges[0][0]:
                    raise self.error("bad character range (end before start)")
                ranges.append((lo.ranges[0][0], hi.ranges[0][0]))
            else:
                ranges.extend(lo.ranges)
        s = make_set(ranges)
        return negate(s) if negated else s


def parse_regex(pattern: str):
    """The pattern's syntax tree; ValueError with the position if it is outside the subset."""
    if not isinstance(pattern, str):
        raise ValueError(f"regex must be a string, got {type(pattern).__name__}")
    return _Parser(pattern).parse()
