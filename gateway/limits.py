"""API keys and their rate limits: `KEY=TENANT[:rpm=N][,tpm=N]`, its JSON form and the keys file.

A key names its tenant and, optionally, how many requests (`rpm`) and tokens (`tpm`) it
may use per window (a minute unless `rate_limit_window_s` says otherwise). A tenant's
budget is the sum of its keys' budgets. The counting lives in the store
(`cache_manager/ratelimits.py`), the enforcement in the gateway (`gateway/ratelimit.py`);
docs/limits.md has the whole design and the grammar.

Everything here rejects what it does not understand, with a message naming the part and
never repeating the input (any of it may be a piece of a key): an empty or non-ASCII key,
a tenant outside `TENANT_RULE`, an unknown option, a limit that is not a whole number from
1 to 10^12, an option or a key given twice. A key with no limits costs nothing at request
time.
"""

from __future__ import annotations

import hashlib
import json
import json.decoder
import logging
import os
import re
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

log = logging.getLogger(__name__)

MAX_LIMIT = 10**12
MAX_TENANT_CHARS = 256  # the manager's bound on a tenant name
MAX_KEY_CHARS = 4096
MAX_KEYS_FILE_BYTES = 16 * 2**20
OPTIONS = ("rpm", "tpm")
GRAMMAR = "KEY=TENANT[:rpm=N][,tpm=N]"
TENANT_RULE = "1 to 256 characters of A-Z a-z 0-9 . _ -, the first a letter or a digit"
DIGEST_PREFIX = "sha256:"
_DIGITS = re.compile(r"[0-9]+")
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_KEY = re.compile(r"[\x21-\x7e]+")  # printable ASCII without spaces: what a header carries
_DIGEST_KEY = re.compile(r"sha256:[0-9a-fA-F]{64}")

Limit = Annotated[StrictInt, Field(gt=0, le=MAX_LIMIT)]


class KeyPolicy(BaseModel):
    """What one API key is: its tenant and its limits per window (None: no limit)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str = Field(min_length=1, max_length=MAX_TENANT_CHARS)
    rpm: Limit | None = None
    tpm: Limit | None = None

    @field_validator("tenant")
    @classmethod
    def _safe_tenant(cls, tenant: str) -> str:
        if not _TENANT.fullmatch(tenant):
            raise ValueError(f"a tenant is {TENANT_RULE}")
        return tenant

    @property
    def limited(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    @classmethod
    def parse(cls, text: str) -> KeyPolicy:
        """`TENANT[:rpm=N][,tpm=N]` (the part after `KEY=`)."""
        tenant, colon, options = text.partition(":")
        if not tenant:
            raise ValueError(f"the tenant is empty (expected {GRAMMAR})")
        fields: dict[str, Any] = {"tenant": tenant}
        if colon:
            if not options:
                raise ValueError("nothing after ':' (expected rpm=N and/or tpm=N)")
            for option in options.split(","):
                name, eq, value = option.partition("=")
                name, value = name.strip(), value.strip()
                if name not in OPTIONS:
                    raise ValueError(
                        "an unknown option after ':' (the options are rpm=N and tpm=N)"
                    )
                if name in fields:
                    raise ValueError(f"{name} given twice")
                if not eq or len(value) > 13 or not _DIGITS.fullmatch(value):
                    raise ValueError(f"{name} {_LIMIT_RULE}")
                fields[name] = int(value)
        try:
            return cls(**fields)
        except ValidationError as exc:
            raise ValueError(_first_error(exc)) from None

    def spec(self) -> str:
        """The policy back in the flag's grammar (after `KEY=`)."""
        options = [f"{n}={v}" for n in OPTIONS if (v := getattr(self, n)) is not None]
        return self.tenant + (":" + ",".join(options) if options else "")


_LIMIT_RULE = f"must be a whole number from 1 to {MAX_LIMIT} (leave it out for no limit)"


def _first_error(exc: ValidationError) -> str:
    """A pydantic error as one line, without the input (`msg` never holds it)."""
    err = exc.errors(include_input=False, include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"])
    message = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] in ("greater_than", "less_than_equal"):
        message = _LIMIT_RULE
    return f"{where}: {message}" if where else message


