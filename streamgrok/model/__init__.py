"""Llama-family language model: config, PyTorch modules, loaders, tokenizer, generation."""
