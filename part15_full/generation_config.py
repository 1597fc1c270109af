"""`--generation-config`: the model creator's sampling defaults, used where a request gives none.

Many checkpoints ship a generation_config.json with the sampling their authors recommend (Qwen3:
temperature 0.6, top_p 0.95, top_k 20). vLLM's default, `auto`, reads it and uses these keys as the
server's defaults; `vllm` ignores it (OpenAI's defaults: temperature 1, no top-k...); a folder path
reads that folder's file instead. A value the request gives always wins, except `max_new_tokens`,
which caps the request's max_tokens (vLLM takes the smaller).

In vLLM: vllm/config/model.py (ModelConfig.get_diff_sampling_param) and the serving classes'
`default_sampling_params`."""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("vllm_course.server")

# generation_config.json key -> SamplingParams field (vLLM's list)
KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
        "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


def default_sampling_params(mode: str, model_path: str | Path) -> dict:
    """The request defaults `mode` ("auto", "vllm" or a folder) gives for the model at model_path."""
    if mode == "vllm":
        return {}
    folder = Path(model_path) if mode == "auto" else Path(mode)
    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    data = json.loads(file.read_text())
    defaults = {field: data[key] for key, field in KEYS.items() if data.get(key) is not None}
    if defaults:
        log.info("Default sampling parameters have been overridden by the model's generation config "
                 "(%s): %s", file, defaults)
    return defaults