def check_key(key: str) -> None:
    """A key as configured: printable ASCII, or `sha256:<hex>`, the SHA-256 of the key."""
    if not key:
        raise ValueError("the key is empty")
    if len(key) > MAX_KEY_CHARS:
        raise ValueError(f"the key is longer than {MAX_KEY_CHARS} characters")
    if not _KEY.fullmatch(key):
        raise ValueError(
            "the key has a space, a control character or a character outside ASCII "
            "(a key is printable ASCII without spaces, as a header carries it)"
        )
    if key.startswith(DIGEST_PREFIX) and not _DIGEST_KEY.fullmatch(key):
        raise ValueError(
            f"a key written {DIGEST_PREFIX}... must be {DIGEST_PREFIX!r} and the 64 hex "
            "digits of the key's SHA-256"
        )


def parse_key_spec(spec: str) -> tuple[str, KeyPolicy]:
    """`KEY=TENANT[:rpm=N][,tpm=N]`, as `--api-key` takes it.

    Unambiguous: a tenant holds neither '=' nor ':', and a key given this way no ':', so
    the first ':' starts the options and the last '=' before it ends the key (which may
    hold '=', as base64 padding does).
    """
    head, colon, options = spec.partition(":")
    key, eq, tenant = head.rpartition("=")
    if not eq:
        if "=" in spec:
            raise ValueError(
                f"expected {GRAMMAR}: no '=' before the first ':' (a key given with "
                "--api-key cannot hold ':'; put such a key in the keys file)"
            )
        raise ValueError(f"expected {GRAMMAR} (no '=' found)")
    check_key(key)
    return key, KeyPolicy.parse(tenant + colon + options)


def parse_key_specs(specs: list[str]) -> dict[str, KeyPolicy]:
    """Every `--api-key` of a command line; a key given twice is an error (which tenant?)."""
    return check_keys(parse_key_spec(spec) for spec in specs)


def check_keys(entries: Iterable[tuple[str, object]]) -> dict[str, KeyPolicy]:
    """Keys and their policies (`TENANT[:...]` strings, objects or `KeyPolicy`s), checked.

    An entry is named by its place (1, 2, ...), never by its key; the same key twice (also
    once as itself and once as its digest) is an error.
    """
    return dict(checked_keys(entries))


def checked_keys(entries: Iterable[tuple[str, object]]) -> Iterator[tuple[str, KeyPolicy]]:
    """`check_keys` one key at a time (its ValueError when the bad entry is reached): a
    reload keeps what it needs of each key, not 100,000 policy objects, which would cost
    the event loop garbage collections while it reads the file in a thread."""
    seen: dict[bytes, int] = {}
    for n, (key, value) in enumerate(entries, 1):
        try:
            check_key(key)
            policy = _policy(value)
        except ValueError as exc:
            raise ValueError(f"entry {n}: {exc}") from None
        digest = key_digest(key)
        if (first := seen.get(digest)) is not None:
            raise ValueError(f"a key is given twice (entries {first} and {n})")
        seen[digest] = n
        yield key, policy


def _policy(value: object) -> KeyPolicy:
    if isinstance(value, KeyPolicy):
        return value
    if isinstance(value, str):
        return KeyPolicy.parse(value)
    if isinstance(value, _JSONObject):
        value = value.unique()
    if isinstance(value, Mapping):
        try:
            return KeyPolicy.model_validate(dict(value))
        except ValidationError as exc:
            raise ValueError(_first_error(exc)) from None
    raise ValueError(
        'a key\'s value is a "TENANT[:rpm=N][,tpm=N]" string or a {"tenant", "rpm", "tpm"} object'
    )


