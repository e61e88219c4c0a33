"""The transformers backend: a local model (HF folder or GGUF file) in this process, on cuda, mps or cpu.

One code path for every device: the device and dtype are detected (``auto``: cuda > mps > cpu; bf16/fp16 on
GPUs, fp32 on CPU). Requests go through a shared ``Engine`` (see ``clgrpo.llm.local``), which runs the
waiting requests in one ``generate`` call: the G samples of a request are G rows of that batch, and
requests sent together (the problems of a rollout chunk, the summaries of a step) are batched too.

Sampling is done by ``RowSampler``, each row from its own random stream seeded from the request (sample i of
a request with seed s uses s + i, as the client's single-request fallback does), so a seeded request gives the
same samples whether it runs alone or batched with others. Requests with a JSON schema are constrained with
llguidance (the grammar engine behind guidance, also a vLLM structured-output backend; pure CPU, no
dependencies): its token bitmask is applied to the logits of each generated token. Without llguidance the reply
is unconstrained and the client's tolerant parser copes.

torch and transformers are imported only when this backend is used.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from functools import partial
from typing import Any

from clgrpo.llm.backends import Generation, GenRequest, PermanentLLMError
from clgrpo.llm.local import Engine, Result, get_engine
from clgrpo.models.weights import ModelError, ModelLocation, quiet_transformers, resolve_model_path
from clgrpo.process import stopping
from clgrpo.process.runtime import auto_cpu_threads
from schemas.config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_MAX_ROWS = 32  # sequences per batch on CPU and MPS (and where the GPU's free memory is unknown)
ROW_TOKENS = 2048  # a row's prompt and completion, for sizing batches on a GPU
KV_SHARE = 0.6  # of the GPU memory free after loading, what the batch's KV cache and logits may take
MAX_AUTO_ROWS = 256


class TransformersBackend:
    def __init__(self, cfg: ModelConfig) -> None:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as exc:
            raise PermanentLLMError(
                "backend 'transformers' needs the local extra: pip install 'clgrpo[local]'"
            ) from exc
        try:
            location = resolve_model_path(cfg.model_path or cfg.model)
        except ModelError as exc:
            raise PermanentLLMError(str(exc)) from exc
        adapter = checked_adapter(cfg)
        device = pick_device(cfg.device)
        dtype = pick_dtype(cfg.dtype, device)
        key = ("transformers", str(location), device, dtype, adapter)
        name = f"{location.gguf_file or location.folder.name}{'+' + adapter if adapter else ''}"
        self.engine = get_engine(
            key,
            lambda: Engine(
                f"transformers:{name}@{device}",
                load=partial(load_model, location, device, dtype, cfg.cpu_threads, adapter),
                run_batch=run_batch,
                max_rows=cfg.max_batch_rows or DEFAULT_MAX_ROWS,
                rows_for=None if cfg.max_batch_rows else batch_rows,
            ),
        )

    async def generate(self, request: GenRequest) -> Generation:
        return await self.engine.generate(request)

    async def aclose(self) -> None:
        """The loaded model stays in the process registry for the next client."""


def checked_adapter(cfg: ModelConfig) -> str | None:
    """``policy.adapter`` as a folder trained on this model (a RUN:STEP reference is resolved by the flow that
    opened the run's database before it gets here)."""
    if cfg.adapter is None:
        return None
    from clgrpo.llm.adapters import AdapterError, check_adapter, resolve_adapter

    try:
        folder = resolve_adapter(cfg.adapter, None)
        check_adapter(folder, cfg)
    except AdapterError as exc:
        raise PermanentLLMError(str(exc)) from exc
    return folder


# --- device and dtype ------------------------------------------------------------------------------------


def pick_device(requested: str = "auto") -> str:
    import torch

    mps = getattr(torch.backends, "mps", None)
    has_mps = bool(mps and mps.is_available())
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if has_mps else "cpu"
    kind = requested.split(":", 1)[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise PermanentLLMError(f"device {requested!r} requested but torch sees no CUDA GPU")
    if kind == "mps" and not has_mps:
        raise PermanentLLMError("device 'mps' requested but torch has no MPS support here")
    if kind not in ("cpu", "cuda", "mps"):
        raise PermanentLLMError(f"unknown device {requested!r}: use auto, cpu, cuda, cuda:N or mps")
    return requested


def pick_dtype(requested: str, device: str) -> str:
    import torch

    if requested != "auto":
        return requested
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float16" if device == "mps" else "float32"


# --- the loaded model ------------------------------------------------------------------------------------


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    device: str
    eos_ids: frozenset[int]
    pad_id: int
    vocab_size: int  # width of the logits (may exceed the tokenizer's vocabulary)
    max_positions: int
    grammars: Grammars | None = None

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt through the model's own chat template, ending with the assistant's turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise PermanentLLMError("the model's tokenizer has no chat template")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def load_model(
    location: ModelLocation, device: str, dtype: str, cpu_threads: int | None, adapter: str | None = None
) -> LoadedModel:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device == "cpu":  # process-wide
        torch.set_num_threads(cpu_threads or auto_cpu_threads())
        log.info("torch uses %d CPU threads", torch.get_num_threads())
    kwargs = {"gguf_file": location.gguf_file} if location.gguf_file else {}
    if location.gguf_file:
        log.warning(
            "loading GGUF %s: transformers dequantizes it on every load; convert it once for fast loads", location
        )
    quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(location.folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(location.folder, dtype=getattr(torch, dtype), **kwargs)
    if adapter is not None:
        model = with_lora(model, adapter)
    model = model.to(device).eval()  # type: ignore[arg-type]  # transformers types .to() as a wrapper of from_pretrained
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    if not eos_ids:
        raise PermanentLLMError(f"{location}: the model defines no end-of-sequence token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    loaded = LoadedModel(
        model,
        tokenizer,
        device,
        frozenset(eos_ids),
        pad_id,
        vocab_size,
        getattr(model.config, "max_position_embeddings", None) or 1 << 30,
    )
    loaded.grammars = Grammars.create(tokenizer, vocab_size, sorted(eos_ids))
    if device.startswith("cuda"):
        warm_up(loaded)
    return loaded


def warm_up(loaded: LoadedModel) -> None:
    """One short generation at load (CUDA kernels, cuBLAS handles, allocator), so the first request does not
    pay for it and its timing means what the others' do."""
    import time

    import torch

    t0 = time.monotonic()
    ids = torch.tensor([[loaded.pad_id] * 16], device=loaded.device)
    with torch.inference_mode():
        loaded.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
            pad_token_id=loaded.pad_id,
        )  # fmt: skip
    log.info("warmed up on %s in %.1f s", loaded.device, time.monotonic() - t0)


def kv_bytes_per_row(model_config: Any, dtype_bytes: int, vocab_size: int, tokens: int = ROW_TOKENS) -> int:
    """A generating row's KV cache over ``tokens`` positions plus its float32 logits and sampling copies."""
    heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    return 2 * model_config.num_hidden_layers * heads * head_dim * dtype_bytes * tokens + 3 * 4 * vocab_size


def rows_that_fit(free_bytes: int | None, per_row: int) -> int:
    """Sequences per batch: as many as ``KV_SHARE`` of the free GPU memory holds (1 to ``MAX_AUTO_ROWS``);
    ``DEFAULT_MAX_ROWS`` when the free memory is unknown (CPU, MPS)."""
    if free_bytes is None:
        return DEFAULT_MAX_ROWS
    return max(1, min(MAX_AUTO_ROWS, int(free_bytes * KV_SHARE) // per_row))


def batch_rows(loaded: LoadedModel) -> int:
    """The batch size for this loaded model on its device (GPU: from the memory free after loading)."""
    import torch

    free = None
    if loaded.device.startswith("cuda"):
        free = int(torch.cuda.mem_get_info(torch.device(loaded.device))[0])
    parameter = next(loaded.model.parameters())
    per_row = kv_bytes_per_row(loaded.model.config, parameter.element_size(), loaded.vocab_size)
    return rows_that_fit(free, per_row)


def with_lora(model: Any, adapter: str) -> Any:
    """The model with the LoRA adapter merged into its weights (peft): generation runs at the base's speed."""
    try:
        from peft import PeftModel
    except ImportError as exc:
        raise PermanentLLMError("policy.adapter needs peft: pip install 'clgrpo[local]'") from exc
    log.info("loading LoRA adapter %s (merged into the weights)", adapter)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload()


# compact JSON as xgrammar wrote it before (any_whitespace=False): ", " and ": " between items, no other whitespace
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammars:
    """JSON-schema grammars for this tokenizer (llguidance): each schema is compiled once into a matcher, and
    every constrained row gets its own copy of it."""

    def __init__(self, llguidance: Any, tokenizer: Any) -> None:
        self._llg = llguidance
        self._tokenizer = tokenizer
        self._compiled: dict[str, Any] = {}

    @classmethod
    def create(cls, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> Grammars | None:
        try:
            import llguidance
            import llguidance.hf
        except ImportError:
            log.warning("llguidance is not installed: JSON replies are not constrained (the tolerant parser copes)")
            return None
        try:
            wrapped = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_ids)
        except ValueError as exc:  # only fast (Rust) tokenizers can be wrapped
            log.warning("no constrained decoding for this tokenizer: %s", exc)
            return None
        return cls(llguidance, wrapped)

    def matcher(self, schema: dict) -> Any | None:
        """A fresh matcher for ``schema``, or None when the schema cannot be compiled (an unsupported feature:
        the reply is then unconstrained and the tolerant parser copes)."""
        key = json.dumps(schema, sort_keys=True)
        if key not in self._compiled:
            self._compiled[key] = self._compile(key)
        compiled = self._compiled[key]
        return None if compiled is None else compiled.deep_copy()

    def _compile(self, schema: str) -> Any | None:
        matcher_type = self._llg.LLMatcher
        try:
            grammar = matcher_type.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except ValueError as exc:
            error = str(exc)
        else:
            matcher = matcher_type(self._tokenizer, grammar, log_level=0)
            error = matcher.get_error() if matcher.is_error() else ""
            if not error:
                return matcher
        log.warning("cannot compile the JSON schema for constrained decoding: %s", error)
        return None

    @staticmethod
    def advance(matcher: Any, token: int) -> None:
        """The grammar takes the token just generated (only allowed tokens are generated)."""
        matcher.consume_token(token)

    def apply(self, matcher: Any, row_scores: Any) -> None:
        """Mask, in place, the tokens the grammar does not allow next (``row_scores``: shape (1, vocab))."""
        import numpy as np
        import torch

        width = row_scores.shape[-1]
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)  # one bit per token, little-endian
        bits = np.unpackbits(words, bitorder="little")[:width]
        allowed = np.zeros(width, dtype=bool)  # logits past the grammar's vocabulary stay blocked
        allowed[: bits.shape[0]] = bits
        row_scores[0].masked_fill_(torch.from_numpy(~allowed).to(row_scores.device), float("-inf"))


# --- one batched generate --------------------------------------------------------------------------------


@dataclass
class Row:
    """One sequence of a batch: sample ``index`` of request ``request``."""

    request: int
    index: int
    prompt: list[int]
    limit: int  # max new tokens of this row
    temperature: float
    top_p: float
    seed: int | None
    matcher: Any | None = None
    repetition_penalty: float | None = None
    generator: random.Random | None = None  # the row's random stream, made at its first draw
    done: bool = False
    truncated: bool = False


class GenerationStopped(RuntimeError):
    """A stop signal arrived while a batch was generating."""


@dataclass
class RowSampler:
    """A logits processor that samples each row itself (temperature, top-p, its own random stream, grammar mask,
    own length limit) and returns scores that leave exactly the chosen token, so greedy decoding in
    ``generate`` takes it. Handles rows of different requests in one batch.

    The rows are sampled together (one softmax, one cumulative sum, one device sync per token): a row draws a
    uniform number from its own seeded stream and takes the token where the cumulative probability passes it
    (inverse CDF), so a row's tokens do not depend on the other rows of its batch. Only the grammar mask and the
    repetition penalty are applied row by row."""

    rows: list[Row]
    prompt_len: int  # padded prompt length
    eos_ids: frozenset[int]
    grammars: Grammars | None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        if stopping.stopping():  # a stop signal: end this batch now, not after max_new_tokens more tokens
            raise GenerationStopped("generation stopped by a signal")
        step = input_ids.shape[1] - self.prompt_len
        if step > 0:
            self._advance(input_ids[:, -1].tolist())
        end = min(self.eos_ids)
        chosen = [end] * len(self.rows)
        active = [i for i, row in enumerate(self.rows) if self._active(row, step)]
        if active:
            logits = scores[active].float()
            generated = input_ids[:, self.prompt_len :]
            for j, i in enumerate(active):
                self._shape(self.rows[i], logits[j : j + 1], step, generated[i])
            for i, token in zip(active, self._draw(logits, [self.rows[i] for i in active])):
                row = self.rows[i]
                row.done = token is None or token in self.eos_ids  # None: the grammar allows nothing more
                chosen[i] = end if token is None else token
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(len(chosen), device=scores.device), torch.tensor(chosen, device=scores.device)] = 0.0
        return out

    def _advance(self, last_tokens: list[int]) -> None:
        for row, token in zip(self.rows, last_tokens):
            if not row.done and row.matcher is not None:
                Grammars.advance(row.matcher, token)

    @staticmethod
    def _active(row: Row, step: int) -> bool:
        """Whether the row samples a token at this step (else it ends or has ended)."""
        if row.done:
            return False
        if step >= row.limit:
            row.done = row.truncated = True
            return False
        return True

    def _shape(self, row: Row, logits: Any, step: int, generated: Any) -> None:
        """The row's own changes to its (1, vocab) logits, in place: grammar mask, repetition penalty."""
        if row.matcher is not None and self.grammars is not None:
            self.grammars.apply(row.matcher, logits)
        if row.repetition_penalty and step > 0:
            logits[0] = _penalize_repeats(logits[0], generated, row.repetition_penalty)

    def _draw(self, logits: Any, rows: list[Row]) -> list[int | None]:
        """One token per row (None where every token is masked), sampled together."""
        import torch

        device = logits.device
        allowed = torch.isfinite(logits).any(-1)
        logits = torch.where(allowed[:, None], logits, torch.zeros_like(logits))
        temperature = torch.tensor([r.temperature for r in rows], device=device, dtype=logits.dtype)
        greedy = temperature <= 0
        scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
        top_p = [r.top_p for r in rows]
        if min(top_p) < 1.0:
            scaled = _top_p(scaled, torch.tensor(top_p, device=device, dtype=logits.dtype))
        cdf = scaled.softmax(-1).cumsum(-1)
        u = torch.tensor([_uniform(r) for r in rows], device=device, dtype=cdf.dtype)
        sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].contiguous(), right=True)[:, 0]
        token = torch.where(greedy, scaled.argmax(-1), sampled.clamp(max=cdf.shape[-1] - 1))
        tokens, ok = torch.stack([token, allowed.long()]).tolist()  # the one sync of the step
        return [t if a else None for t, a in zip(tokens, ok)]


