"""The tokens file (`--tokens FILE`): TOML, one `[[client]]` table per client, holding the hash of
its token (never the token), its scopes and its limits. `salience tokens add` appends a client and
prints its new token once; an operator may edit the file by hand, and SIGHUP reloads it.

    [[client]]
    name = "alice"
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    scopes = ["generate", "score", "readouts"]
    max_streams = 8          # optional limits; absent: none
    max_sessions = 4
    tokens_per_minute = 20000
    weight = 1.0             # optional share of the engine under contention (default 1)
"""

from __future__ import annotations

import json
import os
import re
import secrets
import tomllib
from pathlib import Path
from typing import Any

from salience.auth import SCOPES, Client, ClientLimits, token_digest
from salience.errors import InvalidArgument

__all__ = ["add_client", "load_token_file"]

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a log field and a metrics label as it is
_LIMITS = {"max_streams": "streams", "max_sessions": "sessions", "tokens_per_minute": "tokens_per_minute"}
_FIELDS = ("name", "sha256", "scopes", *_LIMITS, "weight")
_RESERVED = {"anonymous": "an open server's clients", "token": "--auth-token", "admin": "--admin-token"}


def load_token_file(path: Path) -> list[tuple[bytes, Client]]:
    """Each client with its token's digest, or InvalidArgument naming the file, the entry and the field."""
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidArgument(f"--tokens {path}: cannot read it ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"--tokens {path}: not TOML ({exc})") from None
    unknown = sorted(set(document) - {"client"})
    if unknown:
        raise InvalidArgument(f"--tokens {path}: unknown table {unknown[0]!r}; clients are [[client]] tables")
    entries = document.get("client", [])
    if not isinstance(entries, list):
        raise InvalidArgument(f"--tokens {path}: client must be an array of tables, [[client]]")
    clients: list[tuple[bytes, Client]] = []
    for i, entry in enumerate(entries):
        where = f"--tokens {path}: client {i + 1}"
        digest, client = _client(entry, where)
        if any(known.name == client.name for _, known in clients):
            raise InvalidArgument(f"{where}: the name {client.name!r} is taken by an earlier client")
        if any(known == digest for known, _ in clients):
            raise InvalidArgument(f"{where} ({client.name}): the same token as an earlier client")
        clients.append((digest, client))
    return clients


def _client(entry: Any, where: str) -> tuple[bytes, Client]:
    if not isinstance(entry, dict):
        raise InvalidArgument(f"{where}: must be a table")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument(f"{where}: name must be 1 to 64 of A-Z a-z 0-9 . _ -")
    where = f"{where} ({name})"
    if name in _RESERVED:
        raise InvalidArgument(f"{where}: the name is reserved for {_RESERVED[name]}")
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise InvalidArgument(f"{where}: unknown field {unknown[0]!r}; known: {', '.join(_FIELDS)}")
    digest = entry.get("sha256")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise InvalidArgument(f"{where}: sha256 must be the token's SHA-256, 64 lowercase hex digits")
    scopes = entry.get("scopes")
    if not isinstance(scopes, list) or not scopes or not all(isinstance(s, str) for s in scopes):
        raise InvalidArgument(f"{where}: scopes must be a non-empty list, among {', '.join(SCOPES)}")
    bad = next((s for s in scopes if s not in SCOPES), None)
    if bad is not None:
        raise InvalidArgument(f"{where}: unknown scope {bad!r}; scopes are {', '.join(SCOPES)}")
    limits = {}
    for key, attribute in _LIMITS.items():
        value = entry.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InvalidArgument(f"{where}: {key} must be a positive integer")
        limits[attribute] = value
    weight = entry.get("weight", 1.0)
    if not isinstance(weight, int | float) or isinstance(weight, bool) or not 0 < weight <= 1000:
        raise InvalidArgument(f"{where}: weight must be a number in (0, 1000]")
    client = Client(name=name, scopes=frozenset(scopes), limits=ClientLimits(**limits), weight=float(weight))
    return bytes.fromhex(digest), client


def add_client(
    path: Path, name: str, scopes: list[str], limits: ClientLimits | None = None, weight: float = 1.0
) -> str:
    """Append a client to the file (made, readable by its owner only, if it does not exist) and
    return its new token, which is written nowhere."""
    token = secrets.token_urlsafe(32)
    entry: dict[str, Any] = {"name": name, "sha256": token_digest(token).hex(), "scopes": scopes}
    limits = limits or ClientLimits()
    entry |= {key: getattr(limits, attr) for key, attr in _LIMITS.items() if getattr(limits, attr) is not None}
    if weight != 1.0:
        entry["weight"] = weight
    _client(entry, "salience tokens add")  # the checks a load makes, before anything is written
    text = "\n[[client]]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in entry.items())
    existing = load_token_file(path) if path.exists() else []
    if any(client.name == name for _, client in existing):
        raise InvalidArgument(f"{path} already has a client named {name!r}")
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(descriptor, "a", encoding="utf-8") as out:
        out.write(text)  # JSON's strings, lists and numbers are TOML's, for these values
    return token
