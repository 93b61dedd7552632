"""The public request -> the RequestSpec every later hop carries: the model check, a length
check before tokenizing (a prompt that cannot fit costs microseconds), tokenizing on a thread
pool (never on the event loop), and validation with the engine's own rules."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor

from services.common.rpc import convert
from services.common.rpc.convert_tools import ChatTools, tools_from_proto
from services.common.rpc.errors import invalid_argument
from tandem.chat import ChatError, check_messages
from tandem.engine.request import RequestSpec, check_prompt
from tandem.engine.sampling import SamplingParams
from tandem.model.config import ModelConfig
from tandem.tokenizer.tokenizer import Tokenizer
from tandem.tools import (
    DEFAULT_FORMAT,
    ChoiceMode,
    ToolError,
    check_tools,
    detect_format,
    forced_constraint,
    get_format,
    template_takes_tools,
    tool_prompt,
)
from tandem.v1 import router_pb2 as rpb

# Normalizers can drop characters, so the early length check leaves this much slack.
_PROMPT_CHARS_SLACK = 4
MAX_REQUEST_ID_CHARS = 256


def check_request_id(request_id: str) -> None:
    """A client's request id: a bounded label of printable characters (it appears in logs)."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid_argument(
            f"request_id: {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}"
        )
    if not request_id.isprintable():
        raise invalid_argument("request_id: must be printable (no control characters)")


def check_size(
    request: rpb.GenerateRequest | rpb.TokenizeRequest, max_model_len: int, max_prompt_chars: int
) -> None:
    """Refuse a prompt that cannot fit before spending any time on it: token ids as many as
    the context or more, text (or chat contents and roles) over `max_prompt_chars`.

    Raises:
        ServiceError: INVALID_ARGUMENT naming the input and the limit.
    """
    kind = request.WhichOneof("input")
    if kind == "text":
        chars = len(request.text)
    elif kind == "chat":
        chars = sum(m.num_chars() for m in convert.chat_from_proto(request.chat))
    elif kind == "token_ids" and isinstance(request, rpb.GenerateRequest):
        n = len(request.token_ids.ids)
        if n >= max_model_len:
            raise invalid_argument(f"token_ids: {n} tokens; the model's context is {max_model_len}")
        return
    else:
        return
    if chars > max_prompt_chars:
        raise invalid_argument(
            f"{kind}: {chars} characters cannot fit the model's context of "
            f"{max_model_len} tokens (at most {max_prompt_chars} characters)"
        )


