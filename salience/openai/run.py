"""An OpenAI request run on the core engine: prompts to token ids, each choice a generation, and
the generations' events as each choice's Steps (choices.py).

Model-dependent checks are the core's (the vocabulary, the context, --max-logprobs, concepts and
SAEs); they run here under the name of the request field they are about, so a 400 names its
`param` without a second copy of any check. Every choice is one engine request: with n > 1 (or
a batch of prompts) they run side by side, and the prefix cache serves their shared prompt.
Leaving `steps` early (a stop string, a client gone, an error) closes every generation, which
aborts its request in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from salience.auth import Client
from salience.core.engine.engine import Engine
from salience.core.engine.generation import Generation
from salience.core.engine.prompts import Prompt
from salience.core.engine.requests import NO_PROBES, SamplingOptions
from salience.errors import under
from salience.openai.choices import Choice, Step
from salience.openai.errors import naming
from salience.openai.extension import Extension
from salience.openai.readings import Readings, layout
from salience.openai.requests import CHAT, ApiRequest
from salience.openai.responses import usage
from salience.openai.tokens import TokenText, token_text
from salience.openai.tool_calls import Calls, require_parser

__all__ = ["Run", "prompts"]

# The request fields core names by their OpenAI names (an error's `field`: `top_p`,
# `features.k`), and the prefix their param takes.
_FIELDS = {
    **{
        name: ""
        for name in (
            "temperature",
            "top_p",
            "seed",
            "logit_bias",
            "prompt",
            "messages",
            "input",
            "logprobs",
            "top_logprobs",
            "top_k",
            "min_p",
            "repetition_penalty",
            "min_tokens",
            "stop_token_ids",
            "structured_outputs",
            "response_format",
            "text",
            "tools",
        )
    },
    **{name: "salience" for name in ("steer", "patch", "features", "monitors")},
}


async def prompts(engine: Engine, request: ApiRequest) -> list[Prompt]:
    """Each prompt as the model reads it: chat's messages through the model's template (with
    their images); the completions endpoint's texts tokenized as vLLM's server does (with the
    tokenizer's special tokens)."""
    if request.kind == CHAT:
        tools = [tool.as_json() for tool in request.tools]
        with naming("messages"):
            return [await engine.chat.prompt(request.messages, tools or None)]
    out = []
    for i, prompt in enumerate(request.prompts):
        param = "prompt" if len(request.prompts) == 1 else f"prompt[{i}]"
        with naming(param, fields={"prompt": ""}):
            if isinstance(prompt, str):
                prompt = tuple(engine.tokenizer.encode(prompt))
            out.append(Prompt(tuple(engine.check_tokens(param, prompt))))
    return out


class Run:
    """A request's choices, started on the engine (`start`); `steps` runs them, `close` ends them."""

    def __init__(self, request: ApiRequest, prompts: Sequence[Prompt], pieces: TokenText) -> None:
        self._request = request
        self._prompts = prompts
        self.pieces = pieces
        self.choices: list[Choice] = []
        self.layout: dict | None = None  # the readout layout, when the extension asked for readouts
        self._generations: list[Generation] = []
        self._ran: set[int] = set()  # the generations `_choice` entered, and so closes

    @classmethod
    async def start(
        cls, engine: Engine, request: ApiRequest, prompts: Sequence[Prompt], request_id: str, client: Client
    ) -> Run:
        """Every choice checked and submitted, or none: a refused one (a 400) closes the others;
        each is `client`'s for fair share."""
        await engine.check_constraint(request.sampling.structured_outputs)  # off the loop; refused in _submit
        run = cls(request, prompts, token_text(engine.tokenizer))
        try:
            run._submit(engine, request_id, client)
        except BaseException:
            await run.close()
            raise
        run.layout = layout(request.salience, run._generations[0].concepts)
        return run

    def _submit(self, engine: Engine, request_id: str, client: Client) -> None:
        request, sampling, ext = self._request, self._request.sampling, self._request.salience
        calling = request.tool_choice.mode != "none"  # the reply may call tools (tool_calls.py)
        if calling:
            require_parser(request.tool_choice, engine.chat.tool_parser)
        single = len(self._prompts) * sampling.n == 1
        constraint = sampling.structured_outputs
        # readouts per JSON field, or per tool call's argument
        json_reply = calling or (constraint is not None and constraint.kind in ("json", "json_object"))
        raw_logprobs = request.logprobs and (ext or Extension()).raw_logprobs(sampling.temperature)
        for p, (prompt, images) in enumerate((p.tokens, p.images) for p in self._prompts):
            max_tokens = sampling.max_tokens or max(engine.max_model_len - len(prompt), 1)
            probes = ext.probes(len(prompt), max_tokens) if ext is not None else NO_PROBES
            for j in range(sampling.n):
                index = p * sampling.n + j
                options = SamplingOptions(
                    max_tokens=max_tokens,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    seed=None if sampling.seed is None else sampling.seed + j,
                    logit_bias=sampling.logit_bias,
                    presence_penalty=sampling.presence_penalty,
                    frequency_penalty=sampling.frequency_penalty,
                    logprobs=request.top_logprobs,
                    top_k=sampling.top_k,
                    min_p=sampling.min_p,
                    repetition_penalty=sampling.repetition_penalty,
                    min_tokens=sampling.min_tokens,
                    ignore_eos=sampling.ignore_eos,
                    stop_token_ids=sampling.stop_token_ids,
                    structured_outputs=sampling.structured_outputs,
                    raw_logprobs=raw_logprobs,
                )
                with (
                    naming("salience" if ext is not None else None, fields=_FIELDS),
                    under(names=request.names),
                ):
                    generation = engine.generate(
                        prompt,
                        options,
                        request_id=request_id if single else f"{request_id}-{index}",
                        probes=probes,
                        images=images,
                        **client.engine_keywords(),
                    )
                self._generations.append(generation)
                readings = (
                    Readings(ext, generation.concepts, self.pieces, fields=json_reply) if ext is not None else None
                )
                self.choices.append(
                    Choice(
                        index,
                        engine.tokenizer,
                        prompt,
                        sampling.stop,
                        readings,
                        min_tokens=sampling.min_tokens,
                        include_stop=sampling.include_stop_str_in_output,
                        skip_special_tokens=sampling.skip_special_tokens,
                        calls=Calls(
                            request.tools,
                            request.tool_choice,
                            parser=engine.chat.tool_parser,
                            tokenizer=engine.tokenizer,
                            streaming=request.stream,
                        )
                        if calling
                        else None,
                    )
                )

    async def close(self) -> None:
        """Let go of the generations `steps` never ran (a refused choice, a client gone before
        they started): their ids, concepts and rows. Those it ran closed themselves."""
        for i, generation in enumerate(self._generations):
            if i not in self._ran:
                await generation.cancel()  # never submitted: it frees what it registered
                await generation.aclose()

    async def steps(self) -> AsyncIterator[tuple[int, Step]]:
        """(choice index, step) as the choices make them: in order within a choice, interleaved
        across choices."""
        if len(self.choices) == 1:
            async with contextlib.aclosing(self._choice(0)) as steps:
                async for step in steps:
                    yield 0, step
            return
        queue: asyncio.Queue[tuple[int, Step | None, Exception | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async with contextlib.aclosing(self._choice(i)) as steps:
                    async for step in steps:
                        queue.put_nowait((i, step, None))
                queue.put_nowait((i, None, None))
            except Exception as exc:  # the consumer raises it
                queue.put_nowait((i, None, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.choices))]
        try:
            running = len(tasks)
            while running:
                i, step, error = await queue.get()
                if error is not None:
                    raise error
                if step is None:
                    running -= 1
                    continue
                yield self.choices[i].index, step
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _choice(self, i: int) -> AsyncIterator[Step]:
        generation, choice = self._generations[i], self.choices[i]
        prompt = self._prompts[i // self._request.sampling.n].tokens
        self._ran.add(i)
        async with generation:
            async for event in generation:
                step = choice.push(event)
                if choice.tokens == 1 and choice.readings is not None:  # the prompt's rows are in
                    step.prompt = choice.readings.prompt(prompt, generation.prompt_readouts, generation.prompt_rows)
                yield step
                if step.finish is not None and event.finish_reason is None:  # a stop string: abort the rest
                    return
            if choice.finish is None:  # cancelled after its last token went out
                yield choice.end(generation.finish_reason)

    def usage(self) -> dict:
        """Tokens counted as OpenAI counts them: each prompt once, every choice's completion."""
        n = self._request.sampling.n
        cached = sum(self._generations[p * n].cached_tokens or 0 for p in range(len(self._prompts)))
        completion = sum(choice.tokens for choice in self.choices)
        return usage(sum(len(p.tokens) for p in self._prompts), completion, cached)
