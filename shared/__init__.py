"""The engine core every part imports unchanged: model, weights, tokenizer, sampling, protocol."""