UNIFORM_TOP = 1.0 - 2.0**-23  # keeps u * total strictly below the total in float32


def _uniform(row: Row) -> float:
    """The next number in [0, 1) of the row's own stream (seeded: seed + sample index)."""
    if row.generator is None:
        row.generator = random.Random(None if row.seed is None else row.seed + row.index)
    return row.generator.random() * UNIFORM_TOP


def _penalize_repeats(logits: Any, generated: Any, penalty: float) -> Any:
    """CTRL's repetition penalty over the tokens this row generated so far (as HF's
    RepetitionPenaltyLogitsProcessor, without the prompt): positive scores are divided, negative multiplied."""
    import torch

    seen = logits.gather(0, generated)
    return logits.scatter(0, generated, torch.where(seen > 0, seen / penalty, seen * penalty))


def _top_p(logits: Any, top_p: Any) -> Any:
    """Per row, keep the smallest set of tokens whose probability mass reaches its ``top_p`` (as HF's
    TopPLogitsWarper); rows with ``top_p`` 1 keep every token."""
    import torch

    ordered, order = torch.sort(logits, descending=True, dim=-1)
    probs = ordered.softmax(-1)
    drop = (probs.cumsum(-1) - probs >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False
    return logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))


def run_batch(loaded: LoadedModel, requests: list[GenRequest]) -> list[Result]:
    """One ``generate`` call for all rows of all requests that can run; per-request errors come back as
    exceptions in their slot."""
    results: list[Result | None] = [None] * len(requests)
    rows: list[Row] = []
    prompts: dict[int, int] = {}
    for qi, request in enumerate(requests):
        try:
            prompt = loaded.encode(request.messages)
        except PermanentLLMError as exc:
            results[qi] = exc
            continue
        except Exception as exc:  # noqa: BLE001 - a template that rejects these messages (any error type)
            results[qi] = PermanentLLMError(f"chat template failed: {type(exc).__name__}: {exc}")
            continue
        room = loaded.max_positions - len(prompt)
        if room <= 0:
            results[qi] = PermanentLLMError(
                f"prompt of {len(prompt)} tokens does not fit the model's context of {loaded.max_positions}"
            )
            continue
        prompts[qi] = len(prompt)
        for i in range(request.n):
            matcher = (
                loaded.grammars.matcher(request.json_schema)
                if (request.json_schema is not None and loaded.grammars is not None)
                else None
            )
            rows.append(
                Row(
                    qi,
                    i,
                    prompt,
                    min(request.max_tokens, room),
                    request.temperature,
                    request.top_p,
                    request.seed,
                    matcher,
                    request.repetition_penalty,
                )
            )
    if rows:
        for qi, generation in _generate(loaded, rows, prompts).items():
            results[qi] = generation
    return [r if r is not None else PermanentLLMError("no result") for r in results]


