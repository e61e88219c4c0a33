"""Model backends behind the one LLM client.

A backend turns one request into texts and token counts and classifies failures as transient (retried by
the client) or permanent. It does no retries, no concurrency control and no accounting of its own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

from schemas.config import ModelConfig

Message = dict[str, Any]  # a chat message; agent turns carry "tool_calls" / "tool_call_id" besides the text


@dataclass(frozen=True)
class GenRequest:
    messages: list[Message]
    n: int = 1
    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 1024
    seed: int | None = None
    repetition_penalty: float | None = None
    json_schema: dict | None = None
    schema_name: str = "reply"
    tools: list[dict] | None = None  # OpenAI tool definitions: the reply may call them instead of answering
    tool_choice: str | None = None  # "none": tools are listed (the conversation has used them) but not callable


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model asked for (OpenAI tool calling). ``arguments`` is the raw JSON text."""

    call_id: str
    name: str
    arguments: str


@dataclass
class Generation:
    texts: list[str]
    tokens_in: int = 0
    tokens_out: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    tool_calls: list[list[ToolCall]] = field(default_factory=list)  # per choice; empty: no tool called


class TransientLLMError(RuntimeError):
    """Worth retrying: rate limits, server errors, connection problems, timeouts."""

    def __init__(self, message: str, retry_after: float | None = None, rate_limited: bool = False,
                 counted: bool = True) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.rate_limited = rate_limited
        self.counted = counted  # False: retry at once, not against max_retries (the request was adapted)


class PermanentLLMError(RuntimeError):
    """Retrying will not help: bad request, authentication, unknown model."""


class ToolsRefused(PermanentLLMError):
    """The endpoint refused a request with ``tools``: it has no tool calling (use the text protocol)."""


class Backend(Protocol):
    async def generate(self, request: GenRequest) -> Generation: ...

    async def aclose(self) -> None: ...


def resolve_api_key(cfg: ModelConfig) -> str | None:
    """From the configured environment variable, else a Prefect Secret block; never stored anywhere."""
    if cfg.api_key_env and os.environ.get(cfg.api_key_env):
        return os.environ[cfg.api_key_env]
    if cfg.api_key_secret_block:
        from prefect.blocks.system import Secret

        return Secret.load(cfg.api_key_secret_block).get()
    return None


