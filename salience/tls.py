"""TLS on every port: the server's certificate (reloaded on SIGHUP) with optional mutual TLS, and
the contexts and credentials a client builds from its CA and its own certificate.

One set of PEM files serves the WebSocket and HTTP port, LMTP over TCP, the metrics port and
gRPC. The asyncio ports share one `ssl.SSLContext`: a reload loads the new chain into it, and
OpenSSL copies a context's certificate into each connection at its handshake, so new
connections get the new certificate and open ones keep theirs. gRPC asks a fetcher for its
configuration at each handshake (`grpc.dynamic_ssl_server_credentials`), which a reload swaps.

An encrypted key needs its password from a file (`--tls-key-password-file`): OpenSSL gets it
through a callback, so it never asks the terminal, and gRPC, which takes no password, gets the
key decrypted in memory. Without a password an encrypted key is refused before anything loads.
"""

from __future__ import annotations

import datetime
import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from salience.errors import InvalidArgument

__all__ = ["ClientTls", "ServerTls", "TlsFiles"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    """The server's PEM files: its certificate chain, its key, the CA its clients' certificates
    must chain to (None: clients present none), and a file whose first line is the key's password
    (None: the key is unencrypted)."""

    cert: Path
    key: Path
    client_ca: Path | None = None
    key_password: Path | None = None


@dataclass(frozen=True)
class _Pem:
    cert: bytes
    key: bytes  # unencrypted, for gRPC
    client_ca: bytes | None
    password: bytes  # the key's, for OpenSSL, which reads it from its file (b"": unencrypted)

    def password_callback(self) -> bytes:
        """OpenSSL's question for an encrypted key's password, which without this callback it
        would ask the terminal."""
        return self.password


class ServerTls:
    """The server side, checked at start; `reload` re-reads the files (SIGHUP)."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._pem = _read(files)
        self.context = _server_context(files, self._pem)
        self._lock = threading.Lock()  # gRPC's fetcher runs on gRPC's threads
        self._generation = 0
        self._fetched = 0

    @property
    def mutual(self) -> bool:
        return self.files.client_ca is not None

    def reload(self) -> bool:
        """Read the files again and serve them to new connections; on any fault keep serving the
        old ones and log why. Whether the new files are in place."""
        try:
            pem = _read(self.files)
            _server_context(self.files, pem)  # every check, before anything changes
        except InvalidArgument as exc:
            log.error("tls reload failed; still serving the old certificate", extra={"reason": str(exc)})
            return False
        self.context.load_cert_chain(self.files.cert, self.files.key, password=pem.password_callback)
        if self.files.client_ca is not None:
            # OpenSSL's trust store only grows: a CA added to the file is trusted at once, one
            # removed from it stays trusted on these ports until a restart (gRPC's is replaced).
            self.context.load_verify_locations(self.files.client_ca)
        with self._lock:
            self._pem = pem
            self._generation += 1
        log.info("tls reloaded", extra={"cert": str(self.files.cert), "not_after": _not_after(pem.cert).isoformat()})
        return True

    def grpc_credentials(self) -> grpc.ServerCredentials:
        with self._lock:
            initial = self._grpc_config(self._pem)
        return grpc.dynamic_ssl_server_credentials(initial, self._fetch, require_client_authentication=self.mutual)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's question at each handshake: a new configuration, or None to keep the last."""
        with self._lock:
            if self._fetched == self._generation:
                return None
            self._fetched = self._generation
            return self._grpc_config(self._pem)

    @staticmethod
    def _grpc_config(pem: _Pem) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(pem.key, pem.cert)], root_certificates=pem.client_ca)


