"""Model backends behind the one LLM client.

A backend turns one request into texts and token counts and classifies failures as transient (retried by
the client) or permanent. It does no retries, no concurrency control and no accounting of its own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from clgrpo.llm.errors import CountRefused, PermanentLLMError, SchemaRefused, ToolsRefused, TransientLLMError
from clgrpo.llm.transport import dumps_text, loads, make_transport
from clgrpo.models.api_keys import resolve_api_key
from clgrpo.models.retry import RATE_LIMITED, is_retryable_status, retry_after_seconds
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
    system_fingerprint: str | None = None  # the provider's, where it sends one


class Backend(Protocol):
    async def generate(self, request: GenRequest) -> Generation: ...

    async def aclose(self) -> None: ...


CHAT_PATH = "chat/completions"
DEFAULT_BASE_URL = "https://api.openai.com/v1"

# (base_url, model) pairs whose endpoint refused response_format in this process: every backend and client of
# the process asks them without it, and learner prompts show their example reply again
_SCHEMA_REFUSED: set[tuple[str, str]] = set()


def _endpoint_key(cfg: ModelConfig) -> tuple[str, str]:
    return (cfg.base_url or DEFAULT_BASE_URL).rstrip("/"), cfg.model


def schema_refused(cfg: ModelConfig) -> bool:
    """Whether ``cfg``'s endpoint refused a JSON schema (``response_format``) in this process."""
    return cfg.backend == "openai" and _endpoint_key(cfg) in _SCHEMA_REFUSED


class OpenAIBackend:
    """Any OpenAI-compatible chat completions endpoint (OpenAI, DeepSeek, a vLLM or local server).

    Sends the body the openai SDK would send (``POST {base_url}/chat/completions``, bearer key) over one pooled
    aiohttp session per event loop and reads the reply as plain JSON (orjson): a tenth of the SDK's CPU per call
    at high concurrency (``benchmarks/client_cpu.py``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        key = resolve_api_key(cfg)
        if key is None and cfg.base_url is None:
            raise PermanentLLMError(f"model {cfg.model!r}: no API key; set ${cfg.api_key_env} or api_key_secret_block")
        self.cfg = cfg
        self.base_url = (cfg.base_url or DEFAULT_BASE_URL).rstrip("/") + "/"
        self._transport = make_transport(self.base_url, key or "not-needed", cfg.timeout_s)
        self.json_schema_supported = cfg.json_schema and not schema_refused(cfg)

    def body(self, request: GenRequest) -> dict[str, Any]:
        """The chat completions request body (what the openai SDK sends for the same arguments)."""
        body: dict[str, Any] = {
            "messages": request.messages,
            "model": self.cfg.model,
            "max_tokens": request.max_tokens,
            "n": request.n,
            "temperature": request.temperature,
            "top_p": request.top_p,
        }
        if request.seed is not None:
            body["seed"] = request.seed
        if request.tools:
            body["tools"] = request.tools
            if request.tool_choice:
                body["tool_choice"] = request.tool_choice
        if request.json_schema is not None and self.json_schema_supported:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": request.schema_name, "schema": request.json_schema, "strict": False},
            }
        if request.repetition_penalty is not None:  # not in the OpenAI API: vLLM / SGLang / llama.cpp read it
            body["repetition_penalty"] = request.repetition_penalty
        return body

    async def generate(self, request: GenRequest) -> Generation:
        body = self.body(request)
        status, headers, data = await self._transport.post(CHAT_PATH, body)
        if status >= 400:
            raise self._status_error(status, headers, data, body)
        try:
            reply = loads(data)
        except ValueError as exc:  # a 200 whose body is not JSON: a broken proxy or an overloaded server
            raise TransientLLMError(
                f"malformed reply from {self.base_url}: {type(exc).__name__}: {_short(exc)}"
            ) from exc
        return generation(reply, self.base_url)

    def _status_error(self, status: int, headers: Any, data: bytes, body: dict) -> Exception:
        message = f"HTTP {status} from {self.base_url}: {_error_message(data)}"
        if "response_format" in body and _rejects_response_format(status, message):
            self.json_schema_supported = False  # the endpoint has no structured output: prompt + parser
            _SCHEMA_REFUSED.add(_endpoint_key(self.cfg))
            return SchemaRefused(
                f"HTTP {status} from {self.base_url}: response_format refused, asking again "
                f"without it: {_error_message(data)}",
                retry_after=0.0,
                counted=False,
            )
        if body.get("n", 1) > 1 and _rejects_n(status, message):
            return CountRefused(f"HTTP {status} from {self.base_url}: n={body['n']} refused: {_error_message(data)}")
        if "tools" in body and _rejects_tools(status, message):
            return ToolsRefused(f"HTTP {status} from {self.base_url}: tool calling refused: {_error_message(data)}")
        if status == RATE_LIMITED:
            return TransientLLMError(message, retry_after_seconds(headers), rate_limited=True)
        if is_retryable_status(status):
            return TransientLLMError(message, retry_after_seconds(headers))
        return PermanentLLMError(message)

    async def aclose(self) -> None:
        await self._transport.aclose()


def generation(reply: object, where: str) -> Generation:
    """A usable chat completion, else a transient error naming what is wrong with it (retried, recorded)."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(reply, dict) or not isinstance(choices, list) or not choices:
        raise TransientLLMError(f"malformed reply from {where}: no choices in the response body")
    texts, reasons, calls = [], [], []
    for i, choice in enumerate(choices):
        if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
            raise TransientLLMError(f"malformed reply from {where}: choice {i} has no message")
        message = choice["message"]
        content = message.get("content")
        tool_calls = _tool_calls(message.get("tool_calls"))
        if (not isinstance(content, str) or not content.strip()) and not tool_calls:
            raise TransientLLMError(
                f"empty reply from {where}: choice {choice.get('index', i)} has no content "
                f"(finish_reason {choice.get('finish_reason')!r})"
            )
        texts.append(content if isinstance(content, str) else "")
        reasons.append(choice.get("finish_reason") or "")
        calls.append(tool_calls)
    usage = reply.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    tokens_out = _count(usage.get("completion_tokens"))
    if len(texts) > 1 and "timings" in reply:  # llama.cpp's server: usage counts the first choice only
        tokens_out = _with_other_choices(tokens_out, texts)
    return Generation(
        texts=texts,
        tokens_in=_count(usage.get("prompt_tokens")),
        tokens_out=tokens_out,
        finish_reasons=reasons,
        tool_calls=calls,
        system_fingerprint=fingerprint if isinstance(fingerprint := reply.get("system_fingerprint"), str) else None,
    )


