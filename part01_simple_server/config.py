"""Engine configuration of this stage. The server's command-line flags are derived from it."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, asdict, dataclass, field, fields


@dataclass
class EngineConfig:
    model: str | None = field(default=None, metadata={"help": "local HF folder or hub id "
                                                      "(default: the embedded SmolLM2-135M-Instruct)"})
    device: str | None = field(default=None, metadata={"help": "cuda or cpu (default: cuda if available)"})
    dtype: str | None = field(default=None, metadata={"help": "float32, bfloat16, float16 "
                                                      "(default: bf16 on cuda, fp32 on cpu)"})
    load_format: str = field(default="auto", metadata={"help": "auto: the checkpoint's weights; dummy: "
                                                       "random weights, only config.json is read "
                                                       "(benchmarks of shapes without weights)"})
    max_model_len: int | None = field(default=None, metadata={"help": "context length (default: the "
                                                              "model's, at most 8192)"})
    use_kv_cache: bool = field(default=True, metadata={"help": "off: recompute the whole sequence "
                                                       "every step (the baseline)"})

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kwargs = {"default": f.default if f.default is not MISSING else None, "help": f.metadata.get("help")}
            if "bool" in str(f.type):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            else:
                kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
                parser.add_argument(flag, type=kind, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def to_dict(self) -> dict:
        return asdict(self)
