"""The typed run configuration: one pydantic tree, loadable from YAML, usable as Prefect flow parameters.

Layers: ``RunConfig`` (base: run id, storage, domain, dataset, models) holds a ``GRPOConfig`` (group size,
sampling, epochs, batches) and a ``LearningConfig`` (library limits, operations, ground truth).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.records import text_hash


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PriceTable(Section):
    """USD per million tokens."""

    input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0


class ModelConfig(Section):
    backend: Literal["openai"] = "openai"
    model: str = "deepseek-chat"
    base_url: str | None = None  # None: the SDK default (api.openai.com)
    api_key_env: str | None = "OPENAI_API_KEY"  # read at call time, never stored
    api_key_secret_block: str | None = None  # Prefect Secret block name, used when the env var is unset
    temperature: float = Field(0.7, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(2048, ge=1)
    timeout_s: float = Field(120.0, gt=0)
    max_retries: int = Field(6, ge=0)
    retry_base_delay_s: float = Field(1.0, ge=0)  # exponential backoff base (doubles per retry, with jitter)
    retry_max_delay_s: float = Field(60.0, ge=0)
    supports_n: bool = True  # request G samples with n=G; False: G separate calls
    json_schema: bool = True  # request response_format=json_schema; False: prompt + tolerant parser
    price: PriceTable = Field(default_factory=PriceTable)
    seed: int | None = None


class DatasetConfig(Section):
    path: str | None = None  # local .jsonl / .json / .csv / .parquet
    hf_name: str | None = None  # optional Hugging Face `datasets` name (needs network or a local cache)
    hf_split: str = "train"
    hf_config: str | None = None
    id_field: str | None = "id"  # None or a missing column: ids are derived from the row number
    problem_field: str = "problem"
    answer_field: str | None = "answer"  # None: no ground truth in this dataset
    limit: int | None = Field(None, ge=1)
    shuffle: bool = True
    seed: int = 0

    @model_validator(mode="after")
    def _one_source(self) -> "DatasetConfig":
        if (self.path is None) == (self.hf_name is None):
            raise ValueError("dataset: set exactly one of `path` (local file) or `hf_name` (Hugging Face dataset)")
        return self


class GRPOConfig(Section):
    group_size: int = Field(5, ge=1)
    epochs: int = Field(3, ge=1)
    batch_size: int = Field(100, ge=1)  # problems per step
    rollout_temperature: float = Field(0.7, ge=0.0, le=2.0)
    rollout_chunk_size: int = Field(16, ge=1)  # problems per rollout task run


class LearningConfig(Section):
    use_groundtruth: bool = True
    max_words: int = Field(32, ge=1)
    max_ops_per_group: int = Field(3, ge=1)
    max_library_size: int | None = Field(None, ge=1)
    consolidate_chunk_size: int = Field(20, ge=2)  # proposals per consolidation call before a final pass
    summarize_chunk_size: int = Field(16, ge=1)  # groups per summarize / advantage task run


class RunConfig(Section):
    run_id: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$")
    db_path: str = "runs/clgrpo.duckdb"
    domain: str = "math"
    dataset: DatasetConfig
    policy: ModelConfig = Field(default_factory=ModelConfig)
    learner: ModelConfig | None = None  # None: the policy model also learns
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    learning: LearningConfig = Field(default_factory=LearningConfig)
    concurrency: int = Field(32, ge=1)  # in-flight LLM requests, all stages together
    seed: int = 0
    initial_library: str | None = None  # a library file to start from (reference, seed or text format)

    @property
    def learner_model(self) -> ModelConfig:
        return self.learner or self.policy

    def fingerprint(self) -> str:
        """Hash of everything that shapes the results; a run id is bound to one fingerprint."""
        payload = self.model_dump(mode="json", exclude={"db_path", "concurrency"})
        return text_hash(json.dumps(payload, sort_keys=True))
