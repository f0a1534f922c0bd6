"""One long JSONL line read in blocks: its top-level `text` string comes out in parts, so a
record's size never decides memory (`workbench.train.datasets` uses it for lines longer than
`datasets.LONG_LINE`; shorter lines go through `json.loads`).

The line must be a JSON object (RFC 8259: strings without raw control characters, the escapes
`\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX`, surrogate pairs joined). Values of other keys are
checked for balance and skipped, except `messages`, which is kept (a chat record is rendered
through its template whole). Damage is a `ValueError` the caller names with file and line.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import Any

BLOCK = 1 << 16
_WS = b" \t\r"
_STRING_STOP = re.compile(rb'["\\\x00-\x1f]')
_NESTED_STOP = re.compile(rb'["{}\[\]]')
_SCALAR_END = re.compile(rb"[,}\]\s]")
_ESCAPES = {ord('"'): '"', ord("\\"): "\\", ord("/"): "/", ord("b"): "\b", ord("f"): "\f",
            ord("n"): "\n", ord("r"): "\r", ord("t"): "\t"}


class _Line:
    """The bytes of one line: a first chunk, then the file in blocks up to the newline."""

    def __init__(self, f, first: bytes):
        self.ended = first.endswith(b"\n")
        self.f, self.buf, self.pos = f, first[:-1] if self.ended else first, 0

    def more(self) -> bool:
        """Read the next block of this line (dropping what was consumed); False at its end."""
        if self.ended:
            return False
        block = self.f.readline(BLOCK)
        self.ended = not block or block.endswith(b"\n")
        self.buf, self.pos = self.buf[self.pos:] + block.rstrip(b"\n"), 0
        return bool(block)

    def peek(self) -> int:
        """The next byte after JSON whitespace, not consumed; -1 at the end of the line."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WS:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return -1

    def need(self, n: int) -> bytes:
        while len(self.buf) - self.pos < n:
            if not self.more():
                raise ValueError("the line ends inside a value")
        return self.buf[self.pos:self.pos + n]

    def expect(self, char: bytes) -> None:
        if self.peek() != char[0]:
            raise ValueError(f"expected {char.decode()!r} at byte {self.pos}")
        self.pos += 1

    def drain(self) -> None:
        while self.more():
            pass


def _string(line: _Line, keep: bool) -> Iterator[str]:
    """The string whose opening quote was consumed, decoded in parts of about BLOCK characters
    (nothing when not keep)."""
    dec = codecs.getincrementaldecoder("utf-8")("surrogatepass")  # as json.loads(bytes)
    out: list[str] = []
    size = 0
    high: int | None = None  # a \\u high surrogate waiting for its low half

    def add(text: str) -> None:
        nonlocal size, high
        if text and high is not None:  # a lone high surrogate stays, as json.loads keeps it
            out.append(chr(high))
            high = None
        out.append(text)
        size += len(text)

    while True:
        m = _STRING_STOP.search(line.buf, line.pos)
        stop = len(line.buf) if m is None else m.start()
        if keep:
            add(dec.decode(line.buf[line.pos:stop]))
        line.pos = stop
        if m is None:
            if not line.more():
                raise ValueError("the line ends inside a string")
            continue
        c = line.buf[stop]
        if c == ord('"'):
            line.pos += 1
            if keep:
                add(dec.decode(b"", final=True))
                if high is not None:
                    out.append(chr(high))
                yield "".join(out)
            return
        if c < 0x20:
            raise ValueError(f"a raw control character in a string at byte {line.pos}")
        esc = line.need(2)[1]
        if esc == ord("u"):
            code = int(line.need(6)[2:].decode("ascii"), 16)
            line.pos += 6
            if high is not None and 0xDC00 <= code <= 0xDFFF:
                pair, high = 0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00), None
                add(chr(pair))
            elif 0xD800 <= code <= 0xDBFF:
                if high is not None:  # two high halves: the first stays alone
                    out.append(chr(high))
                    size += 1
                high = code
            else:
                add(chr(code))
        elif esc in _ESCAPES:
            add(_ESCAPES[esc])
            line.pos += 2
        else:
            raise ValueError(f"invalid escape \\{chr(esc)} at byte {line.pos}")
        if keep and size >= BLOCK:
            yield "".join(out)
            out, size = [], 0


def _skip(line: _Line, keep: bool) -> bytes:
    """Skip (or, with keep, return the bytes of) the value at the cursor."""
    kept: list[bytes] = []
    c = line.peek()
    start = line.pos
    if c == ord('"'):
        line.pos += 1
        if keep:  # a kept value is small or its record is rendered whole anyway
            return json.dumps("".join(_string(line, True))).encode()
        for _ in _string(line, False):
            pass
        return b""
    if c in (ord("{"), ord("[")):
        closers: list[int] = []
        while True:
            m = _NESTED_STOP.search(line.buf, line.pos)
            if m is None:
                if keep:
                    kept.append(line.buf[start:])
                line.pos = start = len(line.buf)
                if not line.more():
                    raise ValueError("the line ends inside an object or array")
                start = 0
                continue
            ch = line.buf[m.start()]
            if ch == ord('"'):
                if keep:
                    kept.append(line.buf[start:m.start()])
                line.pos = m.start() + 1
                if keep:
                    kept.append(json.dumps("".join(_string(line, True))).encode())
                else:
                    for _ in _string(line, False):
                        pass
                start = line.pos
                continue
            if ch in b"{[":
                closers.append(ord("}") if ch == ord("{") else ord("]"))
            elif not closers or closers.pop() != ch:
                raise ValueError(f"unbalanced {chr(ch)!r} at byte {m.start()}")
            line.pos = m.start() + 1
            if not closers:
                if keep:
                    kept.append(line.buf[start:line.pos])
                raw = b"".join(kept)
                if keep:
                    json.loads(raw)  # a value the scan balanced but JSON would refuse
                return raw
    # a number, true, false or null
    while (m := _SCALAR_END.search(line.buf, line.pos)) is None and line.more():
        pass
    end = m.start() if m else len(line.buf)
    raw = line.buf[line.pos:end]
    json.loads(raw)  # raises ValueError for anything that is not a JSON scalar
    line.pos = end
    return raw


def text_parts(f, first: bytes, on_messages) -> Iterator[str]:
    """The `text` value of the JSON object on this line (its first chunk `first`, the rest read
    from `f`), in parts. Without `text`, a `messages` value goes to `on_messages(list)`, whose
    string is the one part; without either, ValueError naming the keys seen."""
    line = _Line(f, first)
    keys: list[str] = []
    messages: Any = None
    try:
        line.expect(b"{")
        if line.peek() == ord("}"):
            line.pos += 1
        else:
            while True:
                line.expect(b'"')
                key = "".join(_string(line, True))
                keys.append(key)
                line.expect(b":")
                if key == "text":
                    if line.peek() != ord('"'):
                        raise TypeError("field 'text' must be a string")
                    if keys.count("text") > 1:
                        raise ValueError("the object has 'text' twice")
                    line.pos += 1
                    yield from _string(line, True)
                elif key == "messages":
                    messages = json.loads(_skip(line, True))
                else:
                    _skip(line, False)
                c = line.peek()
                line.pos += 1
                if c == ord("}"):
                    break
                if c != ord(","):
                    raise ValueError(f"expected ',' or '}}' at byte {line.pos - 1}")
        if line.peek() != -1:
            raise ValueError("extra data after the object")
        if "text" not in keys:
            if messages is None:
                raise KeyError(sorted(keys)[:8])
            yield on_messages(messages)
    finally:
        line.drain()
