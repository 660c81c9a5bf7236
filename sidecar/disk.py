"""The disk tier: one file per block, written atomically, verified on every read.

File layout: a fixed little-endian header (magic, flags, fmt, dtype, shape, lengths,
CRC-32, nonce), the key, then the payload (AES-256-GCM ciphertext + tag when a key is
set). Writes go to a temporary file that is fsynced and renamed over the final name, so
a crash leaves either the old file, the new one, or a stray `.tmp` that the next start
removes. The CRC covers header, key and payload; with encryption the GCM tag also
authenticates them. A block that fails either check is reported corrupt and deleted.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from sidecar.blocks import BlockMeta

log = logging.getLogger(__name__)

MAGIC = b"CTXKV\x00\x00\x01"
# A packed block's file (flag below) has a magic of its own: a sidecar from before
# compression takes it for an unreadable file and removes it, never serves its bytes.
MAGIC_PACKED = b"CTXKV\x00\x00\x02"
FLAG_ENCRYPTED = 1
FLAG_PACKED = 2  # the payload is `sidecar.coldkv`'s fp8 form of a `length`-byte block
# magic, flags, fmt, dtype, shape0..3, length, stored_length, key_length, nonce
_PREFIX = struct.Struct("<8sIii4iqqI12s")
_CRC = struct.Struct("<I")
HEADER_SIZE = _PREFIX.size + _CRC.size
_TAG = 16
SUFFIX = ".kv"


class CorruptBlock(Exception):
    """A block on disk failed its checksum or authentication."""


@dataclass(frozen=True, slots=True)
class DiskEntry:
    meta: BlockMeta
    path: Path
    mtime: float
    packed: bool = False
    payload_length: int = 0  # of the (decrypted) payload: `meta.length` unless packed


class DiskTier:
    def __init__(self, root: Path, *, aes_key: bytes | None = None) -> None:
        self.root = Path(root) / "blocks"
        self.root.mkdir(parents=True, exist_ok=True)
        self._aead = AESGCM(aes_key) if aes_key else None

    def new_path(self, key: str) -> Path:
        """A fresh file name per write: a late delete of an older copy never hits a newer one."""
        return self.root / f"{_key_hash(key)}-{uuid.uuid4().hex[:12]}{SUFFIX}"

    def write(
        self, meta: BlockMeta, data: bytes | bytearray | memoryview, *, packed: bool = False
    ) -> Path:
        """Write a block atomically (tmp + fsync + rename); returns its path. `packed`:
        `data` is the block's fp8 form (`sidecar.coldkv`), flagged in the header."""
        key = meta.key.encode()
        flags, nonce = FLAG_PACKED if packed else 0, b"\x00" * 12
        payload: bytes | bytearray | memoryview = data
        stored = len(memoryview(data).cast("B")) if packed else meta.length
        if self._aead is not None:
            flags, nonce, stored = flags | FLAG_ENCRYPTED, os.urandom(12), stored + _TAG
        prefix = _PREFIX.pack(
            MAGIC_PACKED if packed else MAGIC,
            flags,
            meta.fmt,
            meta.dtype,
            *meta.shape,
            meta.length,
            stored,
            len(key),
            nonce,
        )
        if self._aead is not None:
            payload = self._aead.encrypt(nonce, data, prefix + key)
        crc = zlib.crc32(payload, zlib.crc32(key, zlib.crc32(prefix)))
        path = self.new_path(meta.key)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            with open(tmp, "wb", buffering=0) as f:
                f.write(prefix + _CRC.pack(crc) + key)
                view = memoryview(payload)
                while view:
                    view = view[f.write(view) :]
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    def read(self, meta: BlockMeta, path: Path, *, packed: bool = False) -> bytearray | bytes:
        """The payload of a block (its packed form where `packed`, as the index found it);
        raises CorruptBlock if anything does not check out."""
        try:
            with open(path, "rb", buffering=0) as f:
                head = _read_exact(f, HEADER_SIZE)
                prefix, (crc,) = head[: _PREFIX.size], _CRC.unpack(head[_PREFIX.size :])
                fields = _PREFIX.unpack(prefix)
                stored, key_len = fields[9], fields[10]
                key = _read_exact(f, key_len)
                if (
                    bytes(key) != meta.key.encode()
                    or stored < 0
                    or bool(fields[1] & FLAG_PACKED) != packed
                ):
                    raise CorruptBlock(f"{path.name}: header does not match the index")
                payload = bytearray(stored)
                if _fill(f, memoryview(payload)) != stored or f.read(1):
                    raise CorruptBlock(f"{path.name}: truncated or oversized payload")
        except FileNotFoundError:
            raise CorruptBlock(f"{path.name}: missing") from None
        if zlib.crc32(payload, zlib.crc32(key, zlib.crc32(prefix))) != crc:
            raise CorruptBlock(f"{path.name}: checksum mismatch")
        if fields[1] & FLAG_ENCRYPTED:
            if self._aead is None:
                raise CorruptBlock(f"{path.name}: encrypted, and no key is configured")
            try:
                return self._aead.decrypt(fields[11], bytes(payload), prefix + key)
            except InvalidTag:
                raise CorruptBlock(f"{path.name}: authentication failed") from None
        return payload

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def scan(self) -> list[DiskEntry]:
        """Rebuild the index from the files: oldest first; strays and torn files removed."""
        found: list[DiskEntry] = []
        for path in self.root.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write that never reached its rename
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                entry = self._read_entry(path)
            except (OSError, CorruptBlock, struct.error, UnicodeDecodeError) as exc:
                log.warning("removing unreadable block file %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                continue
            found.append(entry)
        found.sort(key=lambda e: e.mtime)
        return found

    def _read_entry(self, path: Path) -> DiskEntry:
        st = path.stat()
        with open(path, "rb", buffering=0) as f:
            head = _read_exact(f, HEADER_SIZE)
            magic, flags, fmt, dtype, s0, s1, s2, s3, length, stored, key_len, _nonce = (
                _PREFIX.unpack(head[: _PREFIX.size])
            )
            if magic not in (MAGIC, MAGIC_PACKED) or (magic == MAGIC_PACKED) != bool(
                flags & FLAG_PACKED
            ):
                raise CorruptBlock("bad magic")
            if st.st_size != HEADER_SIZE + key_len + stored:
                raise CorruptBlock("size does not match the header")
            key = bytes(_read_exact(f, key_len)).decode()
        if not path.name.startswith(_key_hash(key) + "-"):
            raise CorruptBlock("file name does not match the key")
        meta = BlockMeta(key, length, fmt, dtype, (s0, s1, s2, s3))
        payload = stored - _TAG if flags & FLAG_ENCRYPTED else stored
        return DiskEntry(meta, path, st.st_mtime, bool(flags & FLAG_PACKED), payload)


def _key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _fill(f: io.FileIO, view: memoryview) -> int:
    """readinto until the view is full or the file ends; returns the bytes read."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _read_exact(f: io.FileIO, n: int) -> bytearray:
    buf = bytearray(n)
    if _fill(f, memoryview(buf)) != n:
        raise CorruptBlock("truncated file")
    return buf
