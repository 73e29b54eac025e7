"""The handlers behind the OpenAI-compatible routes: completions, chat completions, tokenize,
detokenize and the model list.

Each request is tokenized (chat template included) in a small worker pool, off the event loop
and off the engine thread, and reaches the engine as token ids; the engine thread only
schedules and runs the model. A request the engine fails finishes alone: its client gets an
error (an error event on a stream, 500 otherwise) and every other request goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedserve.inputs import InputProcessor, ProcessedPrompt, context_length_error, text_chars
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from pagedserve.server.async_engine import AsyncEngine, EngineDeadError, TooManyRequestsError
from pagedserve.server.errors import RETRY_AFTER_SECONDS, APIError
from pagedserve.server.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedserve.server.tool_parsers import (
    ToolParser,
    check_tools,
    forced_tools,
    get_tool_parser,
)

MIN_LOGPROB = -9999.0  # what -inf (and NaN) logprobs are sent as: JSON has no infinities
# Tokenizer threads: enough that one huge prompt does not hold up the next request's
# tokenization, few enough to leave the cores to the model.
NUM_INPUT_WORKERS = 2


def _finite(x: float) -> float:
    return x if math.isfinite(x) else (MIN_LOGPROB if x < 0 or math.isnan(x) else -MIN_LOGPROB)


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"


DONE = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """Server-sent events that stop, and abort their requests, when the client disconnects:
    the stream runs beside a task listening for ``http.disconnect`` whatever the server's ASGI
    version (Starlette itself watches only for ASGI < 2.4)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        import anyio

        async with anyio.create_task_group() as tg:
            async def stream() -> None:
                await self.stream_response(send)
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


def _failed(out: RequestOutput) -> APIError | None:
    """The error of an output the engine failed (finish_reason "error")."""
    if out.error is None:
        return None
    return APIError(500, f"the request {out.request_id} failed in the engine: {out.error}")


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The final output of a final-only stream."""
    last = None
    async for last in stream:  # noqa: B007
        pass
    return last


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()  # its requests are aborted; nobody is left to read an answer
        return Response(status_code=499)
    return task.result()


def _completion_prompts(prompt: Any) -> list[Any]:
    """The completions ``prompt`` field as a list of engine prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    if isinstance(prompt[0], str):
        return list(prompt)
    return [{"prompt_token_ids": ids} for ids in prompt]


def _engine_prompt(p: ProcessedPrompt, cache_salt: str | None) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt": p.text, "prompt_token_ids": p.token_ids}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


def _bad_params(e: ValueError, body: Any, sent_as: str | None = None) -> APIError:
    """A SamplingParams error as a 400 whose ``param`` is the field its message starts with
    (``max_tokens`` named ``sent_as`` when the client sent it under that name)."""
    name = str(e).split(" ", 1)[0].rstrip(":").split("=", 1)[0]
    if sent_as is not None and name == "max_tokens":
        return APIError(400, str(e).replace("max_tokens", sent_as, 1), param=sent_as)
    if re.split(r"[.\[]", name, maxsplit=1)[0] not in type(body).model_fields:  # e.g. a context-length error: the prompt's
        name = "prompt" if "prompt" in type(body).model_fields else "messages"
    return APIError.bad_input(e, name)