class _JSONObject(list[tuple[str, Any]]):
    """A JSON object as its pairs in order (`object_pairs_hook`): a name given twice is
    seen before a dict would keep only its last value."""

    def unique(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for name, value in self:
            if name in found:
                raise ValueError("a field of the object is given twice")
            found[name] = value
        return found


def _loads(text: str | bytes) -> Any:
    """`json.loads` with `_JSONObject`s, the top-level object read pair by pair (json's
    own `JSONObject`, each key and value by its C scanner): parsed in one C call, a keys
    file of 100,000 keys would hold the GIL for a fifth of a second, and the gateway's
    event loop with it while a reload reads the file in a thread. Same answers, same
    errors."""
    if isinstance(text, bytes):
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    decoder = json.JSONDecoder(object_pairs_hook=_JSONObject)
    start = _JSON_SPACE.match(text, 0).end()  # type: ignore[union-attr]
    if not text.startswith("{", start):  # no object: json's own answer, or error
        return decoder.decode(text)
    doc, end = json.decoder.JSONObject(
        (text, start + 1), True, decoder.scan_once, None, _JSONObject, {}
    )
    end = _JSON_SPACE.match(text, end).end()  # type: ignore[union-attr]
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return doc


_JSON_SPACE = json.decoder.WHITESPACE


def parse_keys_json(text: str | bytes) -> dict[str, KeyPolicy]:
    """`{"<key>": "<tenant>[:rpm=N][,tpm=N]" | {"tenant", "rpm", "tpm"}, ...}`, checked."""
    return check_keys(_keys_object(text))


def _keys_object(text: str | bytes) -> _JSONObject:
    """The keys JSON's object, its values not yet checked."""
    try:
        doc = _loads(text)
    except json.JSONDecodeError as exc:  # its msg holds no input
        raise ValueError(
            f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except (ValueError, RecursionError):  # a number of thousands of digits, deep nesting
        raise ValueError("not valid JSON (a number too long or nesting too deep)") from None
    if not isinstance(doc, _JSONObject):
        raise ValueError('expected a JSON object {"<key>": "<tenant>[:rpm=N][,tpm=N]", ...}')
    return doc


def load_keys_file(path: Path) -> dict[str, KeyPolicy]:
    """The keys file (`CTX_GATEWAY_API_KEYS_FILE`): the JSON of `parse_keys_json`, at least
    one key. Every failure is a ValueError naming the file and what is wrong with it."""
    return dict(read_keys_file(path))


def read_keys_file(path: Path) -> Iterator[tuple[str, KeyPolicy]]:
    """`load_keys_file` one key at a time (as `checked_keys`); its ValueError when the
    fault is reached, so a reader must use none of the keys before the last."""
    where = f"keys file {str(path)!r}"
    try:
        # O_NONBLOCK: a FIFO given by mistake must not hang the open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{where}: not a regular file")
            check_keys_file_mode(where, st)
            data = f.read(MAX_KEYS_FILE_BYTES + 1)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"{where}: cannot read it ({reason})") from None
    if len(data) > MAX_KEYS_FILE_BYTES:
        raise ValueError(f"{where}: larger than {MAX_KEYS_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not UTF-8 text") from None
    n = 0
    try:
        for n, entry in enumerate(checked_keys(_keys_object(text)), 1):  # noqa: B007 (n)
            yield entry
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if not n:
        raise ValueError(f"{where}: names no key (a gateway without keys is open: give it none)")


def check_keys_file_mode(where: str, st: os.stat_result) -> None:
    """A keys file every user can write is refused, as sshd refuses such key files: anyone
    on the machine could give themselves a key. One its group can write is read, with a
    warning: a umask of 002 (Debian's and Ubuntu's for users with a group of their own)
    makes every file group-writable, and in a container the gateway cannot know who is in
    the file's group (docs/limits.md)."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        raise ValueError(
            f"{where}: every user can write it (mode {mode:04o}); refused, as sshd refuses "
            "such key files: make it writable by its owner only (chmod go-w)"
        )
    if mode & stat.S_IWGRP:
        log.warning(
            "%s: the members of group %d can write it (mode %04o): make it writable by its "
            "owner only (chmod g-w)",
            where,
            st.st_gid,
            mode,
        )


def key_digest(key: str) -> bytes:
    """The SHA-256 of a key as configured: its own, or the one `sha256:<hex>` gives."""
    if _DIGEST_KEY.fullmatch(key):
        return bytes.fromhex(key.removeprefix(DIGEST_PREFIX))
    return hashlib.sha256(key.encode()).digest()


def key_id(key: str) -> str:
    """The name a key's counters have in the store: never the key itself (whoever reads
    the store must not learn keys), short, one Redis Cluster hash tag per key. From the
    key's digest, so a key and its `sha256:` form share their counters."""
    return hashlib.sha256(b"ctxcache-rate-limit\0" + key_digest(key)).hexdigest()[:24]
