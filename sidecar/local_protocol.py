"""The local socket's messages: what `sidecar.local` (its lease table:
`sidecar.local_leases`) answers and `sidecar.local_client` sends and reads (`Slot`,
`lease_blocks`; `LocalError`, what the client raises when the socket is unreachable or
answers out of protocol). One JSON document per line each way (orjson at both ends),
answered in order.

Requests, and what they answer:
- `{"op": "hello", "client": token, "lock": bool}` -> `{"ok", "generation", "region",
  "size", "lease_timeout_s"}`; `client` (16 hex digits) names the engine's client across
  its connections, `lock` says it holds `client-<token>.lock` (`sidecar.arena_clients`)
- `{"op": "lease", "keys": [...]}` -> `{"ok", "lease": id, "blocks": [...]}`, a block being
  null (a miss), "tcp" (present but no slot could be had: GET it over lm://) or
  `{"offset", "length", "fmt", "dtype", "shape"}`. With `"columns": true` the same
  answer comes as columns, one entry per key (`lease_answer`): `"offsets"` (an offset,
  null or "tcp"), `"lengths"`, and `"heads"`, an index into `"headers"`, the distinct
  `[fmt, dtype, *shape]` of the blocks (a load's blocks share one). A sidecar from before
  it ignores the flag and answers `blocks`, so a client reads either form.
- `{"op": "release", "lease": id, "generation": g}` -> `{"ok": true}` only if the lease held
  until now: then every byte copied under it was the block's
- `{"op": "alloc", "lengths": [...]}` -> `{"ok", "lease": id, "offsets": [...]}`, or
  `{"ok": false, "error": "full"}`
- `{"op": "commit", "lease": id, "generation": g, "blocks": [{"key", "fmt", "dtype",
  "shape"} or null]}` -> `{"ok", "stored": n}`: the allocated slots become blocks (null:
  the slot is given up); `ok: false` and `stored: 0` if the lease had ended. Read, it
  ends the lease's write, stored or not; refused as a bad request (an `error` that
  begins `bad request`: a key over 150 bytes of UTF-8, a field out of range, not one block
  per slot) it changes nothing, and the lease stays open for a commit or an abort
- `{"op": "abort", "lease": id, "generation": g}` -> `{"ok"}`: the writer is done with
  the slots and stores nothing
- `{"op": "exists", "keys": [...]}` -> `{"ok", "found": [...]}`

Any request may also carry **`"release": [{"lease": id, "generation": g}, ...]`**, read
leases the client is done with (at most `MAX_LEASES`): they are released first, before the
request itself, as if each had been its own `release` (their answers are not sent back;
the reply says how many held, `"released": n`). A list that is not well formed refuses the
whole request and releases nothing. `hello` answers `"release_batch": true` when this is
understood (a client never piggybacks on a sidecar that does not say so).

Any request may carry `"trace": {"traceparent": ...}` (the engine's span, tracing on): the
sidecar's span of it (`sidecar local <op>`, with the bytes and blocks) joins that trace.
A request that is not one of these (NaN, nesting past 1,024 levels, wrong types) gets
`{"ok": false, "error"}`, never a closed connection.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path
from typing import Any, NamedTuple

from sidecar.blocks import BlockMeta
from sidecar.protocol import MAX_KEY_LENGTH, Shape

MAX_LINE = 1 << 20  # a request line longer than this closes the connection
MAX_KEYS = 4096  # keys or slots in one request
MAX_LEASES = 256  # leases one client may hold at once
INT32 = 2**31 - 1  # fmt, dtype and shape are int32 in lm:// and in the disk header
TOKEN = re.compile(r"[0-9a-f]{16}")
TCP = "tcp"  # a lease answer's block: present, but read it over lm://

try:  # (a dependency of ctxcache; the GPU check's machine has torch and a few wheels only)
    import orjson
except ModuleNotFoundError:  # (then the standard library: tests/sidecar/test_local_wire.py)
    orjson = None  # type: ignore[assignment]

Placed = tuple[BlockMeta, int] | bool | None  # a block and its offset, False (tcp), None


class Slot(NamedTuple):
    """Where a leased block (or an allocated slot) lies in the region, and its header. (A
    named tuple: a 2,048-key lease makes 2,048 of them, in 0.5 ms here; as the frozen dataclass
    it was, 1.25 ms.)"""

    offset: int
    length: int
    fmt: int = 0
    dtype: int = 0
    shape: Shape = (0, 0, 0, 0)


class LocalError(ConnectionError):
    """The local socket is unreachable or answered out of protocol."""


def encode(message: dict[str, Any]) -> bytes:
    """One message, as its line (orjson: a 2,048-key lease's request and answer encode in
    0.07 ms, the standard library's json takes 0.9 ms)."""
    if orjson is not None:
        return orjson.dumps(message, option=orjson.OPT_APPEND_NEWLINE)
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """One line's message; ValueError (or RecursionError) when it is not one: NaN,
    Infinity, invalid UTF-8 and nesting past 1,024 levels are refused."""
    if orjson is not None:
        message = orjson.loads(line)
    else:
        message = json.loads(line, parse_constant=_no_constant)
    if not isinstance(message, dict):
        raise ValueError("not an object")
    return message


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def lease_answer(placed: list[Placed], *, columns: bool) -> dict[str, Any]:
    """A lease answer's blocks, one per key, in the form the request asked for."""
    if not columns:
        return {"blocks": [_block(p) for p in placed]}
    offsets: list[int | str | None] = []
    lengths: list[int] = []
    heads: list[int] = []
    headers: list[list[int]] = []
    index: dict[tuple[int, int, tuple[int, ...]], int] = {}
    for p in placed:
        if not p:
            offsets.append(TCP if p is False else None)
            lengths.append(0)
            heads.append(0)
            continue
        meta, offset = p  # type: ignore[misc]
        head = (meta.fmt, meta.dtype, meta.shape)
        i = index.get(head)
        if i is None:
            i = index[head] = len(headers)
            headers.append([meta.fmt, meta.dtype, *meta.shape])
        offsets.append(offset)
        lengths.append(meta.length)
        heads.append(i)
    return {"offsets": offsets, "lengths": lengths, "heads": heads, "headers": headers}


def lease_blocks(reply: dict[str, Any]) -> list[Slot | str | None]:
    """(The client's end of `lease_answer`.) A lease answer's blocks, per key, from either
    of its forms: the columns it asks for, or `blocks` from a sidecar that predates them."""
    if "blocks" in reply:
        return [
            Slot(b["offset"], b["length"], b["fmt"], b["dtype"], tuple(b["shape"]))  # type: ignore[arg-type]
            if isinstance(b, dict)
            else (TCP if b == TCP else None)
            for b in reply["blocks"]
        ]
    headers = [(h[0], h[1], tuple(h[2:])) for h in reply["headers"]]
    blocks: list[Slot | str | None] = []
    for at, n, head in zip(reply["offsets"], reply["lengths"], reply["heads"], strict=True):
        if type(at) is int:
            fmt, dtype, shape = headers[head]
            blocks.append(Slot(at, n, fmt, dtype, shape))  # type: ignore[arg-type]
        else:
            blocks.append(TCP if at == TCP else None)
    return blocks


def _block(p: Placed) -> dict[str, Any] | str | None:
    if not p:
        return TCP if p is False else None
    meta, offset = p  # type: ignore[misc]
    return {
        "offset": offset,
        "length": meta.length,
        "fmt": meta.fmt,
        "dtype": meta.dtype,
        "shape": list(meta.shape),
    }


def checked_meta(m: object) -> tuple[str, int, int, tuple[int, int, int, int]]:
    """A committed block's header, refused unless lm:// and the disk header can hold it."""
    if not isinstance(m, dict):
        raise TypeError("block")
    key, fmt, dtype, shape = m["key"], m["fmt"], m["dtype"], m["shape"]
    if not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY_LENGTH:
        raise ValueError("key")
    if not isinstance(shape, list) or len(shape) != 4:
        raise ValueError("shape")
    for x in (fmt, dtype, *shape):
        if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= INT32:
            raise ValueError("fmt, dtype or shape out of range")
    return key, fmt, dtype, (shape[0], shape[1], shape[2], shape[3])


def release_list(value: object) -> list[dict[str, Any]]:
    """A request's `release` list, checked whole before any of it is acted on."""
    if not isinstance(value, list) or len(value) > MAX_LEASES:
        raise ValueError("release")
    for entry in value:
        if not isinstance(entry, dict):
            raise TypeError("release")
        lease, gen = entry.get("lease"), entry.get("generation")
        if not isinstance(lease, int) or isinstance(lease, bool):
            raise TypeError("release: lease")
        if gen is not None and not isinstance(gen, str):
            raise TypeError("release: generation")
    return value


def open_socket(path: Path, timeout: float) -> socket.socket:
    """(The client's.) A connection to the sidecar's socket at `path`. A full accept
    queue (a burst of connections) answers EAGAIN on a Unix socket at once: tried again
    until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
            return sock
        except BlockingIOError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
        except OSError:
            sock.close()
            raise


def client_number(token: str) -> int:
    return int(token, 16) if TOKEN.fullmatch(token) else 0


def strings(value: object) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_KEYS:
        raise ValueError("keys")
    if not all(isinstance(k, str) for k in value):
        raise TypeError("keys")
    return value
