"""A tiny randomly initialised sentence-embedding folder built offline (no hub): a WordPiece tokenizer over a
small vocabulary (BERT-style ``[CLS] ... [SEP]``, lower-cased), a 2-layer BERT with hidden size 32, and the
sentence-transformers ``modules.json`` / ``1_Pooling/config.json`` / ``sentence_bert_config.json`` files."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = (
    "when adding numbers carry the tens digit you add capital of france is paris check units lesson "
    "answer problem multiply divide subtract fraction first then always write a an and or to in on at "
    "what how why 0 1 2 3 4 5 6 7 8 9 + - * / = . , ? !"
).split()
SUFFIXES = ["##s", "##ing", "##ed", "##er", "##ly"] + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
DIM = 32


def build_tiny_embedder(folder: Path, seed: int = 0, pooling: str = "mean", max_seq_length: int = 64) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    vocab = {
        tok: i for i, tok in enumerate(dict.fromkeys(SPECIALS + WORDS + list("abcdefghijklmnopqrstuvwxyz") + SUFFIXES))
    }
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.decoder = decoders.WordPiece()
    cls, sep = vocab["[CLS]"], vocab["[SEP]"]
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=wordpiece,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=128,
    )
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=DIM,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        pad_token_id=vocab["[PAD]"],
    )
    torch.manual_seed(seed)
    model = BertModel(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ]
        )
    )
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": DIM,
                "pooling_mode_cls_token": pooling == "cls",
                "pooling_mode_mean_tokens": pooling == "mean",
                "pooling_mode_max_tokens": pooling == "max",
                "pooling_mode_mean_sqrt_len_tokens": False,
            }
        )
    )
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
    )
    return folder
