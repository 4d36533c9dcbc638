"""Adapters between the engine and the Hugging Face libraries (transformers, accelerate)."""
