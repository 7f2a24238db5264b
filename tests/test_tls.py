"""TLS on every port, with certificates the test makes (trustme): the WebSocket and HTTP port, LMTP
over TCP and gRPC each complete a handshake with a client that trusts the CA and get an answer;
plain text to a TLS port is refused; mutual TLS refuses a client without a certificate (or with
one from another CA); a bad file stops the start with one line, an encrypted key without its
password too, at once, even from a terminal where OpenSSL would ask for it; a password file opens
an encrypted key for every port and on reload; and a certificate replaced on disk (with an
encrypted key and a new password) is served to new connections after SIGHUP while a stream on the
old one runs on (then the same server is stopped by two SIGTERMs, test_drain.py's last case)."""

from __future__ import annotations

import asyncio
import datetime
import fcntl
import json
import os
import signal
import socket
import ssl
import subprocess
import termios
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
import pytest_asyncio
import trustme
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc

from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import ServerStatus
from salience.errors import InvalidArgument
from salience.evals.provider import SalienceAPI
from salience.grpc_frontend.server import start_grpc_server
from salience.http_app import make_app
from salience.lmtp.client import LmtpClient
from salience.lmtp.session import LmtpConfig
from salience.lmtp.tcp import start_tcp_server
from salience.tls import ClientTls, ServerTls, TlsFiles
from tests.conftest import free_port
from tests.process_group import left_in_group
from tests.test_serve import SALIENCE


@dataclass
class Pki:
    """A server CA with the server's certificate, and a client CA with a client's."""

    server: TlsFiles
    ca: Path
    client: ClientTls  # trusts `ca`, presents a certificate the client CA signed
    stranger: ClientTls  # trusts `ca`, presents a certificate from a CA the server does not know


def write_leaf(leaf: trustme.LeafCert, folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key))
    return cert, key


def encrypt(key: Path, password: str, *, pkcs8: bool = True) -> Path:
    """Encrypt the key in its file with `password` (PKCS#8, or OpenSSL's traditional PEM with its
    Proc-Type header); `password` and a line break go to a file beside it, whose path is returned."""
    private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    layout = serialization.PrivateFormat.PKCS8 if pkcs8 else serialization.PrivateFormat.TraditionalOpenSSL
    encryption = serialization.BestAvailableEncryption(password.encode())
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, layout, encryption))
    password_file = key.with_suffix(".pass")
    password_file.write_text(f"{password}\n")
    return password_file


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    server_ca, client_ca, other_ca = trustme.CA(), trustme.CA(), trustme.CA()
    cert, key = write_leaf(server_ca.issue_cert("127.0.0.1", "localhost"), tmp_path, "server")
    ca, client_ca_file = tmp_path / "ca.pem", tmp_path / "client-ca.pem"
    server_ca.cert_pem.write_to_path(str(ca))
    client_ca.cert_pem.write_to_path(str(client_ca_file))
    client_cert, client_key = write_leaf(client_ca.issue_cert("alice@example.org"), tmp_path, "alice")
    other_cert, other_key = write_leaf(other_ca.issue_cert("mallory@example.org"), tmp_path, "mallory")
    return Pki(
        server=TlsFiles(cert=cert, key=key, client_ca=client_ca_file),
        ca=ca,
        client=ClientTls(ca=ca, cert=client_cert, key=client_key),
        stranger=ClientTls(ca=ca, cert=other_cert, key=other_key),
    )


@dataclass
class Ports:
    http: int
    tcp: int
    grpc: int