@dataclass(frozen=True)
class ClientTls:
    """A client's side: the CA to trust (None: the system's) and, for mutual TLS, its own
    certificate and key."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise InvalidArgument("a client certificate needs its key: give --cert and --key together")
        if self.key is not None and _encrypted(_bytes(self.key, "--key"), f"--key {self.key}"):
            raise InvalidArgument(f"--key {self.key}: the key is encrypted; a client takes an unencrypted key")

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca)
        if self.cert is not None:
            context.load_cert_chain(self.cert, self.key, password=_no_password)
        return context

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_bytes(self.ca, "--ca"),
            private_key=_bytes(self.key, "--key"),
            certificate_chain=_bytes(self.cert, "--cert"),
        )


def _read(files: TlsFiles) -> _Pem:
    password = _password(files)
    return _Pem(
        cert=_bytes(files.cert, "--tls-cert"),
        key=_server_key(files, password),
        client_ca=_bytes(files.client_ca, "--tls-client-ca"),
        password=password or b"",
    )


def _password(files: TlsFiles) -> bytes | None:
    """The first line of --tls-key-password-file, without its line break (None without the flag)."""
    text = _bytes(files.key_password, "--tls-key-password-file")
    if text is None:
        return None
    password = text.splitlines()[0] if text else b""
    if not password:
        raise InvalidArgument(
            f"--tls-key {files.key}: --tls-key-password-file {files.key_password} has no password on its first line"
        )
    return password


def _server_key(files: TlsFiles, password: bytes | None) -> bytes:
    """The key as gRPC takes it, unencrypted PEM: as it is, or decrypted in memory."""
    from cryptography.hazmat.primitives import serialization

    pem = _bytes(files.key, "--tls-key")
    if not _encrypted(pem, f"--tls-key {files.key}"):
        return pem  # a password, if given, is not needed
    if password is None:
        raise InvalidArgument(
            f"--tls-key {files.key}: the key is encrypted; give its password with --tls-key-password-file FILE"
        )
    try:
        key = serialization.load_pem_private_key(pem, password=password)
    except ValueError:
        raise InvalidArgument(
            f"--tls-key {files.key}: the password in --tls-key-password-file {files.key_password} does not decrypt it"
        ) from None
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _encrypted(pem: bytes, named: str) -> bool:
    """Whether a PEM private key is encrypted (`named`: its flag and file, for the error if it is
    no key at all)."""
    from cryptography.hazmat.primitives import serialization

    try:
        serialization.load_pem_private_key(pem, password=None)
    except TypeError:  # cryptography's word for "encrypted, and no password given"
        return True
    except ValueError:
        raise InvalidArgument(f"{named}: not a PEM private key") from None
    return False


def _no_password() -> bytes:
    """OpenSSL's question for the password of a key that was unencrypted when checked: none, so it
    fails rather than asks the terminal."""
    return b""


def _bytes(path: Path | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None


def _server_context(files: TlsFiles, pem: _Pem) -> ssl.SSLContext:
    """The asyncio ports' context, after every check a start makes, each failing with one line
    (`pem`: the files as just read; OpenSSL reads the key pair and the CAs from their paths)."""
    if b"-----BEGIN CERTIFICATE-----" not in pem.cert:
        raise InvalidArgument(f"--tls-cert {files.cert}: not a PEM certificate")
    expiry = _not_after(pem.cert)
    if expiry <= datetime.datetime.now(datetime.UTC):
        raise InvalidArgument(f"--tls-cert {files.cert}: the certificate expired on {expiry:%Y-%m-%d %H:%M} UTC")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(files.cert, files.key, password=pem.password_callback)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise InvalidArgument(f"--tls-key {files.key} does not match --tls-cert {files.cert}") from None
        raise InvalidArgument(f"--tls-key {files.key}: not a PEM private key for it ({exc.reason})") from None
    if files.client_ca is not None:
        try:
            context.load_verify_locations(files.client_ca)
        except ssl.SSLError as exc:
            raise InvalidArgument(f"--tls-client-ca {files.client_ca}: not PEM certificates ({exc.reason})") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _not_after(pem: bytes) -> datetime.datetime:
    """The (first) certificate's expiry."""
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificate(pem).not_valid_after_utc
    except ValueError as exc:
        raise InvalidArgument(f"--tls-cert: the certificate does not parse ({exc})") from None
