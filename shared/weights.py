"""Find and load weights: the embedded default, a local HF folder, or a hub id; or, with
`load_format="dummy"`, random weights for a folder that holds only a config.json."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch

from .config import ModelConfig
from .gguf_convert import EMBEDDED_NAME, embedded_model_path
from .model import LayerFactory, LlamaForCausalLM
from .models.registry import get_model_class

_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def resolve_model_path(model: str | None) -> Path:
    """None -> the embedded SmolLM2 folder; an existing folder -> itself; else a hub id,
    downloaded (or read from the local HF cache when offline)."""
    if model is None or model == EMBEDDED_NAME:
        return embedded_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"--model {model!r} is a file; give the folder that holds the checkpoint")
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"model folder {model!r} does not exist")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id=model, allow_patterns=_HUB_PATTERNS))


def served_model_name(model: str | None) -> str:
    if model is None:
        return EMBEDDED_NAME
    path = Path(model)
    return path.name if path.is_dir() else model


def load_config(path: Path, per_layer_attention: bool = False) -> ModelConfig:
    """per_layer_attention: the caller's attention backends implement sliding windows, soft-capped
    scores and a custom scale (part 15's); without, windows cap the context (shared/config.py)."""
    eos = generation_eos_token_ids(path)
    return read_hf_config(path, lambda hf: ModelConfig.from_hf(hf, eos, per_layer_attention))


T = TypeVar("T")


class _FieldNotInFile(Exception):
    """Not an AttributeError on purpose: getattr(config, name, default) must not swallow it."""


# Fields whose absence from config.json means exactly what the getattr defaults of ModelConfig.from_hf
# say, for every supported model class (the class lacks the field, or defaults to the same value).
ABSENT_MEANS_DEFAULT = {"hidden_act", "head_dim", "attention_bias", "mlp_bias", "use_sliding_window",
                        "rope_scaling", "rope_parameters", "partial_rotary_factor", "architectures"}
ABSENT_MEANS_DEFAULT_FOR = {"llama": {"sliding_window"}, "mistral": {"layer_types"}}
# Families read from config.json directly; any other's config comes from transformers, which fills
# in what its class derives (Gemma's layer types, RoPE per layer type, SmolLM3's NoPE layers).
READ_DIRECTLY = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe")


class _JsonConfig:
    """config.json's fields as attributes. Any other field a model class defaults (Mistral's
    sliding_window, Llama's bos and eos ids) raises _FieldNotInFile: only transformers knows it."""

    def __init__(self, fields: dict[str, Any]):
        self.__dict__.update(fields)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ABSENT_MEANS_DEFAULT or \
                name in ABSENT_MEANS_DEFAULT_FOR.get(self.__dict__.get("model_type"), ()):
            raise AttributeError(name)
        raise _FieldNotInFile(name)


def read_hf_config(path: Path, build: Callable[[Any], T]) -> T:
    """build(config) from config.json as written; if build reads a field the file leaves out, from
    transformers' AutoConfig instead, which fills in the class default. Importing transformers costs
    seconds in every process that loads a model (engines, workers), and files written by recent
    save_pretrained hold every field."""
    try:
        fields = json.loads((Path(path) / "config.json").read_text())
        if fields.get("model_type") not in READ_DIRECTLY:
            raise _FieldNotInFile("model_type")
        return build(_JsonConfig(fields))
    except (_FieldNotInFile, FileNotFoundError):
        from transformers import AutoConfig

        return build(AutoConfig.from_pretrained(path))


def generation_eos_token_ids(path: Path) -> tuple[int, ...]:
    """The EOS ids of generation_config.json, which may list several (chat models' end-of-turn)."""
    gen = path / "generation_config.json"
    if not gen.exists():
        return ()
    value = json.loads(gen.read_text()).get("eos_token_id")
    return tuple(value) if isinstance(value, list) else ((value,) if value is not None else ())


LOAD_FORMATS = ("auto", "dummy")
DUMMY_SEED = 0


def iterate_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(str(f), framework="pt") as reader:
                for name in reader.keys():
                    yield name, reader.get_tensor(name)
        return
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {path}; for random weights of "
                                f"this shape (benchmarks), use --load-format dummy")
    for f in bins:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()


@torch.no_grad()
def initialize_dummy_weights(model: torch.nn.Module, low: float = -1e-3, high: float = 1e-3,
                             seed: int = DUMMY_SEED) -> None:
    """vLLM's `--load-format dummy`: every floating-point parameter uniform in [low, high], from a
    seeded generator (the same weights every run). Values this small keep the forward pass free of
    NaNs and overflow, so timings are those of real weights of the same shape. Integer parameters
    (a quantized checkpoint's packed weights) are left to their quantize method."""
    params = [p for p in model.parameters() if p.is_floating_point()]  # a tied head: filled once
    generator = torch.Generator(device=params[0].device).manual_seed(seed)
    for p in params:
        p.uniform_(low, high, generator=generator)


def process_weights_after_loading(model: torch.nn.Module) -> None:
    """Give every layer's quantize method its post-load step (quantize, repack for a kernel)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build floating-point parameters directly in the model's dtype (no fp32 copy first)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(path: Path, device: torch.device, dtype: torch.dtype,
               max_positions: int | None = None, load_format: str = "auto",
               layers: LayerFactory | None = None, cfg: ModelConfig | None = None,
               load_weights: Callable[[LlamaForCausalLM, Iterator], set[str]] | None = None,
               model_class: type[LlamaForCausalLM] | None = None) -> LlamaForCausalLM:
    """load_format "auto": the checkpoint in `path`; "dummy": random weights, only config.json read.
    The class is the registry's for the config's architecture (shared/models/registry.py), unless
    `model_class` is given. `layers`: the model's LayerFactory (default: dense layers). A model family
    of a later part may pass its own `cfg` and `load_weights(model, weights)` (default: the model's own loader).
    Parameters are created in `dtype` by their layers (a quantized format's integer ones keep
    theirs: nothing here casts them); each layer's quantize method runs once loading is done."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
    cfg = cfg or load_config(path)
    with torch.device(device), default_dtype(dtype):
        model = (model_class or get_model_class(cfg.architecture))(cfg, max_positions=max_positions, layers=layers)
    if load_format == "dummy":
        initialize_dummy_weights(model)
    else:
        loaded = (load_weights or type(model).load_weights)(model, iterate_weights(path))
        expected = {n for n, _ in model.named_parameters()}
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint {path} lacks {sorted(missing)[:5]} ...")
    process_weights_after_loading(model)
    return model.eval()
