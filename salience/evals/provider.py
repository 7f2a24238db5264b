"""The `salience/<model>` Inspect provider: Inspect's OpenAI-compatible provider, with the extension.

Everything Inspect does over OpenAI's chat API (messages, logprobs, structured output, retries)
is the inherited provider's. This class adds what a Salience server reads and answers beyond
OpenAI's fields: it sends the `salience` object (from model args, overridden key by key by
`GenerateConfig.extra_body["salience"]`) and moves the reply's readings from the response into
`ModelOutput.metadata["salience"]` (readings.py), where scorers and `inspect view` find them.

Streaming is off while the extension is asked for: the OpenAI SDK's stream accumulator keeps
only OpenAI's fields, so a streamed reply would lose what the extension returned.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from inspect_ai._util.http_defaults_httpx2 import default_client_kwargs
from inspect_ai.model import ChatMessage, GenerateConfig, ModelOutput
from inspect_ai.model._model_call import ModelCall
from inspect_ai.model._providers.openai_compatible import OpenAICompatibleAPI
from inspect_ai.tool import ToolChoice, ToolInfo
from openai import DefaultAsyncHttpxClient

from salience.evals.readings import reply_readings, strip_token_entries
from salience.tls import ClientTls

__all__ = ["DEFAULT_BASE_URL", "EXTENSION_FIELDS", "SalienceAPI"]

DEFAULT_BASE_URL = "http://127.0.0.1:8080/v1"  # `salience serve`'s (and `make serve`'s) HTTP port
EXTENSION_FIELDS = ("readouts", "monitors", "steer", "features")  # the request's `salience` object


class SalienceAPI(OpenAICompatibleAPI):
    """Model args beyond Inspect's OpenAI-compatible ones:

    - `readouts`, `monitors`, `steer`, `features`: the extension's fields, sent with every request
      (`readouts` may be a format's name, `"running"`, for `{"format": "running"}`);
    - `token_arrays`: keep per-token readout rows in the metadata (float32, base64);
    - `ca_file`, and for mutual TLS `cert_file` and `key_file`: the server's CA and this client's
      certificate.
    """

    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        config: GenerateConfig | None = None,
        *,
        token_arrays: bool = False,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        **model_args: Any,
    ) -> None:
        self.extension = _extension_args(model_args)
        self.token_arrays = token_arrays
        files = {"ca": ca_file, "cert": cert_file, "key": key_file}
        self.tls = ClientTls(**{k: Path(f) for k, f in files.items() if f}) if any(files.values()) else None
        super().__init__(
            model_name,
            base_url=base_url,
            # A server started without --tokens takes any key; the SDK insists on one.
            api_key=api_key or os.environ.get("SALIENCE_API_KEY") or "unused",
            config=config or GenerateConfig(),
            service="salience",
            service_base_url=DEFAULT_BASE_URL,
            **model_args,
        )

    def _create_http_client(self) -> DefaultAsyncHttpxClient:
        if self.tls is None:
            return super()._create_http_client()
        return DefaultAsyncHttpxClient(**default_client_kwargs(verify=self.tls.context()))

    def salience_request(self, config: GenerateConfig) -> dict[str, Any]:
        """The `salience` object a request with `config` sends: the model args', then the config's."""
        return {**self.extension, **((config.extra_body or {}).get("salience") or {})}

    def auto_streamable(self, config: GenerateConfig) -> bool:
        return super().auto_streamable(config) and not self.salience_request(config)

    async def generate(
        self,
        input: list[ChatMessage],
        tools: list[ToolInfo],
        tool_choice: ToolChoice,
        config: GenerateConfig,
    ) -> ModelOutput | tuple[ModelOutput | Exception, ModelCall]:
        request = self.salience_request(config)
        if not request:
            return await super().generate(input, tools, tool_choice, config)
        if self.resolve_stream(config):
            raise ValueError("stream=true drops what the salience extension returns: leave stream unset with it")
        config = config.model_copy(update={"extra_body": {**(config.extra_body or {}), "salience": request}})
        result = await super().generate(input, tools, tool_choice, config)
        output, call = result if isinstance(result, tuple) else (result, None)
        if isinstance(output, ModelOutput) and call is not None and call.response and not call.error:
            readings = reply_readings(call.response, request, token_arrays=self.token_arrays)
            output.metadata = {**(output.metadata or {}), "salience": readings}
            strip_token_entries(call.response)
        return result


def _extension_args(model_args: dict[str, Any]) -> dict[str, Any]:
    """Take the extension's fields out of `model_args` (the rest go to the OpenAI client)."""
    extension = {key: model_args.pop(key) for key in EXTENSION_FIELDS if model_args.get(key) is not None}
    if isinstance(extension.get("readouts"), str):
        extension["readouts"] = {"format": extension["readouts"]}
    return extension
