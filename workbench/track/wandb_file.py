"""Low-level reader for wandb's run log (`run-<id>.wandb`), as written by wandb 0.31.

wandb has no Python reader for this file, so the layout is transcribed here (it is LevelDB's
log format with wandb's own header and plain crc32):
- a 7-byte file header: b":W&B", uint16 magic 0xBEE1 (little-endian), uint8 version 0;
- then 32 KiB blocks (the header counts towards the first block) of physical records, each a
  7-byte header <crc32 uint32, length uint16, type uint8> followed by `length` bytes; the crc
  covers the type byte and the data. Type 1 is a whole record; 2/3/4 are its first, middle and
  last fragments when it does not fit the rest of a block. A block whose tail is shorter than
  a record header is zero-padded.
- each logical record is a serialized `wandb.proto.wandb_internal_pb2.Record`.

A run still being written may end in the middle of a record: that is reported as
`truncated`, not as corruption. A checksum mismatch, a bad header, or a record whose length
runs past its block is corruption and raises `CorruptRunFile` naming the file and offset.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

FILE_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK_SIZE = 32 * 1024
RECORD_HEADER = struct.Struct("<IHB")  # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class CorruptRunFile(ValueError):
    """The wandb run file is damaged: its header, a checksum or a record framing is wrong."""

    def __init__(self, path: str | Path, offset: int, reason: str):
        super().__init__(f"{path}: corrupt wandb run file at byte offset {offset}: {reason}")
        self.path = str(path)
        self.offset = offset
        self.reason = reason


@dataclass(frozen=True)
class RecordScan:
    """The logical records of one run file: (offset of the first fragment, payload bytes)."""

    path: str
    records: list[tuple[int, bytes]]
    truncated: bool  # the file ended inside a record (a run still being written, or killed)


def scan_records(path: str | Path) -> RecordScan:
    """Split a run file into verified logical records (no protobuf decoding here)."""
    data = Path(path).read_bytes()
    if len(data) < len(FILE_HEADER) or data[: len(FILE_HEADER)] != FILE_HEADER:
        raise CorruptRunFile(path, 0, f"file header is {data[:7]!r}, expected {FILE_HEADER!r}")
    records: list[tuple[int, bytes]] = []
    pending: list[bytes] | None = None  # fragments of a record split across blocks
    pending_at = 0
    off = len(FILE_HEADER)
    end = len(data)
    hs = RECORD_HEADER.size
    while off < end:
        block_left = BLOCK_SIZE - off % BLOCK_SIZE
        if block_left < hs:  # zero trailer of a block
            off += block_left
            continue
        if off + hs > end:
            return RecordScan(str(path), records, truncated=True)
        crc, length, rtype = RECORD_HEADER.unpack_from(data, off)
        if rtype == 0 and length == 0 and crc == 0:
            # Zeroed space (preallocation or padding): nothing more in this block.
            off += block_left
            continue
        if hs + length > block_left:
            raise CorruptRunFile(path, off, f"record length {length} runs past its 32 KiB block")
        if off + hs + length > end:
            return RecordScan(str(path), records, truncated=True)
        payload = data[off + hs: off + hs + length]
        if zlib.crc32(bytes([rtype]) + payload) != crc:
            raise CorruptRunFile(path, off, "crc32 mismatch")
        if rtype == FULL:
            if pending is not None:
                raise CorruptRunFile(path, off, "whole record inside a fragmented one")
            records.append((off, payload))
        elif rtype == FIRST:
            if pending is not None:
                raise CorruptRunFile(path, off, "first fragment inside a fragmented record")
            pending, pending_at = [payload], off
        elif rtype in (MIDDLE, LAST):
            if pending is None:
                raise CorruptRunFile(path, off, f"fragment type {rtype} without a first fragment")
            pending.append(payload)
            if rtype == LAST:
                records.append((pending_at, b"".join(pending)))
                pending = None
        else:
            raise CorruptRunFile(path, off, f"unknown record type {rtype}")
        off += hs + length
    return RecordScan(str(path), records, truncated=pending is not None)
