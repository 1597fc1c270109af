"""A model folder whose arithmetic costs next to nothing, for measuring an engine's host work: a
Llama config (hidden 128, 2 layers, 2 heads of 64, vocabulary 2048) and a real tokenizer, no
weights (`--load-format dummy` in both our engine and vLLM). A step of it is scheduling, input
building, sampling and output processing (detokenization too, as with any model): what the
engine does around the kernels, which on a GPU is the whole of a small model's step.

The tokenizer is a byte-level BPE trained here, in a second or two, on the text of Python's own
help topics (shipped with Python), so every id decodes to text."""
from __future__ import annotations

import json
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "head_dim": 64, "vocab_size": 2048, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}


def make_tiny_model(dest: str | Path) -> Path:
    """Write config.json and the tokenizer into `dest` (once: an existing folder is kept)."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    dest = Path(dest)
    if (dest / "config.json").is_file() and (dest / "tokenizer.json").is_file():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=CONFIG["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(topics.values(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(dest)
    (dest / "config.json").write_text(json.dumps(CONFIG, indent=1))
    return dest


if __name__ == "__main__":
    import sys

    print(make_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
