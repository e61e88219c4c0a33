"""The vLLM backend: an in-process vLLM engine (``vllm.LLM``) on this machine's GPU(s).

Needs the ``gpu`` extra (``pip install 'clgrpo[gpu]'``, vLLM >= 0.12); imported only when this backend is
used. Requests go through the shared ``Engine`` worker (``clgrpo.llm.local``): the requests waiting at that
moment become one ``LLM.chat`` call with one ``SamplingParams`` each (``n=G`` samples per prompt), so vLLM
schedules them together and prefix caching (on) reuses the shared system prompt + library prefix. JSON
replies use vLLM's structured outputs (``StructuredOutputsParams(json=schema)``). The chat template is the
model's own (``LLM.chat`` applies it).

``model_path`` may be a local HF folder, ``embedded`` (the cached SmolLM2 folder) or a hub id; the device is
vLLM's own choice (``device`` is not used). Extra ``vllm.LLM`` arguments (``gpu_memory_utilization``,
``tensor_parallel_size``, ``max_model_len``, ...) come from ``engine_options``.

``adapter`` (a LoRA folder, e.g. one the numeric step of hybrid learning saved) is served with vLLM's multi-LoRA
support: the engine starts with ``enable_lora=True`` and ``max_lora_rank`` from the adapter's config, and every
chat call passes ``lora_request=LoRARequest("clgrpo-adapter", 1, folder)``; the base weights are not merged.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from clgrpo.llm.backends import Generation, GenRequest, PermanentLLMError
from clgrpo.llm.local import Engine, Result, get_engine
from clgrpo.models.weights import EMBEDDED, ModelError, resolve_model_path
from schemas.config import ModelConfig

DEFAULT_MAX_ROWS = 4096  # vLLM schedules within a call itself; this only bounds one call's size


class VLLMBackend:
    def __init__(self, cfg: ModelConfig) -> None:
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise PermanentLLMError(
                "backend 'vllm' needs vLLM, which is not installed: pip install 'clgrpo[gpu]' on a machine with a "
                "GPU that vLLM supports (or use backend 'transformers', or a vLLM server with backend 'openai')"
            ) from exc
        model = model_reference(cfg.model_path or cfg.model)
        options = {"enable_prefix_caching": True, "dtype": cfg.dtype, **cfg.engine_options}
        if cfg.seed is not None:
            options.setdefault("seed", cfg.seed)
        adapter = lora_folder(cfg.adapter)
        if adapter is not None:
            options.update(enable_lora=True)
            options.setdefault("max_lora_rank", lora_rank(adapter))
        key = ("vllm", model, json.dumps(options, sort_keys=True, default=str), adapter)
        self.engine = get_engine(
            key,
            lambda: Engine(
                f"vllm:{Path(model).name}",
                load=partial(load_engine, model, options),
                run_batch=partial(run_batch, lora=adapter),
                max_rows=cfg.max_batch_rows or DEFAULT_MAX_ROWS,
            ),
        )

    async def generate(self, request: GenRequest) -> Generation:
        return await self.engine.generate(request)

    async def aclose(self) -> None:
        """The engine stays in the process registry for the next client."""


def model_reference(spec: str) -> str:
    """A local folder (``embedded`` resolved) or, when no such path exists, a hub id for vLLM to fetch."""
    if spec == EMBEDDED or Path(spec).expanduser().exists():
        try:
            return str(resolve_model_path(spec))
        except ModelError as exc:
            raise PermanentLLMError(str(exc)) from exc
    return spec


def lora_folder(adapter: str | None) -> str | None:
    """``policy.adapter`` as a folder (a RUN:STEP reference is resolved by the flow before it gets here)."""
    if adapter is None:
        return None
    folder = Path(adapter).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise PermanentLLMError(f"adapter {adapter}: not a LoRA folder (no adapter_config.json)")
    return str(folder.resolve())


def lora_rank(folder: str) -> int:
    return int(json.loads((Path(folder) / "adapter_config.json").read_text()).get("r", 16))


def lora_request(folder: str) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest("clgrpo-adapter", 1, folder)


def load_engine(model: str, options: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(model=model, **options)


def sampling_params(request: GenRequest) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    structured = StructuredOutputsParams(json=request.json_schema) if request.json_schema is not None else None
    return SamplingParams(
        n=request.n,
        temperature=request.temperature,
        top_p=request.top_p,
        max_tokens=request.max_tokens,
        seed=request.seed,
        structured_outputs=structured,
        repetition_penalty=request.repetition_penalty or 1.0,
    )


def run_batch(llm: Any, requests: list[GenRequest], lora: str | None = None) -> list[Result]:
    """All waiting requests in one ``LLM.chat`` call; outputs come back in request order. ``lora``: every
    request uses that adapter."""
    extra = {"lora_request": lora_request(lora)} if lora is not None else {}
    outputs = llm.chat(
        [r.messages for r in requests], sampling_params=[sampling_params(r) for r in requests], use_tqdm=False, **extra
    )
    return [
        Generation(
            texts=[c.text for c in out.outputs],
            tokens_in=len(out.prompt_token_ids or []),
            tokens_out=sum(len(c.token_ids) for c in out.outputs),
            finish_reasons=[c.finish_reason or "" for c in out.outputs],
        )
        for out in outputs
    ]
