"""The public request -> the RequestSpec every later hop carries. The gRPC API's requests are
read here once (`Prompts.read`: the model check, a length check before anything else (a
prompt that cannot fit costs microseconds), the chat rule, tools and sampling parameters
checked, schemas compiled on a thread pool); the HTTP API reads its own
(tandem.services.router.openai). Either way the core then tokenizes on the pool (never on the event
loop) and validates with the engine's own rules (`Prompts.spec`)."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor

from tandem.chat import ChatError, check_messages
from tandem.engine.request import RequestSpec, check_prompt
from tandem.engine.sampling import SamplingParams
from tandem.model.config import ModelConfig
from tandem.services.common.rpc import convert
from tandem.services.common.rpc.convert_tools import ChatTools, tools_from_proto
from tandem.services.common.rpc.errors import invalid_argument
from tandem.services.router.inputs import ChatPrompt, GenerateInput, Prompt
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


def check_size(prompt: Prompt, max_model_len: int, max_prompt_chars: int) -> None:
    """Refuse a prompt that cannot fit before spending any time on it: token ids as many as
    the context or more, text (or chat contents and roles) over `max_prompt_chars`.

    Raises:
        ServiceError: INVALID_ARGUMENT naming the input and the limit.
    """
    if isinstance(prompt, tuple):
        if len(prompt) >= max_model_len:
            raise invalid_argument(
                f"token_ids: {len(prompt)} tokens; the model's context is {max_model_len}"
            )
        return
    kind, chars = ("text", len(prompt)) if isinstance(prompt, str) else ("chat", prompt.num_chars())
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

    # -- the gRPC API's requests, read once ----------------------------------------------

    async def read(self, request: rpb.GenerateRequest) -> GenerateInput:
        """A GenerateRequest as the core serves it: the model, the prompt's size, kind and
        (a chat) its messages and tools checked, the sampling parameters parsed (a
        constraint compiled on the pool). Raises ServiceError (INVALID_ARGUMENT naming the
        field)."""
        prompt = await self._read_prompt(request)
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
        except ValueError as exc:
            raise invalid_argument(f"sampling.{exc}") from None
        return GenerateInput(prompt, params, request.model, request.request_id)

    async def _read_prompt(self, request: rpb.GenerateRequest | rpb.TokenizeRequest) -> Prompt:
        if request.model and request.model != self.model_id:
            raise invalid_argument(
                f"model: unknown model {request.model!r}; this router serves {self.model_id!r}"
            )
        kind = request.WhichOneof("input")
        if kind == "token_ids" and isinstance(request, rpb.GenerateRequest):
            return tuple(request.token_ids.ids)
        if kind == "text":
            return request.text
        if kind != "chat":
            raise invalid_argument("input: set text, chat or token_ids")
        chat = request.chat
        messages = convert.chat_from_proto(chat)
        try:  # the HTTP API's rule too, before any tokenizing
            check_messages(messages)
        except ChatError as exc:
            raise invalid_argument(f"chat.{exc}") from None
        tools = await self.check_tools(tools_from_proto(chat))
        add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        return ChatPrompt(messages, add_gen, tools)

    async def check_tools(self, tools: ChatTools) -> ChatTools:
        """A chat's tools under tandem.tools' rule; each parameters schema is compiled (on
        the pool). Raises ServiceError (INVALID_ARGUMENT chat.tools[i]...)."""
        if not tools.tools and tools.choice.mode == ChoiceMode.NONE:
            return tools
        try:
            check_tools(tools.tools, tools.choice, compile_schemas=False)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._pool, check_tools, tools.tools, tools.choice)
        except ToolError as exc:
            raise invalid_argument(f"chat.{exc}") from None
        return tools

    async def tokenize(self, request: rpb.TokenizeRequest) -> tuple[list[int], str]:
        """The Tokenize RPC: the prompt's token ids and its text (a chat's rendered
        template), read and checked as Generate's."""
        prompt = await self._read_prompt(request)
        check_size(prompt, self.max_model_len, self.max_prompt_chars)
        return await self._tokens(prompt, request.WhichOneof("input") or "input")

    # -- the core: a read request -> the RequestSpec every hop carries -------------------

    async def spec(
        self,
        inp: GenerateInput,
        request_id: str,
        timeout_s: float | None,
        cache_salt: str = "",
    ) -> RequestSpec:
        """The request as every later hop sees it, validated once: its size before anything
        is spent on it, then its tokens and the engine's own checks. Raises ServiceError."""
        check_size(inp.prompt, self.max_model_len, self.max_prompt_chars)
        tokens, _ = await self._tokens(inp.prompt, inp.kind)
        vocab = self.model_config.vocab_size
        try:
            check_prompt(tokens, vocab, self.max_model_len)
        except ValueError as exc:
            raise invalid_argument(f"{inp.kind}: {exc}") from None
        params = inp.params
        try:
            params.validate_for_vocab(vocab)
        except ValueError as exc:
            raise invalid_argument(f"sampling.{exc}") from None
        if isinstance(inp.prompt, ChatPrompt):
            params = await self._force_tool_calls(inp.prompt.tools, params)
        return RequestSpec(request_id, tuple(tokens), params, self.model_id, timeout_s, cache_salt)

    async def _tokens(self, prompt: Prompt, kind: str) -> tuple[list[int], str]:
        """Token ids of a prompt (tokenized on the pool) and its text ("" for ids). Raises
        ServiceError."""
        if isinstance(prompt, tuple):
            return list(prompt), ""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, self._tokenize, prompt)
        except ValueError as exc:
            raise invalid_argument(f"{kind}: {exc}") from None

    def _tokenize(self, prompt: str | ChatPrompt) -> tuple[list[int], str]:
        """On a tokenizer thread. Raises ValueError."""
        if isinstance(prompt, str):
            return (self.tokenizer.encode(prompt) if prompt else []), prompt
        messages = [m.to_template() for m in prompt.messages]
        add_gen = prompt.add_generation_prompt
        tools = prompt.tools
        if tools.tools or any(m.tool_calls for m in prompt.messages):
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

    async def _force_tool_calls(self, tools: ChatTools, params: SamplingParams) -> SamplingParams:
        """tool_choice required or a named function: the grammar of calls in the model's
        format (compiled on the pool), so that the answer always parses."""
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
