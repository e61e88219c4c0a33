"""The numeric GRPO step of hybrid learning: a LoRA adapter (peft) of the local policy trained on stored
completions and their group advantages, without generating anything.

The objective is GRPO's clipped surrogate over the sampled completion tokens (Shao et al. 2024, eq. 3):
for completion i with advantage A_i and token t, ratio = pi(t) / pi_old(t), where pi_old is the adapter before
this update (its log-probs are taken once, before the first optimizer step); the token's loss is
``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) + kl_coef * KL``, with the k3 estimator of the KL to the
frozen base (the same model with the adapter disabled). Token losses are averaged per completion, then over
completions. TRL's GRPOTrainer is not used: it samples its own completions inside ``train()``, and here the
completions are the ones the rollout stage already sampled and the verifier already graded.

The completion tokens are the stored reply text tokenized again (plus the end-of-sequence token unless the
reply was cut at max_tokens): the rollout keeps text, not token ids. torch and peft are imported here only.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clgrpo.models.weights import ModelLocation, quiet_transformers
from schemas.config import HybridConfig
from schemas.records import NumericItem

log = logging.getLogger("clgrpo.hybrid")  # the name its log lines always had


class HybridError(RuntimeError):
    """The numeric step cannot run (a missing package, a model without a chat template)."""


@dataclass
class Example:
    prompt: list[int]
    completion: list[int]
    advantage: float


@dataclass
class TrainOutcome:
    rows_used: int
    loss_before: float | None
    loss_after: float | None
    logprob_change_pos: float | None
    logprob_change_neg: float | None
    device: str
    seconds: float


def require_peft() -> None:
    try:
        import peft  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        raise HybridError("hybrid learning needs torch and peft: pip install 'clgrpo[local]'") from exc


# --- model -----------------------------------------------------------------------------------------------
def training_device(requested: str) -> str:
    """The policy's device setting for training; a CPU fallback is logged (it works, slowly)."""
    import torch

    cuda = torch.cuda.is_available()
    if requested == "auto":
        requested = "cuda" if cuda else "cpu"
    if requested == "cpu":
        log.warning("numeric_update on cpu: %s", "policy.device is cpu" if cuda else "no CUDA device")
    return requested


def load_trainable(location: ModelLocation, device: str, settings: HybridConfig, parent: str | None) -> tuple[Any, Any]:
    """(peft model, tokenizer): the policy's weights frozen, a LoRA adapter trainable: ``parent``'s (the
    previous step's adapter) when given, else a fresh one (B = 0: the same outputs as the base)."""
    require_peft()
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    kwargs = {"gguf_file": location.gguf_file} if location.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(location.folder, **kwargs)
    dtype = torch.bfloat16 if device.startswith("cuda") and torch.cuda.is_bf16_supported() else torch.float32
    model_on_cpu = AutoModelForCausalLM.from_pretrained(location.folder, dtype=dtype, **kwargs)
    base = model_on_cpu.to(device)  # type: ignore[arg-type]  # transformers' wrapped .to() hides its signature
    if parent is not None:
        model = PeftModel.from_pretrained(base, parent, is_trainable=True)
    else:  # a fresh adapter's A matrices are drawn at random: seeded, so a rerun of the step learns the same one
        torch.manual_seed(settings.seed)
        model = get_peft_model(
            base,
            LoraConfig(
                r=settings.rank,
                lora_alpha=settings.alpha,  # type: ignore[arg-type]  # peft says int; scaling is alpha / r
                lora_dropout=settings.dropout,
                target_modules=settings.target_modules,
                task_type="CAUSAL_LM",
            ),
        )
    return model, tokenizer


# --- gradient checkpointing: memory against speed, chosen for the device ------------------------------------
GIB = 1 << 30
CHECKPOINT_SHARE = 0.5  # "auto" on CUDA: checkpoint when the activations would take more of the free memory


