"""Request scheduling, sampling and generation pipeline."""