@pytest_asyncio.fixture(params=["tls", "mutual"])
async def served(request: pytest.FixtureRequest, pki: Pki) -> AsyncIterator[tuple[Ports, bool]]:
    """Every frontend behind TLS, on a server still loading its model (which each port answers)."""
    mutual = request.param == "mutual"
    files = pki.server if mutual else TlsFiles(cert=pki.server.cert, key=pki.server.key)
    tls = ServerTls(files)
    status = ServerStatus("tiny")
    sessions = SessionStore(status.serving_engine)
    runner = web.AppRunner(make_app(status, LmtpConfig(), sessions))
    await runner.setup()
    ports = Ports(http=free_port(), tcp=free_port(), grpc=0)
    await web.TCPSite(runner, "127.0.0.1", ports.http, ssl_context=tls.context).start()
    tcp = await start_tcp_server(status, LmtpConfig(), sessions, "127.0.0.1", ports.tcp, tls.context)
    server = await start_grpc_server(status, sessions, "127.0.0.1", 0, credentials=tls.grpc_credentials())
    ports.grpc = server.port
    try:
        yield ports, mutual
    finally:
        await server.stop(0)
        tcp.close()
        await runner.cleanup()


async def health(port: int, context: ssl.SSLContext | bool) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(f"https://127.0.0.1:{port}/health", ssl=context) as reply:
        return reply.status, await reply.json()


async def model_info_over_tcp(port: int, context: ssl.SSLContext) -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname="127.0.0.1")
    try:
        writer.write(b'MODEL_INFO {"stream_id": 1}\n')
        line = await asyncio.wait_for(reader.readline(), 10)
        return json.loads(line.decode().partition(" ")[2])[0]
    finally:
        writer.close()


def grpc_health(port: int, credentials: grpc.ChannelCredentials | None) -> int:
    target = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(target) if credentials is None else grpc.secure_channel(target, credentials)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


async def test_every_port_answers_a_client_that_trusts_the_ca(served, pki: Pki) -> None:
    ports, mutual = served
    client = pki.client if mutual else ClientTls(ca=pki.ca)
    context = client.context()
    assert await health(ports.http, context) == (503, {"status": "loading", "model": "tiny"})
    lmtp = await LmtpClient.connect(f"wss://127.0.0.1:{ports.http}/", tls=context)
    try:
        assert (await lmtp.request("MODEL_INFO"))["model_info"] == "<unavailable>"  # while loading
    finally:
        await lmtp.close()
    assert (await model_info_over_tcp(ports.tcp, context))["model_info"] == "<unavailable>"
    status = await asyncio.to_thread(grpc_health, ports.grpc, client.grpc_credentials())
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_plain_text_to_a_tls_port_is_refused(served) -> None:
    ports, _ = served
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientError):
            await http.get(f"http://127.0.0.1:{ports.http}/health")
    reader, writer = await asyncio.open_connection("127.0.0.1", ports.tcp)
    writer.write(b'MODEL_INFO {"stream_id": 1}\n')
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing in clear text
    writer.close()
    with pytest.raises(grpc.RpcError) as refused:
        await asyncio.to_thread(grpc_health, ports.grpc, None)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_a_client_that_does_not_trust_the_ca_refuses_the_server(served) -> None:
    ports, _ = served
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await health(ports.http, ssl.create_default_context())


@pytest.mark.parametrize("served", ["mutual"], indirect=True)
@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate"])
async def test_mutual_tls_refuses_a_client_without_a_certificate_it_trusts(served, pki: Pki, who: str) -> None:
    ports, _ = served
    client = ClientTls(ca=pki.ca) if who == "no certificate" else pki.stranger
    context = client.context()
    with pytest.raises((aiohttp.ClientError, ssl.SSLError, ConnectionError)):
        await health(ports.http, context)
    with pytest.raises((ssl.SSLError, ConnectionError, json.JSONDecodeError, asyncio.IncompleteReadError)):
        await model_info_over_tcp(ports.tcp, context)
    with pytest.raises(grpc.RpcError) as refused:
        await asyncio.to_thread(grpc_health, ports.grpc, client.grpc_credentials())
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_the_inspect_provider_trusts_the_ca_and_shows_the_certificate_it_is_given(served, pki: Pki) -> None:
    ports, mutual = served
    url = f"https://127.0.0.1:{ports.http}/v1"
    own = {"cert_file": str(pki.client.cert), "key_file": str(pki.client.key)} if mutual else {}
    trusting = SalienceAPI("tiny", base_url=url, max_retries=0, ca_file=str(pki.ca), **own)
    stranger = SalienceAPI("tiny", base_url=url, max_retries=0)  # the system's CAs only
    try:
        with pytest.raises(openai.APIStatusError) as answered:
            await trusting.client.models.list()
        assert answered.value.status_code == 503  # past the handshake: the server answers, still loading
        with pytest.raises(openai.APIConnectionError):
            await stranger.client.models.list()
    finally:
        await trusting.aclose()
        await stranger.aclose()