class OpenAIServing:
    """The handlers and their shared state: the engine thread, the input processor (used in
    a worker pool), the model's name and limits."""

    def __init__(self, async_engine: AsyncEngine, served_model_name: str,
                 tool_call_parser: str = "smollm2"):
        self.engine = async_engine
        self.tool_parser: ToolParser = get_tool_parser(tool_call_parser)
        self.model_name = served_model_name
        engine = async_engine.engine
        self.inputs: InputProcessor = engine.input_processor
        self.max_model_len = engine.scheduler_config.max_model_len
        self.created = int(time.time())
        self.pool = concurrent.futures.ThreadPoolExecutor(NUM_INPUT_WORKERS,
                                                          thread_name_prefix="pagedserve-input")
        # Grammars compile in a worker of their own: a second-long compile of a huge new
        # schema then delays only the requests that bring new schemas, never tokenization.
        self.grammar_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pagedserve-grammar")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.grammar_pool.shutdown(wait=False, cancel_futures=True)

    # ---- shared pieces --------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model")

    async def off_loop(self, fn: Callable[..., Any], *args: Any, param: str | None = None
                       ) -> Any:
        """``fn(*args)`` in the input worker pool; its ValueError becomes a 400."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.pool, functools.partial(fn, *args))
        except ValueError as e:
            raise APIError.bad_input(e, param) from None

    async def add(self, requests: list[tuple[str, dict, SamplingParams]], body: Any,
                  sent_as: str | None = None) -> list[AsyncIterator[RequestOutput]]:
        """Add the requests in the engine thread; a refusal is a 400 naming the field."""
        try:
            return await self.engine.add(requests)
        except ValueError as e:
            raise _bad_params(e, body, sent_as) from None
        except TooManyRequestsError as e:
            raise APIError(429, str(e), headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
                           ) from None

    async def compile_grammar(self, params: SamplingParams, sent_as: str) -> None:
        """Compile the request's grammar in the grammar worker (cached by spec, so the engine
        thread only looks it up); a grammar the engine refuses is a 400 naming the field the
        client sent it in."""
        if params.structured_outputs is None:
            return
        field = "structured_outputs." + params.structured_outputs.kind()[0]
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.grammar_pool, self.inputs.compile_grammar, params)
        except ValueError as e:
            raise APIError(400, str(e).replace(field, sent_as, 1), param=sent_as) from None

    def guard(self, gen: AsyncIterator[str], ids: list[str]) -> AsyncIterator[str]:
        """An SSE stream that ends with an error event if the engine fails, and aborts its
        requests however it ends."""
        async def guarded():
            try:
                async for chunk in gen:
                    yield chunk
            except (EngineDeadError, APIError) as e:
                err = e if isinstance(e, APIError) else APIError(503, str(e))
                yield _sse(err.body())
                yield DONE
            finally:
                self.engine.abort(ids)
        return guarded()

    async def guard_await(self, work: Awaitable[Any], ids: list[str]) -> Any:
        try:
            return await work
        finally:
            self.engine.abort(ids)

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    @staticmethod
    def completion_logprobs(c: CompletionOutput, offset: int) -> dict:
        """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(c.token_ids, c.logprobs or []):
            text = entry[token_id].decoded_token or ""
            tokens.append(text)
            token_logprobs.append(_finite(entry[token_id].logprob))
            top.append({(lp.decoded_token or ""): _finite(lp.logprob)
                        for lp in sorted(entry.values(), key=lambda lp: lp.rank)})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}

    @staticmethod
    def chat_logprobs(c: CompletionOutput, top_k: int) -> list[dict]:
        """The ``logprobs.content`` entries of a chat choice, one per token."""
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs or []):
            chosen = entry[token_id]
            text = chosen.decoded_token or ""
            alternatives = sorted((lp for lp in entry.values() if lp.rank <= top_k),
                                  key=lambda lp: lp.rank)[:top_k]
            content.append({
                "token": text, "logprob": _finite(chosen.logprob),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": lp.decoded_token or "",
                                  "logprob": _finite(lp.logprob),
                                  "bytes": list((lp.decoded_token or "").encode("utf-8"))}
                                 for lp in alternatives]})
        return content

    def check_completion_size(self, data: dict) -> None:
        """Refuse, before validating it item by item, a completions body with more than
        MAX_PROMPTS prompts or a token-id prompt longer than the context."""
        prompt = data.get("prompt")
        if not isinstance(prompt, list):
            return
        if prompt and isinstance(prompt[0], list):
            if len(prompt) > MAX_PROMPTS:
                raise APIError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got "
                                    f"{len(prompt)}", param="prompt")
            lengths = [len(p) for p in prompt if isinstance(p, list)]
        elif prompt and isinstance(prompt[0], str):
            if len(prompt) > MAX_PROMPTS:
                raise APIError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got "
                                    f"{len(prompt)}", param="prompt")
            return
        else:
            lengths = [len(prompt)]
        if max(lengths, default=0) > self.max_model_len:
            raise APIError.bad_input(context_length_error(self.max_model_len, max(lengths)),
                                     "prompt")

    def check_chat_size(self, data: dict) -> None:
        """Refuse, before validating and rendering them, messages that cannot fit the
        context: more messages than tokens, or more text than any prompt of max_model_len
        tokens can hold."""
        messages = data.get("messages")
        try:
            if isinstance(messages, list):
                self.inputs.check_message_count(len(messages))
                self.inputs.check_text_length(text_chars(messages))
            if isinstance(data.get("prompt"), str):
                self.inputs.check_text_length(len(data["prompt"]))
        except ValueError as e:
            raise APIError.bad_input(e, "messages" if messages is not None else "prompt") \
                from None

    # ---- GET /v1/models --------------------------------------------------------------------

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "pagedserve", "root": self.model_name,
                "max_model_len": self.max_model_len}

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model(self, model_id: str) -> dict:
        self.check_model(model_id)
        return self.model_card()

    # ---- POST /tokenize, /detokenize -----------------------------------------------------

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            _, tokens = await self.off_loop(self.inputs.render_chat, messages, param="messages")
        else:
            tokens = await self.off_loop(self.inputs.tokenize, body.prompt,
                                         body.add_special_tokens, param="prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)

        def run() -> str:
            self.inputs.check_token_ids(body.tokens)
            if self.inputs.tokenizer is None:
                raise ValueError("the server runs without a tokenizer")
            return self.inputs.tokenizer.decode(body.tokens)

        return {"prompt": await self.off_loop(run, param="tokens")}

    # ---- POST /v1/completions ------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self.check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = _completion_prompts(body.prompt)
        max_tokens = body.max_tokens
        if max_tokens is not None and (max_tokens < 0 or max_tokens == 0 and not body.echo):
            raise APIError(400, f"max_tokens must be at least 1 (0 is allowed only with "
                           f"echo), got {max_tokens}", param="max_tokens")
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported",
                           param="logprobs")
        try:  # validated even when nothing is generated (echo with max_tokens 0)
            spec, sent_as = body.structured_spec()
            params = body.sampling_params(max_tokens or None, body.logprobs, spec)
        except ValueError as e:
            raise _bad_params(e, body) from None
        await self.compile_grammar(params, sent_as)
        processed = [await self.off_loop(self._prompt_of, p, body.echo,
                                         params.truncate_prompt_tokens, param="prompt")
                     for p in prompts]
        if max_tokens == 0:
            try:
                self.inputs.check_params(params)
                for p in processed:
                    self.inputs.check_fits(params, len(p.token_ids))
            except ValueError as e:
                raise _bad_params(e, body) from None
            return self._echo_only(body, processed)
        rid = f"cmpl-{uuid.uuid4().hex}"
        ids = [f"{rid}-{i}" for i in range(len(prompts))]
        streams = await self.add([(i, _engine_prompt(p, body.cache_salt), params)
                                  for i, p in zip(ids, processed)], body)
        if body.stream:
            return EventStream(self.guard(self._stream_completion(body, rid, streams), ids))
        return await _unless_disconnected(request, self.guard_await(
            self._full_completion(body, rid, streams), ids))

    def _prompt_of(self, prompt: Any, echo: bool, truncate: int | None) -> ProcessedPrompt:
        """The prompt tokenized, truncated (``truncate_prompt_tokens``) and checked; with
        ``echo`` a token-id prompt gets its text."""
        p = self.inputs.process_prompt(prompt, truncate)
        if echo and p.text is None and self.inputs.tokenizer is not None:
            p = p._replace(text=self.inputs.tokenizer.decode(p.token_ids))
        return p

    def _echo_only(self, body: CompletionRequest, processed: list[ProcessedPrompt]) -> Any:
        tokenizer = self.inputs.tokenizer
        texts = [p.text if p.text is not None else
                 (tokenizer.decode(p.token_ids) if tokenizer is not None else "")
                 for p in processed]
        choices = [{"index": i * body.n + k, "text": text, "logprobs": None,
                    "finish_reason": "length", "stop_reason": None}
                   for i, text in enumerate(texts) for k in range(body.n)]
        response = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                    "created": int(time.time()), "model": self.model_name,
                    "choices": choices,
                    "usage": self.usage(sum(len(p.token_ids) for p in processed), 0, 0)}
        if not body.stream:
            return response

        async def events():
            head = {k: response[k] for k in ("id", "object", "created", "model")}
            for choice in choices:
                yield _sse({**head, "choices": [choice]})
            if body.stream_options is not None and body.stream_options.include_usage:
                yield _sse({**head, "choices": [], "usage": response["usage"]})
            yield DONE

        return EventStream(events())

    async def _full_completion(self, body: CompletionRequest, rid: str, streams) -> dict:
        outs: list[RequestOutput] = await asyncio.gather(*(_last(s) for s in streams))
        for out in outs:
            if (err := _failed(out)) is not None:
                raise err
        choices = []
        for i, out in enumerate(outs):
            prefix = (out.prompt or "") if body.echo else ""
            for c in out.outputs:
                choices.append({
                    "index": i * body.n + c.index, "text": prefix + c.text,
                    "logprobs": self.completion_logprobs(c, len(prefix))
                    if body.logprobs is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": self.usage(sum(len(o.prompt_token_ids) for o in outs),
                                    sum(len(c.token_ids) for o in outs for c in o.outputs),
                                    sum(o.num_cached_tokens for o in outs))}

    async def _stream_completion(self, body: CompletionRequest, rid: str, streams):
        created = int(time.time())
        prompt_tokens = completion_tokens = cached = 0
        offsets: dict[int, int] = {}

        def chunk(index: int, text: str, logprobs, finish_reason, stop_reason) -> str:
            return _sse({"id": rid, "object": "text_completion", "created": created,
                         "model": self.model_name,
                         "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                      "finish_reason": finish_reason,
                                      "stop_reason": stop_reason}]})

        started: set[int] = set()
        done: set[int] = set()  # choices already sent with their finish_reason
        async for i, out in _merged(streams):
            if (err := _failed(out)) is not None:
                raise err
            if i not in started:
                started.add(i)
                prompt_tokens += len(out.prompt_token_ids)
                cached += out.num_cached_tokens
                if body.echo:
                    for k in range(body.n):
                        offsets[i * body.n + k] = len(out.prompt or "")
                        yield chunk(i * body.n + k, out.prompt or "", None, None, None)
            for c in out.outputs:
                index = i * body.n + c.index
                if index in done or (not c.text and not c.token_ids and c.finish_reason is None):
                    continue
                if c.finish_reason is not None:
                    done.add(index)
                completion_tokens += len(c.token_ids)
                logprobs = None
                if body.logprobs is not None:
                    logprobs = self.completion_logprobs(c, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(c.text)
                yield chunk(index, c.text, logprobs, c.finish_reason, c.stop_reason)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse({"id": rid, "object": "text_completion", "created": created,
                        "model": self.model_name, "choices": [],
                        "usage": self.usage(prompt_tokens, completion_tokens, cached)})
        yield DONE

    # ---- POST /v1/chat/completions -------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Any:
        self.check_model(body.model)
        if not body.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        field = "max_completion_tokens" if body.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = getattr(body, field)
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"{field} must be at least 1, got {max_tokens}", param=field)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                f"{body.top_logprobs}", param="top_logprobs")
        top_k = body.top_logprobs or 0
        try:
            spec, sent_as = body.structured_spec()
            tools, spec, sent_as = self._tools(body, spec, sent_as)
            params = body.sampling_params(max_tokens, top_k if body.logprobs else None, spec)
            template_kwargs = self._template_kwargs(body)
        except ValueError as e:
            raise _bad_params(e, body, field) from None
        await self.compile_grammar(params, sent_as)
        text, ids = await self.off_loop(self._render, body, tools, template_kwargs,
                                        param="messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = _engine_prompt(ProcessedPrompt(text, ids, None), body.cache_salt)
        (stream,) = await self.add([(rid, prompt, params)], body, field)
        parse = tools is not None
        if body.stream:
            return EventStream(self.guard(self._stream_chat(body, rid, stream, top_k, parse),
                                          [rid]))
        return await _unless_disconnected(request, self.guard_await(
            self._full_chat(body, rid, stream, top_k, parse), [rid]))

    def _tools(self, body: ChatCompletionRequest, spec: StructuredOutputsParams | None,
               sent_as: str) -> tuple[list[dict] | None, StructuredOutputsParams | None, str]:
        """(the tools the model is shown, or None when tool calls are off; the output
        constraint; the field it came from). ``tool_choice`` "required" or a named function
        constrains the output to the tool-call format with valid arguments (the grammar of
        the tool parser); "auto" leaves the choice to the model and parses its output."""
        check_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        if not body.tools or body.tool_choice == "none":
            return None, spec, sent_as
        forced = forced_tools(body.tools, body.tool_choice)
        if forced is None:  # "auto"
            return body.tools, spec, sent_as
        if spec is not None:
            raise ValueError(f"tool_choice: a required or named tool call cannot be combined "
                             f"with {sent_as.split('.')[0]}")
        parallel = body.tool_choice == "required" and body.parallel_tool_calls is not False
        grammar = self.tool_parser.grammar(forced, parallel)
        return body.tools, StructuredOutputsParams(grammar=grammar), "tools"

    @staticmethod
    def _template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
        """The chat template's options: ``add_generation_prompt``, ``continue_final_message``
        (vLLM's rules: not both; the last message must be the assistant's) and
        ``chat_template_kwargs``. Raises ValueError naming the field."""
        continue_final = body.continue_final_message
        add = body.add_generation_prompt
        if continue_final:
            if add and "add_generation_prompt" in body.model_fields_set:
                raise ValueError("continue_final_message: cannot be combined with "
                                 "add_generation_prompt: true")
            add = False
            if body.messages[-1].role != "assistant":
                raise ValueError("continue_final_message: the last message must be the "
                                 f"assistant's, got role {body.messages[-1].role!r}")
        extra = dict(body.chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(extra))
        if reserved:
            raise ValueError(f"chat_template_kwargs.{reserved[0]}: set by the request itself, "
                             "not here")
        return {"add_generation_prompt": add, "continue_final_message": continue_final,
                **extra}

    def _render(self, body: ChatCompletionRequest, tools: list[dict] | None,
                kwargs: dict[str, Any]) -> tuple[str, list[int]]:
        """The conversation through the chat template (in an input worker). A template that
        knows tools gets them (and earlier calls' arguments as objects); otherwise the tool
        parser writes tools, calls and results into the messages in the model's format."""
        messages = [m.as_dict() for m in body.messages]
        template = getattr(self.inputs.tokenizer, "chat_template", None) or ""
        if "tools" in template:
            for m in messages:
                for call in m.get("tool_calls", ()):
                    call["function"]["arguments"] = _json_or_text(call["function"]["arguments"])
            if tools is not None:
                kwargs = {**kwargs, "tools": tools}
        else:
            messages = self.tool_parser.render_messages(messages, tools)
        add = kwargs.pop("add_generation_prompt")
        return self.inputs.render_chat(messages, add, **kwargs)

    def _message(self, c: CompletionOutput, parse: bool) -> tuple[dict, str | None]:
        """(the assistant message of a choice, its finish_reason): with tools, the tool
        calls the parser finds in the text, and finish_reason "tool_calls"."""
        if parse:  # the content as a stream sends it: tags and surrounding blanks taken out
            content, calls = self.tool_parser.parse(c.text)
            if calls:
                return ({"role": "assistant", "content": content,
                         "tool_calls": [call.to_openai() for call in calls]}, "tool_calls")
            return {"role": "assistant", "content": content or ""}, c.finish_reason
        return {"role": "assistant", "content": c.text}, c.finish_reason

    async def _full_chat(self, body: ChatCompletionRequest, rid: str, stream, top_k: int,
                         parse: bool) -> dict:
        out = await _last(stream)
        if (err := _failed(out)) is not None:
            raise err
        choices = []
        for c in out.outputs:
            message, finish_reason = self._message(c, parse)
            choices.append({"index": c.index, "message": message,
                            "logprobs": {"content": self.chat_logprobs(c, top_k)}
                            if body.logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": self.usage(len(out.prompt_token_ids),
                                    sum(len(c.token_ids) for c in out.outputs),
                                    out.num_cached_tokens)}

    async def _stream_chat(self, body: ChatCompletionRequest, rid: str, stream, top_k: int,
                           parse: bool):
        created = int(time.time())

        def chunk(choices: list[dict], **extra) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": self.model_name, "choices": choices, **extra})

        yield chunk([{"index": k, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None} for k in range(body.n)])
        prompt_tokens = completion_tokens = cached = 0
        # Tokens whose text is held back (a partial character or stop-string prefix) send
        # nothing until there is text: their logprobs wait here for the next chunk.
        held: dict[int, list[dict]] = {}
        done: set[int] = set()  # choices already sent with their finish_reason
        # With tools: each choice's text goes through a tool-call streamer, which holds back
        # what may be a call and releases each call whole once it is complete.
        streamers = {k: self.tool_parser.streamer() for k in range(body.n)} if parse else {}
        num_calls: dict[int, int] = {}
        async for out in stream:
            if (err := _failed(out)) is not None:
                raise err
            prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
            for c in out.outputs:
                if c.index in done:
                    continue
                completion_tokens += len(c.token_ids)
                if body.logprobs:
                    held.setdefault(c.index, []).extend(self.chat_logprobs(c, top_k))
                delta: dict[str, Any] = {"content": c.text} if c.text else {}
                finish_reason = c.finish_reason
                if parse:
                    text, calls = streamers[c.index].feed(c.text)
                    if c.finish_reason is not None:
                        rest, more = streamers[c.index].finish()
                        text, calls = text + rest, calls + more
                    delta = {"content": text} if text else {}
                    if calls:
                        first = num_calls.get(c.index, 0)
                        delta["tool_calls"] = [call.to_openai(index=first + i)
                                               for i, call in enumerate(calls)]
                        num_calls[c.index] = first + len(calls)
                    if finish_reason is not None and num_calls.get(c.index):
                        finish_reason = "tool_calls"
                if not delta and finish_reason is None:
                    continue
                if finish_reason is not None:
                    done.add(c.index)
                logprobs = {"content": held.pop(c.index, [])} if body.logprobs else None
                yield chunk([{"index": c.index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": finish_reason, "stop_reason": c.stop_reason}])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], usage=self.usage(prompt_tokens, completion_tokens, cached))
        yield DONE


# Chat template variables a request sets through its own fields.
RESERVED_TEMPLATE_KWARGS = {"messages", "conversation", "tools", "documents", "chat_template",
                            "add_generation_prompt", "continue_final_message", "tokenize",
                            "return_dict", "return_tensors", "padding", "truncation",
                            "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}


def _json_or_text(arguments: str) -> Any:
    """A tool call's arguments as an object for a chat template (as the text if not JSON)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


async def _merged(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:
            await queue.put((i, e))
            return
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
