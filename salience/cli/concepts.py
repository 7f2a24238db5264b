"""`salience concepts`: build a concept set, show one, or save a running server's."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from salience.auth import ADMIN_TOKEN_ENV, token_from_environment
from salience.core.models.points import POINTS
from salience.errors import FailedPrecondition, Unavailable

__all__ = ["add_concepts_parser", "run_concepts"]


def add_concepts_parser(commands: argparse._SubParsersAction) -> None:
    concepts = commands.add_parser("concepts", help="build or inspect concept sets").add_subparsers(
        dest="concepts_command", required=True
    )
    build = concepts.add_parser("build", help="derive concept vectors from contrastive example texts")
    build.add_argument("spec", type=Path, help="JSON or YAML spec (see salience/concept_specs/default.yaml)")
    build.add_argument("--model", type=Path, help="model folder (default: the embedded model)")
    build.add_argument("-o", "--output", type=Path, required=True)
    build.add_argument(
        "--point",
        choices=POINTS,
        help="the hook point of each layer the set reads (default: the spec's, or resid_post)",
    )
    show = concepts.add_parser("show", help="print a concept set's manifest and provenance")
    show.add_argument("file", type=Path)
    save = concepts.add_parser(
        "save", help="write a running server's concepts, live ones included, as a concept-set file"
    )
    save.add_argument("file", type=Path)
    save.add_argument("--server", default="ws://127.0.0.1:8080/", help="the server's LMTP WebSocket URL")
    save.add_argument(
        "--token",
        default=token_from_environment(ADMIN_TOKEN_ENV),
        help=f"the server's operator token (default: ${ADMIN_TOKEN_ENV})",
    )


def run_concepts(args: argparse.Namespace) -> int:
    if args.concepts_command == "build":
        return _build(args)
    from salience.core.probes.concepts import ConceptSet
    from salience.core.serving.concept_builder import describe

    if args.concepts_command == "show":
        print(describe(ConceptSet.load(args.file)))
        return 0
    saved = asyncio.run(_save_from(args.server, args.token))  # save
    args.file.write_bytes(saved)
    print(describe(ConceptSet.load(args.file)))
    return 0


def _build(args: argparse.Namespace) -> int:
    from salience.core.engine.start.fork_server import start_early
    from salience.core.serving.concept_spec import load_spec

    spec = load_spec(args.spec)  # a bad spec is refused before anything starts
    if args.point:
        spec["point"] = args.point
    # The builder's engine forks from the fork server, which imports vLLM on the other core meanwhile.
    start_early()
    from salience.core.models.default_model import ensure_default_model
    from salience.core.models.folders import inspect_model_folder
    from salience.core.serving.concept_builder import build_concept_set, describe

    model = inspect_model_folder(args.model or ensure_default_model()).path
    built = asyncio.run(build_concept_set(spec, model, source=str(args.spec)))
    built.save(args.output)
    print(describe(built))
    return 0


async def _save_from(url: str, token: str | None) -> bytes:
    import base64

    from salience.lmtp.client import LmtpClient, LmtpStreamError

    try:
        client = await LmtpClient.connect(url, {"Authorization": f"Bearer {token}"} if token else None)
    except OSError as exc:
        raise Unavailable(f"cannot connect to {url}: {exc}") from None
    try:
        reply = await client.request("SAVE_CONCEPTS")
    except LmtpStreamError as exc:
        raise FailedPrecondition(str(exc)) from None
    finally:
        await client.close()
    return base64.b64decode(reply["concept_set"])