class Prompts:
    """The served model's tokenizer and limits, applied to public requests."""

    def __init__(self, model_dir: str, model_id: str, tool_call_parser: str = "auto") -> None:
        self.tokenizer = Tokenizer.from_dir(model_dir)
        # How the model writes tool calls: the flag, else what its template shows.
        template = self.tokenizer.chat_template
        if tool_call_parser == "auto":
            tool_call_parser = detect_format(template) or DEFAULT_FORMAT
        self.tool_format = get_format(tool_call_parser)
        self.template_takes_tools = template_takes_tools(template)
        # A template that never names tool_calls drops an assistant's calls: they are written
        # into its content in the format instead (tandem.tools.prompt).
        self.template_renders_calls = "tool_calls" in (template or "")
        self.model_config = ModelConfig.from_dir(model_dir)
        self.model_id = model_id
        self.max_model_len = self.model_config.max_position_embeddings
        self.max_prompt_chars = (
            _PROMPT_CHARS_SLACK * self.max_model_len * self.tokenizer.max_token_chars()
        )
        # Tokenizing a long prompt takes milliseconds to seconds: never on the event loop.
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_size(self, request: rpb.GenerateRequest | rpb.TokenizeRequest) -> None:
        check_size(request, self.max_model_len, self.max_prompt_chars)

    async def prompt(
        self, request: rpb.GenerateRequest | rpb.TokenizeRequest
    ) -> tuple[list[int], str]:
        """Token ids (and the prompt text, if any) of a request. Raises ServiceError."""
        if request.model and request.model != self.model_id:
            raise invalid_argument(
                f"model: unknown model {request.model!r}; this router serves {self.model_id!r}"
            )
        self.check_size(request)
        kind = request.WhichOneof("input")
        if kind == "token_ids" and isinstance(request, rpb.GenerateRequest):
            return list(request.token_ids.ids), ""
        if kind not in ("text", "chat"):
            raise invalid_argument("input: set text, chat or token_ids")
        if kind == "chat":
            try:  # the HTTP API's rule too, before any tokenizing
                check_messages(convert.chat_from_proto(request.chat))
            except ChatError as exc:
                raise invalid_argument(f"chat.{exc}") from None
            await self.check_tools(request.chat)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, self._tokenize, request)
        except ValueError as exc:
            raise invalid_argument(f"{kind}: {exc}") from None

    def _tokenize(
        self, request: rpb.GenerateRequest | rpb.TokenizeRequest
    ) -> tuple[list[int], str]:
        """On a tokenizer thread. Raises ValueError."""
        if request.WhichOneof("input") == "text":
            text = request.text
            return (self.tokenizer.encode(text) if text else []), text
        chat = request.chat
        messages = [m.to_template() for m in convert.chat_from_proto(chat)]
        add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        tools = tools_from_proto(chat)
        if tools.tools or any(m.tool_calls for m in chat.messages):
            # the template's `tools`, or a preamble; calls it would drop as text
            inputs = tool_prompt(
                messages,
                tools.tools,
                tools.choice,
                self.tool_format,
                self.template_takes_tools,
                self.template_renders_calls,
            )
            return self.tokenizer.encode_chat(
                inputs.messages, add_generation_prompt=add_gen, tools=inputs.tools
            )
        # Message content stays text: only the template's own markers become special tokens.
        return self.tokenizer.encode_chat(messages, add_generation_prompt=add_gen)

    async def check_tools(self, chat: rpb.ChatMessages) -> ChatTools:
        """The chat's tools under tandem.tools' rule; each parameters schema is compiled (on
        the pool). Raises ServiceError (INVALID_ARGUMENT chat.tools[i]...)."""
        tools = tools_from_proto(chat)
        if not tools.tools and tools.choice.mode == ChoiceMode.NONE:
            return tools
        try:
            check_tools(tools.tools, tools.choice, compile_schemas=False)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._pool, check_tools, tools.tools, tools.choice)
        except ToolError as exc:
            raise invalid_argument(f"chat.{exc}") from None
        return tools

    async def spec(
        self,
        request: rpb.GenerateRequest,
        request_id: str,
        timeout_s: float | None,
        cache_salt: str = "",
    ) -> RequestSpec:
        """The request as every later hop sees it, validated once. Raises ServiceError."""
        tokens, _ = await self.prompt(request)
        vocab = self.model_config.vocab_size
        try:
            check_prompt(tokens, vocab, self.max_model_len)
        except ValueError as exc:
            raise invalid_argument(f"{request.WhichOneof('input') or 'input'}: {exc}") from None
        try:
            if request.sampling.HasField("constraint"):
                # Checking a schema or grammar compiles it (milliseconds when large): on
                # the pool, never on the event loop.
                loop = asyncio.get_running_loop()
                params = await loop.run_in_executor(
                    self._pool, convert.sampling_from_proto, request.sampling
                )
            else:
                params = convert.sampling_from_proto(request.sampling)
            params.validate_for_vocab(vocab)
        except ValueError as exc:
            raise invalid_argument(f"sampling.{exc}") from None
        if request.WhichOneof("input") == "chat":
            params = await self._force_tool_calls(request, params)
        return RequestSpec(request_id, tuple(tokens), params, self.model_id, timeout_s, cache_salt)

    async def _force_tool_calls(
        self, request: rpb.GenerateRequest, params: SamplingParams
    ) -> SamplingParams:
        """tool_choice required or a named function: the grammar of calls in the model's
        format (compiled on the pool), so that the answer always parses."""
        tools = tools_from_proto(request.chat)
        if not tools.choice.forced:
            return params
        if params.constraint is not None:
            raise invalid_argument(
                "sampling.constraint: a required or named tool_choice constrains the output "
                "itself; set one or the other"
            )
        loop = asyncio.get_running_loop()
        constraint = await loop.run_in_executor(
            self._pool,
            forced_constraint,
            tools.tools,
            tools.choice,
            tools.parallel,
            self.tool_format,
        )
        return dataclasses.replace(params, constraint=constraint)