def _retry_after_seconds(headers: object) -> float | None:
    value = getattr(headers, "get", lambda _k: None)("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        from email.utils import parsedate_to_datetime
        from datetime import datetime, timezone

        try:
            return max(0.0, (parsedate_to_datetime(value) - datetime.now(timezone.utc)).total_seconds())
        except (TypeError, ValueError):
            return None


class OpenAIBackend:
    """Any OpenAI-compatible chat completions endpoint (OpenAI, DeepSeek, a vLLM or local server)."""

    def __init__(self, cfg: ModelConfig) -> None:
        import openai

        key = resolve_api_key(cfg)
        if key is None and cfg.base_url is None:
            raise PermanentLLMError(
                f"model {cfg.model!r}: no API key; set ${cfg.api_key_env} or api_key_secret_block")
        self.cfg = cfg
        self._openai = openai
        self._client = openai.AsyncOpenAI(
            api_key=key or "not-needed", base_url=cfg.base_url, max_retries=0, timeout=cfg.timeout_s)
        self.json_schema_supported = cfg.json_schema

    async def generate(self, request: GenRequest) -> Generation:
        kwargs: dict = dict(model=self.cfg.model, messages=request.messages, n=request.n,
                            temperature=request.temperature, top_p=request.top_p, max_tokens=request.max_tokens)
        if request.seed is not None:
            kwargs["seed"] = request.seed
        if request.repetition_penalty is not None:  # not in the OpenAI API: vLLM / SGLang / llama.cpp read it
            kwargs["extra_body"] = {"repetition_penalty": request.repetition_penalty}
        if request.tools:
            kwargs["tools"] = request.tools
            if request.tool_choice:
                kwargs["tool_choice"] = request.tool_choice
        if request.json_schema is not None and self.json_schema_supported:
            kwargs["response_format"] = {"type": "json_schema", "json_schema": {
                "name": request.schema_name, "schema": request.json_schema, "strict": False}}
        try:
            response = await self._client.chat.completions.create(**kwargs)
        except self._openai.APIStatusError as exc:
            if "response_format" in kwargs and _rejects_response_format(exc):
                self.json_schema_supported = False  # the endpoint has no structured output: prompt + parser
                raise TransientLLMError(f"HTTP {exc.status_code} from {self._client.base_url}: response_format "
                                        f"refused, asking again without it: {_short(exc)}", retry_after=0.0,
                                        counted=False) from exc
            if "tools" in kwargs and _rejects_tools(exc):
                raise ToolsRefused(f"HTTP {exc.status_code} from {self._client.base_url}: tool calling refused: "
                                   f"{_short(exc)}") from exc
            if isinstance(exc, self._openai.BadRequestError):
                raise PermanentLLMError(f"HTTP 400 from {self._client.base_url}: {exc}") from exc
            raise self._classify(exc) from exc
        except (self._openai.APITimeoutError, self._openai.APIConnectionError) as exc:
            cause = f" ({type(exc.__cause__).__name__}: {_short(exc.__cause__)})" if exc.__cause__ else ""
            raise TransientLLMError(f"{type(exc).__name__} at {self._client.base_url}: {exc}{cause}") from exc
        except (ValueError, TypeError, KeyError, AttributeError, self._openai.APIResponseValidationError) as exc:
            # a 200 whose body is not JSON, or not a chat completion: a broken proxy or an overloaded server
            raise TransientLLMError(f"malformed reply from {self._client.base_url}: "
                                    f"{type(exc).__name__}: {_short(exc)}") from exc
        return self._generation(response)

    def _generation(self, response: object) -> Generation:
        """A usable reply, else a transient error naming what is wrong with it (retried, recorded)."""
        where = self._client.base_url
        choices = getattr(response, "choices", None)
        if not isinstance(choices, list) or not choices:
            raise TransientLLMError(f"malformed reply from {where}: no choices in the response body")
        texts, reasons, calls = [], [], []
        for choice in choices:
            message = getattr(choice, "message", None)
            content = getattr(message, "content", None)
            tool_calls = _tool_calls(message)
            if (not isinstance(content, str) or not content.strip()) and not tool_calls:
                raise TransientLLMError(f"empty reply from {where}: choice {getattr(choice, 'index', '?')} has no "
                                        f"content (finish_reason {getattr(choice, 'finish_reason', None)!r})")
            texts.append(content if isinstance(content, str) else "")
            reasons.append(getattr(choice, "finish_reason", None) or "")
            calls.append(tool_calls)
        usage = getattr(response, "usage", None)
        return Generation(texts=texts, tokens_in=getattr(usage, "prompt_tokens", 0) or 0,
                          tokens_out=getattr(usage, "completion_tokens", 0) or 0, finish_reasons=reasons,
                          tool_calls=calls)

    def _classify(self, exc: Exception) -> Exception:
        status = getattr(exc, "status_code", 0)
        message = f"HTTP {status} from {self._client.base_url}: {exc}"
        if status == 429:
            return TransientLLMError(message, _retry_after_seconds(exc.response.headers), rate_limited=True)
        if status >= 500 or status in (408, 409):
            return TransientLLMError(message, _retry_after_seconds(exc.response.headers))
        return PermanentLLMError(message)

    async def aclose(self) -> None:
        await self._client.close()


def _rejects_response_format(exc: Exception) -> bool:
    """The endpoint refused the request's ``response_format``: a 400/422, or a 500 from servers that validate
    the body late (llama-cpp-python 0.3.x answers json_schema with HTTP 500 "Input should be 'text' or
    'json_object'")."""
    return getattr(exc, "status_code", 0) in (400, 422, 500) and "response_format" in str(exc)


def _rejects_tools(exc: Exception) -> bool:
    """The endpoint refused the request's ``tools`` (no tool calling): a 400/422/500 that names them."""
    text = str(exc).lower()
    return getattr(exc, "status_code", 0) in (400, 422, 500) and ("tool" in text or "function" in text)


def _tool_calls(message: object) -> list[ToolCall]:
    """The function calls of a reply message (other kinds of tool call are not ours to run)."""
    calls = []
    for i, call in enumerate(getattr(message, "tool_calls", None) or []):
        function = getattr(call, "function", None)
        name = getattr(function, "name", None)
        if not name:
            continue
        arguments = getattr(function, "arguments", None)
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {})
        calls.append(ToolCall(getattr(call, "id", None) or f"call_{i}", str(name), arguments))
    return calls


def _short(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def make_backend(cfg: ModelConfig) -> Backend:
    if cfg.backend == "openai":
        return OpenAIBackend(cfg)
    if cfg.backend == "transformers":  # local engines: imported here so the core install needs no torch
        from clgrpo.llm.transformers_backend import TransformersBackend

        return TransformersBackend(cfg)
    if cfg.backend == "vllm":
        from clgrpo.llm.vllm_backend import VLLMBackend

        return VLLMBackend(cfg)
    raise PermanentLLMError(f"unknown backend {cfg.backend!r}")