def _generate(loaded: LoadedModel, rows: list[Row], prompt_tokens: dict[int, int]) -> dict[int, Generation]:
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    width = max(len(r.prompt) for r in rows)
    input_ids = torch.tensor([[loaded.pad_id] * (width - len(r.prompt)) + r.prompt for r in rows])
    attention = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in rows])
    sampler = RowSampler(rows, width, loaded.eos_ids, loaded.grammars)
    config = GenerationConfig(
        max_new_tokens=max(r.limit for r in rows),
        do_sample=False,
        eos_token_id=sorted(loaded.eos_ids),
        pad_token_id=loaded.pad_id,
    )
    with torch.inference_mode():
        out = loaded.model.generate(
            input_ids=input_ids.to(loaded.device),
            attention_mask=attention.to(loaded.device),
            generation_config=config,
            logits_processor=LogitsProcessorList([sampler]),
        )
    generated = out[:, width:].tolist()
    by_request: dict[int, Generation] = {}
    for row, tokens in zip(rows, generated):
        length = next((k for k, t in enumerate(tokens) if t in loaded.eos_ids), len(tokens))
        stopped = length < len(tokens) and not row.truncated
        gen = by_request.setdefault(row.request, Generation(texts=[], tokens_in=prompt_tokens[row.request]))
        gen.texts.append(loaded.tokenizer.decode(tokens[:length], skip_special_tokens=True))
        gen.tokens_out += length
        gen.finish_reasons.append("stop" if stopped else "length")
    return by_request
