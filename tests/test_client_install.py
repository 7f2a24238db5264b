"""A laptop's install: `pip install salience` without extras runs the clients and the REPL.

The clients (salience.lmtp.client, salience.grpc_frontend.client, `salience repl`) must not
need the server's weight: no transformers, torch, gguf, accelerate, safetensors or engine.
A fresh virtualenv gets the package's base requirements, built once per cache keyed by
setup.cfg and pyproject.toml; each run then installs a wheel of the working tree into a
scratch folder on that venv's path (no dependencies), so the code under test is current
while the environment is exactly what setup.cfg declares. The installed clients then drive
a real server on the tiny model.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import venv
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from salience.core.engine.engine import Engine
from salience.core.models.atomic import build_folder_once
from salience.core.models.home import salience_home
from tests.inprocess import frontends

ROOT = Path(__file__).resolve().parents[1]
PACKAGING = [ROOT / "setup.cfg", ROOT / "pyproject.toml"]
SERVER_ONLY = ["transformers", "torch", "gguf", "accelerate", "safetensors", "vllm"]
PIP = ["-m", "pip", "--disable-pip-version-check", "-q"]


def _wheel(out: Path) -> Path:
    """A wheel of the working tree (built from a copy, so the tree gets no build/ folder)."""
    source = out / "source"
    shutil.copytree(ROOT / "salience", source / "salience", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, *PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", out, source],
        check=True,
        stdout=sys.stderr,
    )
    return next(out.glob("salience-*.whl"))


def _build_venv(folder: Path) -> None:
    """A venv holding exactly the base requirements: the wheel's dependencies, then the wheel removed."""
    venv.EnvBuilder(with_pip=True).create(folder)
    python = folder / "bin" / "python"
    wheel = _wheel(folder / "wheel")
    subprocess.run([python, *PIP, "install", wheel], check=True, stdout=sys.stderr)
    subprocess.run([python, *PIP, "uninstall", "-y", "salience"], check=True, stdout=sys.stderr)
    shutil.rmtree(folder / "wheel")


class ClientInstall:
    def __init__(self, python: Path, site: Path) -> None:
        self.python = python
        self.site = site
        self.salience = site / "bin" / "salience"
        self.env = {**os.environ, "PYTHONPATH": str(site), "SALIENCE_HOME": str(site / "home")}

    def run(self, *args: str | Path, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*args], input=stdin, capture_output=True, text=True, env=self.env, cwd=self.site, timeout=300
        )

    async def run_async(self, *args: str | Path, stdin: str = "") -> tuple[int, str, str]:
        """As run, while this test's event loop keeps serving."""
        process = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env,
            cwd=self.site,
        )
        out, err = await asyncio.wait_for(process.communicate(stdin.encode()), 300)
        return process.returncode, out.decode(), err.decode()


@pytest.fixture(scope="module")
def client_install(tmp_path_factory: pytest.TempPathFactory) -> ClientInstall:
    key = hashlib.sha256(b"".join(p.read_bytes() for p in PACKAGING)).hexdigest()[:12]
    python = build_folder_once(salience_home() / "venvs" / f"client-only-{key}", _build_venv) / "bin" / "python"
    scratch = tmp_path_factory.mktemp("client-install")
    wheel = _wheel(scratch / "wheel")
    site = scratch / "site"
    subprocess.run([python, *PIP, "install", "--no-deps", "--no-index", "--target", site, wheel], check=True)
    return ClientInstall(python, site)


def test_no_model_code_and_the_clients_import(client_install: ClientInstall) -> None:
    script = (
        "import importlib, importlib.util, json, sys\n"
        f"missing = [m for m in {SERVER_ONLY!r} if importlib.util.find_spec(m) is None]\n"
        "for m in ['salience.lmtp.client', 'salience.grpc_frontend.client', 'salience.repl', 'salience.cli']:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps([missing, sys.modules['salience'].__file__]))\n"
    )
    result = client_install.run(client_install.python, "-c", script)
    assert result.returncode == 0, result.stderr
    missing, location = json.loads(result.stdout.strip().splitlines()[-1])
    assert missing == SERVER_ONLY
    assert Path(location).is_relative_to(client_install.site)  # the wheel's copy, not the work tree


def test_the_command_line_helps(client_install: ClientInstall) -> None:
    for args in ([], ["repl"]):
        result = client_install.run(client_install.salience, *args, "--help")
        assert result.returncode == 0, result.stderr
        assert "usage: salience" in result.stdout


@pytest_asyncio.fixture(scope="module")
async def server(tiny_engine: Engine) -> AsyncIterator[tuple[str, str]]:
    """The tiny model over LMTP and gRPC, in this process: (WebSocket URL, gRPC target)."""
    async with frontends(tiny_engine) as served:
        yield served.ws, served.grpc_target


CLIENTS = """
import asyncio, json, sys
from salience.grpc_frontend.client import AsyncSalienceClient
from salience.lmtp.client import LmtpClient

async def main(url, target):
    prompt = [1, 20, 300, 400]
    lmtp = await LmtpClient.connect(url)
    try:
        stream = lmtp.stream("GENERATE", model="tiny", prompt=prompt, max_tokens=6, temperature=0.0)
        by_lmtp = [p["token"] async for p in stream if "token" in p]
    finally:
        await lmtp.close()
    async with AsyncSalienceClient(target) as client:
        session = await client.open_session("tiny")
        by_grpc = (await session.generate(prompt, max_tokens=6, top_k=1)).token_ids  # greedy
    print(json.dumps([by_lmtp, by_grpc]))

asyncio.run(main(*sys.argv[1:]))
"""


async def test_the_installed_clients_generate_against_a_server(
    client_install: ClientInstall, server: tuple[str, str]
) -> None:
    code, out, err = await client_install.run_async(client_install.python, "-c", CLIENTS, *server)
    assert code == 0, err
    by_lmtp, by_grpc = json.loads(out.strip().splitlines()[-1])
    assert 1 <= len(by_lmtp) <= 6 and by_lmtp == by_grpc  # both greedy on the same prompt


async def test_the_installed_repl_generates_against_a_server(
    client_install: ClientInstall, server: tuple[str, str]
) -> None:
    code, out, err = await client_install.run_async(
        client_install.salience, "repl", server[0], stdin="def f(x): max_tokens=4\n"
    )
    assert code == 0, err
    assert "connected to" in out and "(tiny)" in out
    assert "[stop]" in out or "[length]" in out
