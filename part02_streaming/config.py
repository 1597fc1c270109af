"""Engine configuration of this stage."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str | None = None  # None: bf16 on cuda, fp32 on cpu
    max_model_len: int | None = None  # None: the model's, capped at 8192
    use_kv_cache: bool = True  # off: recompute the whole sequence every step (the baseline)