def serve_line(*flags: str) -> str:
    """`salience serve` with these flags: the one line it stops with (before any model loads)."""
    result = subprocess.run([SALIENCE, "serve", *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_bad_file_stops_the_start_with_one_line(tmp_path: Path, pki: Pki) -> None:
    _, other_key = write_leaf(trustme.CA().issue_cert("127.0.0.1"), tmp_path, "other")
    cert, key = str(pki.server.cert), str(pki.server.key)
    yesterday = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)
    old = trustme.CA().issue_cert("127.0.0.1", not_before=yesterday - datetime.timedelta(days=30), not_after=yesterday)
    old_cert, old_key = write_leaf(old, tmp_path, "old")
    locked_cert, locked_key = write_leaf(trustme.CA().issue_cert("127.0.0.1"), tmp_path, "locked")
    right = encrypt(locked_key, "open sesame")
    wrong, empty = tmp_path / "wrong.pass", tmp_path / "empty.pass"
    wrong.write_text("open sesame \n")  # the first line is the password, to its last space
    empty.write_text("\nopen sesame\n")
    locked = ("--tls-cert", str(locked_cert), "--tls-key", str(locked_key), "--tls-key-password-file")
    cases = {
        ("--tls-cert", cert, "--tls-key", str(other_key)): f"--tls-key {other_key} does not match --tls-cert {cert}",
        (
            "--tls-cert",
            cert,
            "--tls-key",
            str(tmp_path / "gone.key"),
        ): f"--tls-key {tmp_path / 'gone.key'}: cannot read",
        ("--tls-cert", str(old_cert), "--tls-key", str(old_key)): "the certificate expired on",
        ("--tls-cert", str(key), "--tls-key", key): "not a PEM certificate",
        ("--tls-cert", cert, "--tls-key", cert): f"--tls-key {cert}: not a PEM private key",
        (*locked, str(wrong)): f"--tls-key {locked_key}: the password in --tls-key-password-file {wrong} does not "
        "decrypt it",
        (*locked, str(empty)): f"--tls-key {locked_key}: --tls-key-password-file {empty} has no password on its "
        "first line",
        (*locked, str(tmp_path / "gone.pass")): f"--tls-key-password-file {tmp_path / 'gone.pass'}: cannot read",
        ("--tls-key-password-file", str(right)): "--tls-key-password-file needs --tls-cert and --tls-key",
        ("--tls-cert", cert): "--tls-cert and --tls-key go together",
        ("--tls-client-ca", cert): "--tls-client-ca needs --tls-cert and --tls-key",
    }
    for flags, message in cases.items():
        line = serve_line(*flags)
        assert line.startswith("salience: error: ") and message in line, line


def test_an_encrypted_key_without_its_password_stops_the_start_at_once_from_a_terminal(
    tmp_path: Path, pki: Pki
) -> None:
    """Started from a terminal, OpenSSL asks it for the key's pass phrase and waits: `salience
    serve` must refuse instead, before it looks at the model (a folder that does not exist)."""
    encrypt(pki.server.key, "open sesame")
    command = [SALIENCE, "serve", "--model", str(tmp_path / "no-model")]
    command += ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    terminal, its_end = os.openpty()
    try:
        result = subprocess.run(
            command,
            stdin=its_end,
            capture_output=True,
            text=True,
            timeout=60,
            start_new_session=True,
            preexec_fn=take_stdin_as_controlling_terminal,
        )
        shown = terminal_output(terminal)
    except subprocess.TimeoutExpired:
        pytest.fail(f"salience serve waited on its terminal, which shows {terminal_output(terminal)!r}")
    finally:
        os.close(its_end)
        os.close(terminal)
    assert result.returncode == 2, result.stderr
    message = f"--tls-key {pki.server.key}: the key is encrypted; give its password with --tls-key-password-file FILE"
    assert result.stderr.splitlines() == [f"salience: error: {message}"]
    assert "pass phrase" not in shown + result.stdout, shown


def take_stdin_as_controlling_terminal() -> None:
    """In the child, a session leader: its stdin, a pseudo-terminal, becomes the /dev/tty that
    OpenSSL's prompt writes to and reads from."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def terminal_output(terminal: int) -> str:
    """What the child wrote to its terminal so far."""
    os.set_blocking(terminal, False)
    try:
        return os.read(terminal, 4096).decode(errors="replace")
    except BlockingIOError:
        return ""


@pytest.mark.parametrize("pkcs8", [True, False], ids=["pkcs8", "traditional"])
async def test_a_password_file_opens_an_encrypted_key_for_every_port_and_on_reload(
    tmp_path: Path, pki: Pki, pkcs8: bool
) -> None:
    """The asyncio ports' context and gRPC (which takes the key decrypted in memory) both serve
    the certificate of an encrypted key; a reload reads the password file again, keeping the old
    certificate while the password is wrong for the new key and serving the new one once it is
    right."""
    password = encrypt(pki.server.key, "first", pkcs8=pkcs8)
    tls = ServerTls(TlsFiles(cert=pki.server.cert, key=pki.server.key, key_password=password))
    status = ServerStatus("tiny")
    grpc_server = await start_grpc_server(
        status, SessionStore(status.serving_engine), "127.0.0.1", 0, credentials=tls.grpc_credentials()
    )
    server = await asyncio.start_server(lambda _, writer: writer.close(), "127.0.0.1", 0, ssl=tls.context)
    port = server.sockets[0].getsockname()[1]

    async def answers(ca: Path) -> bytes:
        """The certificate the asyncio port serves, after gRPC answered a client trusting `ca`."""
        credentials = ClientTls(ca=ca).grpc_credentials()
        assert (
            await asyncio.to_thread(grpc_health, grpc_server.port, credentials)
            == health_pb2.HealthCheckResponse.NOT_SERVING
        )
        return await asyncio.to_thread(served_certificate, port, ca)

    try:
        first = await answers(pki.ca)
        rotated = trustme.CA()
        rotated_ca = tmp_path / "rotated-ca.pem"
        rotated.cert_pem.write_to_path(str(rotated_ca))
        cert, key = write_leaf(rotated.issue_cert("127.0.0.1"), tmp_path, "rotated")
        encrypt(key, "second", pkcs8=pkcs8)
        pki.server.cert.write_bytes(cert.read_bytes())
        pki.server.key.write_bytes(key.read_bytes())
        assert not tls.reload()  # the password file still holds "first"
        assert await answers(pki.ca) == first
        password.write_text("second\n")
        assert tls.reload()
        assert await answers(rotated_ca) != first
    finally:
        server.close()
        await grpc_server.stop(0)


def test_a_wrong_password_or_an_encrypted_client_key_is_refused_in_one_line(tmp_path: Path, pki: Pki) -> None:
    password = encrypt(pki.server.key, "right")
    password.write_text("wrong\n")
    with pytest.raises(InvalidArgument) as refused:
        ServerTls(TlsFiles(cert=pki.server.cert, key=pki.server.key, key_password=password))
    assert str(refused.value) == (
        f"--tls-key {pki.server.key}: the password in --tls-key-password-file {password} does not decrypt it"
    )
    client_key = pki.client.key
    assert client_key is not None
    encrypt(client_key, "secret")
    with pytest.raises(InvalidArgument) as refused:
        ClientTls(ca=pki.ca, cert=pki.client.cert, key=client_key)
    assert str(refused.value) == f"--key {client_key}: the key is encrypted; a client takes an unencrypted key"


def served_certificate(port: int, ca: Path) -> bytes:
    """The certificate a new connection gets (the handshake fails unless `ca` signed it)."""
    context = ssl.create_default_context(cafile=ca)
    with (
        socket.create_connection(("127.0.0.1", port)) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as s,
    ):
        return s.getpeercert(binary_form=True)


async def test_sighup_serves_a_new_certificate_while_a_stream_runs_on(
    tiny_model: Path, tmp_path: Path, pki: Pki
) -> None:
    """A real `salience serve`, its key encrypted: a stream opened on the first certificate runs
    to its last token across the reload, and every connection after SIGHUP gets the second, whose
    key has a new password."""
    password = encrypt(pki.server.key, "first")
    port = free_port()
    command = [SALIENCE, "serve", "--model", str(tiny_model), "--lmtp-port", str(port), "--no-grpc", "--no-readouts"]
    command += [
        "--max-model-len",
        "512",
        "--eager",
        "--tls-cert",
        str(pki.server.cert),
        "--tls-key",
        str(pki.server.key),
        "--tls-key-password-file",
        str(password),
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    context = ClientTls(ca=pki.ca).context()
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None and time.monotonic() < deadline
            try:
                if (await health(port, context))[0] == 200:
                    break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
        first = await asyncio.to_thread(served_certificate, port, pki.ca)
        client = await LmtpClient.connect(f"wss://127.0.0.1:{port}/", tls=context)
        try:
            stream = client.stream("GENERATE", prompt=[1, 2, 3], max_tokens=480, ignore_eos=True, temperature=0)
            tokens = [await anext(stream)]
            rotated = trustme.CA()
            rotated_ca = tmp_path / "rotated-ca.pem"
            rotated.cert_pem.write_to_path(str(rotated_ca))
            cert, key = write_leaf(rotated.issue_cert("127.0.0.1"), tmp_path, "rotated")
            encrypt(key, "second")
            pki.server.cert.write_bytes(cert.read_bytes())
            pki.server.key.write_bytes(key.read_bytes())
            password.write_text("second\n")
            process.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while True:  # the reload runs on the server's loop, between its other work
                try:
                    second = await asyncio.to_thread(served_certificate, port, rotated_ca)
                    break
                except ssl.SSLError:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.2)
            tokens += [payload async for payload in stream]
        finally:
            await client.close()
        assert second != first
        assert len([t for t in tokens if "token" in t]) == 480 and tokens[-1]["finish_reason"] == "length"
        elapsed, output, ends = await stop_by_two_sigterms(process, port, ClientTls(ca=rotated_ca).context())
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert "tls reloaded" in output, output
    assert process.returncode == 0 and "cause=signal" in output, output
    # Stopped at once, not drained: every stream ends cancelled. The bound only catches a hang (a
    # full run's load once made a prompt stop take 11.6 s, past the 10 s this asked before).
    assert ends == ["cancelled"] * 4
    assert elapsed < 25, f"took {elapsed:.1f} s to stop"


async def stop_by_two_sigterms(
    process: subprocess.Popen, port: int, context: ssl.SSLContext
) -> tuple[float, str, list[str]]:
    """SIGTERM while four streams of 500 tokens run (the server's context is 512), and a second
    once health says draining: the process must stop at once, its streams cancelled.
    (test_drain.py's, run on this test's server to start one server less.) The seconds from the
    second signal to the exit, the output, and the streams' finish reasons."""
    client = await LmtpClient.connect(f"wss://127.0.0.1:{port}/", tls=context)
    try:
        fields = {"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True, "temperature": 0}
        streams = [client.stream("GENERATE", **fields) for _ in range(4)]
        for stream in streams:
            await anext(stream)
        process.send_signal(signal.SIGTERM)
        while (await health(port, context))[0] != 503:
            await asyncio.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        output, _ = await asyncio.to_thread(process.communicate, timeout=30)
        elapsed = time.monotonic() - signalled
        left = left_in_group(process.pid)
        assert not left, f"left running after the exit: {left}\n{output}"
        ends = []
        for stream in streams:
            async with asyncio.timeout(10):
                ends.append([payload async for payload in stream][-1]["finish_reason"])
        return elapsed, output, ends
    finally:
        await client.close()
