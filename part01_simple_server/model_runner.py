"""ModelRunner: owns the model on its device and runs one forward pass for one sequence."""
from __future__ import annotations

import torch

from shared.attention import NoCacheAttention
from shared.device import resolve_device, resolve_dtype
from shared.forward_context import set_forward_context
from shared.weights import load_config, load_model, resolve_model_path

from .config import EngineConfig
from .kv_cache import CacheMetadata, ContiguousKVCache

DEFAULT_MAX_MODEL_LEN = 8192


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_path = resolve_model_path(config.model)
        cfg = load_config(self.model_path)
        self.max_model_len = min(config.max_model_len or min(cfg.max_position_embeddings,
                                                             DEFAULT_MAX_MODEL_LEN),
                                 cfg.max_position_embeddings)
        self.model = load_model(self.model_path, self.device, self.dtype, self.max_model_len,
                                config.load_format)
        self.model_config = self.model.config

    def new_cache(self, capacity: int) -> ContiguousKVCache:
        c = self.model_config
        return ContiguousKVCache(c.num_hidden_layers, capacity, c.num_key_value_heads, c.head_dim,
                                 self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], start: int, cache: ContiguousKVCache | None) -> torch.Tensor:
        """Run the tokens at positions start.. and return the logits of the last one: [1, V].
        With a cache, `token_ids` are only the new tokens; without, the whole sequence."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(token_ids), device=self.device)
        backend = cache if cache is not None else NoCacheAttention(self.model_config.head_dim ** -0.5)
        with set_forward_context(backend, CacheMetadata(start)):
            hidden = self.model(ids, positions)
        return self.model.compute_logits(hidden[-1:])
