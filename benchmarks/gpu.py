"""GPU figures for the local paths, on one CUDA device: the numeric LoRA step (``clgrpo.models.hybrid``) with gradient
checkpointing on, off and ``auto``, and the transformers engine (``clgrpo.llm.transformers_backend``: load with
warm-up, first request, batches of 16 / 64 / its own size) against plain ``model.generate`` on the same model.

No weights can be downloaded on a GPU machine here, so the model is a random one shaped like
Qwen2.5-0.5B-Instruct (speed and memory depend on the shape, not on the values), with a small byte-level BPE
tokenizer trained on the spot and padded to the model's vocabulary. A random model rarely emits its
end-of-sequence token, so every row generates its full ``--max-tokens``; tokens are counted, not assumed.

    python benchmarks/gpu.py --out runs/bench-gpu                # on a CUDA machine: ~3 minutes on an H100
    python benchmarks/gpu.py --shape tiny --device cpu --out /tmp/g   # the same code path on CPU (~3 min)
    python benchmarks/gpu.py --report runs/bench-gpu/gpu.json      # the figures into benchmarks/REPORT.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the project, and sibling benchmark modules when imported

from report_block import write_block  # noqa: E402

REPORT_BEGIN, REPORT_END = "<!-- gpu:begin -->", "<!-- gpu:end -->"
GIB = 1 << 30
SHAPES = {  # Qwen2.5-0.5B-Instruct's config.json, and a tiny one for checking the path on CPU
    "qwen2.5-0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=4096, max_position_embeddings=4096, tie_word_embeddings=True,
    ),
}  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = "how many whole numbers are there from to inclusive count the answer boxed lesson step check".split()


def corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS + [str(rng.randint(0, 999))]) for _ in range(24)) for _ in range(400)]


def build_model(folder: Path, shape: str, seed: int = 0) -> Path:
    """A random Qwen2 model of ``shape`` with a chat tokenizer, saved as an HF folder."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus(seed), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(
        **SHAPES[shape], eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def gpu_memory(device: str) -> dict[str, float]:
    import torch

    if not device.startswith("cuda"):
        return {}
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return {"free_gib": free / GIB, "total_gib": total / GIB}


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_gib(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / GIB if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# --- the numeric step ------------------------------------------------------------------------------------
class Decisions(logging.Handler):
    """Collects the numeric step's logged gradient-checkpointing decision."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "gradient checkpointing" in record.getMessage():
            self.lines.append(record.getMessage())


def examples(n: int, prompt_tokens: int, completion_tokens: int, vocab: int, seed: int) -> list[Any]:
    from clgrpo.models.hybrid import Example

    rng = random.Random(seed)
    out = []
    for i in range(n):  # groups of 8 with advantages of both signs, as a GRPO step's groups give
        ids = [rng.randrange(3, vocab) for _ in range(prompt_tokens + completion_tokens)]
        out.append(Example(ids[:prompt_tokens], ids[prompt_tokens:], 1.0 if i % 8 < 3 else -0.6))
    return out


def numeric_step(folder: Path, device: str, rows: int, checkpointing: bool | str, args: argparse.Namespace) -> dict:
    """One fresh load and one numeric step over ``args.completions`` stored-shaped completions."""
    from clgrpo.models.hybrid import load_trainable, train_adapter
    from clgrpo.models.weights import ModelLocation
    from schemas.config import HybridConfig

    settings = HybridConfig(enabled=True, batch_rows=rows, gradient_checkpointing=checkpointing)
    reset_peak(device)
    model, tokenizer = load_trainable(ModelLocation(folder), device, settings, None)
    batch = examples(args.completions, args.prompt_tokens, args.completion_tokens, len(tokenizer), args.seed)
    handler = Decisions()
    logging.getLogger("clgrpo.hybrid").addHandler(handler)
    sync(device)
    t0 = time.monotonic()
    outcome = train_adapter(model, batch, settings, tokenizer.pad_token_id)
    sync(device)
    seconds = time.monotonic() - t0
    logging.getLogger("clgrpo.hybrid").removeHandler(handler)
    peak = peak_gib(device)
    del model
    return {
        "batch_rows": rows,
        "setting": checkpointing,
        "decision": handler.lines[-1] if handler.lines else "",
        "completions": outcome.rows_used,
        "tokens_per_completion": args.prompt_tokens + args.completion_tokens,
        "seconds": round(seconds, 2),
        "s_per_100": round(100 * seconds / max(outcome.rows_used, 1), 2),
        "peak_gib": None if peak is None else round(peak, 2),
        "loss_before": outcome.loss_before,
        "loss_after": outcome.loss_after,
    }


# --- the transformers engine -----------------------------------------------------------------------------
def prompts(n: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    lessons = " ".join(f"[E{i}] " + " ".join(rng.choice(WORDS) for _ in range(12)) for i in range(5))
    return [
        [
            {"role": "system", "content": f"You are a careful math solver. {lessons}"},
            {
                "role": "user",
                "content": f"How many whole numbers from {rng.randint(1, 500)} to {rng.randint(501, 999)}?",
            },
        ]
        for _ in range(n)
    ]


async def engine_batch(backend: Any, batch: list[list[dict[str, str]]], max_tokens: int, seed: int) -> dict:
    from clgrpo.llm.backends import GenRequest

    stats = backend.engine.stats
    before = (stats.batches, stats.tokens_out, stats.tokens_in)
    t0 = time.monotonic()
    results = await asyncio.gather(
        *(
            backend.generate(GenRequest(messages=m, n=1, temperature=0.7, max_tokens=max_tokens, seed=seed + i))
            for i, m in enumerate(batch)
        )
    )
    seconds = time.monotonic() - t0
    out_tokens = sum(r.tokens_out for r in results)
    return {
        "requests": len(batch),
        "engine_batches": stats.batches - before[0],
        "tokens_out": out_tokens,
        "tokens_in": stats.tokens_in - before[2],
        "seconds": round(seconds, 2),
        "tokens_per_s": round(out_tokens / seconds, 1),
    }


def plain_generate(model: Any, tokenizer: Any, batch: list[list[dict[str, str]]], max_tokens: int, device: str) -> dict:
    """The same prompts in one ``model.generate`` call (left padding, sampling), as a reference."""
    import torch

    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in batch]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    sync(device)
    t0 = time.monotonic()
    with torch.inference_mode():
        out = model.generate(
            **enc, max_new_tokens=max_tokens, do_sample=True, temperature=0.7, pad_token_id=tokenizer.pad_token_id
        )
    sync(device)
    seconds = time.monotonic() - t0
    new = out[:, enc["input_ids"].shape[1] :]
    tokens = int((new != tokenizer.pad_token_id).sum())
    return {"requests": len(batch), "tokens_out": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip


def engine_figures(folder: Path, device: str, args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clgrpo.llm.transformers_backend import TransformersBackend
    from schemas.config import ModelConfig

    cfg = ModelConfig(backend="transformers", model="random-qwen2.5-0.5b", model_path=str(folder), device=device)
    backend = TransformersBackend(cfg)
    t0 = time.monotonic()
    backend.engine.load()
    load_s = time.monotonic() - t0
    out: dict[str, Any] = {"load_s_with_warm_up": round(load_s, 2), "auto_batch_rows": backend.engine.max_rows}

    async def measure() -> None:
        out["first_request"] = await engine_batch(backend, prompts(1, 1), args.max_tokens, 1)
        for size in args.batches:
            out[f"engine_{size}"] = await engine_batch(backend, prompts(size, size), args.max_tokens, 100)

    asyncio.run(measure())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, backend_dtype(device))).to(device).eval()
    plain_generate(model, tokenizer, prompts(2, 0), 8, device)  # its own warm-up
    for size in args.batches:
        out[f"generate_{size}"] = plain_generate(model, tokenizer, prompts(size, size), args.max_tokens, device)
        out[f"ratio_{size}"] = round(out[f"engine_{size}"]["tokens_per_s"] / out[f"generate_{size}"]["tokens_per_s"], 2)
    return out


def backend_dtype(device: str) -> str:
    from clgrpo.llm.transformers_backend import pick_dtype

    return pick_dtype("auto", device)


# --- report ----------------------------------------------------------------------------------------------
def report_text(figures: dict) -> str:
    env = figures["environment"]
    memory = f" ({env['total_gib']:.0f} GiB)" if "total_gib" in env else ""
    lines = [
        REPORT_BEGIN,
        f"Measured with `python benchmarks/gpu.py` on {env['device_name']}{memory}, torch {env['torch']}, "
        f"transformers {env['transformers']}, peft {env['peft']}; a random model shaped like {env['shape']}.",
    ]
    if figures["numeric"]:
        lines += [
            "",
            f"Numeric step (bf16, LoRA r=8, 1 epoch): {figures['completions']} completions of "
            f"{figures['tokens_per_completion']} tokens, each configuration in a fresh load.",
            "",
            "| batch rows | gradient checkpointing | decided | s | s per 100 completions | peak GiB |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for row in figures["numeric"]:
            decided = row["decision"].split("gradient checkpointing ", 1)[-1]
            lines.append(
                f"| {row['batch_rows']} | {row['setting']} | {decided} | {row['seconds']} | {row['s_per_100']} "
                f"| {row['peak_gib']} |"
            )
    eng = figures.get("engine")
    if eng:
        first = eng["first_request"]
        lines += [
            "",
            f"Transformers engine: loaded (warm-up included) in {eng['load_s_with_warm_up']} s; the first request "
            f"then generated {first['tokens_out']} tokens in {first['seconds']} s; its own batch size here: "
            f"{eng['auto_batch_rows']} rows. {figures['max_tokens']} new tokens per request, sampled at 0.7.",
            "",
            "| requests at once | engine tokens/s | model.generate tokens/s | engine / generate | engine batches |",
            "| --- | --- | --- | --- | --- |",
        ]
        for size in figures["batches"]:
            e, g = eng[f"engine_{size}"], eng[f"generate_{size}"]
            lines.append(
                f"| {size} | {e['tokens_per_s']} | {g['tokens_per_s']} | {eng[f'ratio_{size}']} "
                f"| {e['engine_batches']} |"
            )
    lines.append(REPORT_END)
    return "\n".join(lines)


def write_report(figures: dict) -> None:
    heading = "GPU: the numeric step and the transformers engine on an H100"
    write_block(report_text(figures), REPORT_BEGIN, REPORT_END, heading)


def environment(device: str, shape: str) -> dict:
    import peft
    import torch
    import transformers

    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    return {"device_name": name, "torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "shape": shape, **gpu_memory(device)}  # fmt: skip


def numeric_setting(text: str) -> tuple[int, bool | str]:
    rows, _, setting = text.partition(":")
    return int(rows), {"true": True, "false": False}.get(setting, setting)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench-gpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--completions", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--completion-tokens", type=int, default=230)
    ap.add_argument("--max-tokens", type=int, default=256, help="generated tokens per request (engine figures)")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--numeric",
        nargs="+",
        type=numeric_setting,
        default=[(8, "auto"), (64, True), (64, False), (64, "auto")],
        metavar="ROWS:CHECKPOINTING",
        help="numeric step configurations: batch rows and true / false / auto",
    )
    ap.add_argument("--parts", nargs="+", choices=["numeric", "engine"], default=["numeric", "engine"])
    ap.add_argument("--report", metavar="JSON", help="write the figures of a finished run into benchmarks/REPORT.md")
    args = ap.parse_args()
    if args.report:
        write_report(json.loads(Path(args.report).read_text()))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = build_model(out / "model", args.shape, args.seed)
    figures: dict[str, Any] = {
        "environment": environment(args.device, args.shape),
        "completions": args.completions,
        "tokens_per_completion": args.prompt_tokens + args.completion_tokens,
        "batches": args.batches,
        "max_tokens": args.max_tokens,
        "numeric": [],
    }
    if "numeric" in args.parts:
        warm = argparse.Namespace(**{**vars(args), "completions": 8})
        numeric_step(folder, args.device, 8, False, warm)  # CUDA context, kernels: not in the figures
        for rows, setting in args.numeric:
            figures["numeric"].append(numeric_step(folder, args.device, rows, setting, args))
            print(json.dumps(figures["numeric"][-1]), flush=True)
            (out / "gpu.json").write_text(json.dumps(figures, indent=1))
    if "engine" in args.parts:
        figures["engine"] = engine_figures(folder, args.device, args)
        print(json.dumps(figures["engine"]), flush=True)
    (out / "gpu.json").write_text(json.dumps(figures, indent=1))
    print(report_text(figures))


if __name__ == "__main__":
    main()