# What one token of a batch keeps for the backward pass without checkpointing, fitted on an H100 (Qwen2.5-0.5B
# shape, bf16, 64 and 8 rows of 330 tokens: peak 55.7 and 7.8 GiB over 0.9 GiB of weights; 34.1 GiB with
# checkpointing; benchmarks/REPORT.md "GPU"): per layer, the attention's and MLP's inputs and outputs in the
# model's dtype, so that the gradient reaches the LoRA matrices of earlier layers; over the vocabulary, the
# model's logits, their float32 copy and log-softmax, and a share of their gradients.
HIDDEN_SAVED_PER_LAYER = 6  # values of the hidden size per token and layer
INTERMEDIATE_SAVED_PER_LAYER = 4  # values of the MLP's intermediate size per token and layer
VOCAB_EXTRA_BYTES = 9  # per token and vocabulary entry, beside the logits in the model's dtype


def activation_bytes(model_config: Any, rows: int, tokens: int, dtype_bytes: int) -> int:
    """The estimated peak that one batch's backward pass adds without checkpointing (constants above)."""
    intermediate = getattr(model_config, "intermediate_size", None) or 4 * model_config.hidden_size  # GPT-2: none
    per_layer = HIDDEN_SAVED_PER_LAYER * model_config.hidden_size + INTERMEDIATE_SAVED_PER_LAYER * intermediate
    layers = dtype_bytes * per_layer * model_config.num_hidden_layers
    return rows * tokens * (layers + (dtype_bytes + VOCAB_EXTRA_BYTES) * model_config.vocab_size)


def checkpointing_choice(setting: bool | str, device: str, free_bytes: int | None, need_bytes: int) -> tuple[bool, str]:
    """Whether to recompute activations in the backward pass, with the reason in words."""
    if isinstance(setting, bool):
        return setting, "hybrid.gradient_checkpointing"
    if not device.startswith("cuda"):
        return True, f"on {device}: memory before speed"
    if free_bytes is None:
        return True, "free GPU memory unknown"
    on = need_bytes > CHECKPOINT_SHARE * free_bytes
    side = "more" if on else "not more"
    return on, f"activations ~{need_bytes / GIB:.1f} GiB, {side} than half of the {free_bytes / GIB:.1f} GiB free"


def free_gpu_bytes(device: str) -> int | None:
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def set_checkpointing(model: Any, examples: Sequence[Example], settings: HybridConfig) -> bool:
    """Decide (and log) gradient checkpointing for this step's batches on the model's device; enable it."""
    parameter = next(model.parameters())
    device = str(parameter.device)
    tokens = max((len(e.prompt) + len(e.completion) for e in examples), default=0)
    need = activation_bytes(model.config, min(settings.batch_rows, len(examples)), tokens, parameter.element_size())
    on, why = checkpointing_choice(settings.gradient_checkpointing, device, free_gpu_bytes(device), need)
    log.info("numeric_update: gradient checkpointing %s (%s)", "on" if on else "off", why)
    if on:  # recompute each layer's activations in the backward pass
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return on


def examples_from(items: Sequence[NumericItem], tokenizer: Any) -> list[Example]:
    """Prompt through the model's chat template (as the transformers backend builds it), completion tokens."""
    if not getattr(tokenizer, "chat_template", None):
        raise HybridError("the policy's tokenizer has no chat template")
    eos = tokenizer.eos_token_id
    out = []
    for item in items:
        text = tokenizer.apply_chat_template(item.messages, tokenize=False, add_generation_prompt=True)
        prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        completion = list(tokenizer(item.completion, add_special_tokens=False)["input_ids"])
        if not item.truncated and eos is not None:
            completion.append(eos)
        if completion:
            out.append(Example(prompt, completion, item.advantage))
    return out


# --- log-probs and the objective -------------------------------------------------------------------------
def completion_logprobs(model: Any, batch: Sequence[Example], pad_id: int) -> list[Any]:
    """Per example, the log-probs of its completion tokens (a 1-D tensor, graph kept when grads are on)."""
    import torch

    device = next(model.parameters()).device
    width = max(len(e.prompt) + len(e.completion) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, e in enumerate(batch):  # right padding: positions start at 0 for every row
        seq = e.prompt + e.completion
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits.float()
    out = []
    for row, e in enumerate(batch):
        start, end = len(e.prompt), len(e.prompt) + len(e.completion)
        step_logits = logits[row, start - 1 : end - 1]  # position k predicts token k + 1
        targets = ids[row, start:end].to(device)
        out.append(step_logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0])
    return out