def _with_other_choices(first: int, texts: list[str]) -> int:
    """The completion tokens of every choice of a llama.cpp server reply, whose ``usage`` counts only choice 0
    (the others run in child slots): each other choice estimated at choice 0's tokens per character."""
    if not texts[0]:
        return first * len(texts)
    return first + round(first / len(texts[0]) * sum(len(t) for t in texts[1:]))


def _count(value: object) -> int:
    """A token count from ``usage``; anything but a non-negative integer (a missing or odd field) is 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _error_message(data: bytes) -> str:
    """The error an endpoint sent: its JSON ``error.message`` (OpenAI's shape), else the body's start."""
    try:
        payload = loads(data)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return _short(message if isinstance(message, str) else dumps_text(message), 300)
    return _short(data.decode("utf-8", "replace") or "(empty body)", 300)


def _rejects_response_format(status: int, message: str) -> bool:
    """The endpoint refused the request's ``response_format``: a 400/422, or a 500 from servers that validate
    the body late (llama-cpp-python 0.3.x answers json_schema with HTTP 500 "Input should be 'text' or
    'json_object'")."""
    return status in (400, 422, 500) and "response_format" in message


# the field named in a refusal: 'n' / "n" / `n` quoted, or "n must ..." (llama-server: "Field 'n': Value must be
# between 1 <= value <= 8, but got 10")
_NAMES_N = re.compile(r"""['"`]n['"`]|\bn (?:must|should|is|cannot)\b""")


def _rejects_n(status: int, message: str) -> bool:
    """The endpoint refused the request's ``n`` (too many choices for it): a 400/422 that names the field."""
    return status in (400, 422) and _NAMES_N.search(message) is not None


def _rejects_tools(status: int, message: str) -> bool:
    """The endpoint refused the request's ``tools`` (no tool calling): a 400/422/500 that names them."""
    text = message.lower()
    return status in (400, 422, 500) and ("tool" in text or "function" in text)


def _tool_calls(raw: object) -> list[ToolCall]:
    """The function calls of a reply message (other kinds of tool call are not ours to run)."""
    calls = []
    for i, call in enumerate(raw if isinstance(raw, list) else []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not function.get("name"):
            continue
        name = function["name"]
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {})
        calls.append(ToolCall(call.get("id") or f"call_{i}", str(name), arguments))
    return calls


def _short(what: BaseException | str, limit: int = 200) -> str:
    text = str(what).replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."