def grpo_loss(
    new: Sequence[Any],
    old: Sequence[Any],
    ref: Sequence[Any] | None,
    advantages: Sequence[float],
    clip_eps: float,
    kl_coef: float,
) -> Any:
    """The clipped GRPO surrogate (see the module notes), mean over tokens then over completions."""
    import torch

    losses = []
    for i, (lp, lp_old) in enumerate(zip(new, old)):
        ratio = torch.exp(lp - lp_old)
        a = advantages[i]
        surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a)
        token_loss = -surrogate
        if ref is not None and kl_coef > 0:
            delta = ref[i] - lp
            token_loss = token_loss + kl_coef * (torch.exp(delta) - delta - 1)
        losses.append(token_loss.mean())
    return torch.stack(losses).mean()


def _batches(examples: list[Example], size: int) -> list[list[Example]]:
    return [examples[i : i + size] for i in range(0, len(examples), size)]


def _logprobs(model: Any, examples: list[Example], size: int, pad_id: int, *, adapter: bool = True) -> list[Any]:
    import torch

    out: list[Any] = []
    with torch.no_grad():
        for batch in _batches(examples, size):
            if adapter:
                out += [lp.detach() for lp in completion_logprobs(model, batch, pad_id)]
            else:
                with model.disable_adapter():
                    out += [lp.detach() for lp in completion_logprobs(model, batch, pad_id)]
    return out


def _full_loss(
    model: Any, examples: list[Example], old: list[Any], ref: list[Any] | None, settings: HybridConfig, pad_id: int
) -> tuple[float, list[Any]]:
    new = _logprobs(model, examples, settings.batch_rows, pad_id)
    loss = grpo_loss(new, old, ref, [e.advantage for e in examples], settings.clip_eps, settings.kl_coef)
    return float(loss), new


def _mean_change(before: list[Any], after: list[Any], examples: list[Example], sign: int) -> float | None:
    """Mean over completions with advantage of ``sign`` of (mean token log-prob after - before)."""
    changes = [float(a.mean() - b.mean()) for a, b, e in zip(after, before, examples) if e.advantage * sign > 0]
    return sum(changes) / len(changes) if changes else None


def train_adapter(model: Any, examples: list[Example], settings: HybridConfig, pad_id: int) -> TrainOutcome:
    """``settings.epochs`` passes of AdamW over shuffled mini-batches of the GRPO loss. ``loss_before`` is the
    loss at the old policy (ratio 1: minus the mean advantage, plus the KL of the parent adapter);
    ``loss_after`` the same batch's loss with the updated adapter."""
    import torch

    started = time.monotonic()
    device = str(next(model.parameters()).device)
    if not examples:
        return TrainOutcome(0, None, None, None, None, device, time.monotonic() - started)
    set_checkpointing(model, examples, settings)
    torch.manual_seed(settings.seed)
    old = _logprobs(model, examples, settings.batch_rows, pad_id)
    ref = _logprobs(model, examples, settings.batch_rows, pad_id, adapter=False) if settings.kl_coef > 0 else None
    loss_before, _ = _full_loss(model, examples, old, ref, settings, pad_id)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=settings.lr)
    order = list(range(len(examples)))
    model.train()
    for epoch in range(settings.epochs):
        random.Random(settings.seed * 7919 + epoch).shuffle(order)
        for rows in [order[i : i + settings.batch_rows] for i in range(0, len(order), settings.batch_rows)]:
            new = completion_logprobs(model, [examples[i] for i in rows], pad_id)
            loss = grpo_loss(
                new,
                [old[i] for i in rows],
                None if ref is None else [ref[i] for i in rows],
                [examples[i].advantage for i in rows],
                settings.clip_eps,
                settings.kl_coef,
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    loss_after, after = _full_loss(model, examples, old, ref, settings, pad_id)
    return TrainOutcome(
        len(examples),
        loss_before,
        loss_after,
        _mean_change(old, after, examples, 1),
        _mean_change(old, after, examples, -1),
        device,
        time.monotonic() - started,
    )


def save_adapter(model: Any, folder: Path) -> None:
    """The adapter's safetensors + config into ``folder`` (created; its contents replaced)."""
    model.save_pretrained(str(folder), safe_serialization=True)
