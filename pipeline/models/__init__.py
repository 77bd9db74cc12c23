"""Architectures and what they are made of: configs (``model_config``), components (decoder, MLPs,
vision tower, projector, the tensor-parallel layers), checkpoint loading (``weights``,
``model_loader``) and the model's identity for the KV cache (``model_identity``). Nothing is imported
here eagerly, so reading a config (``strata plan``, ``strata ops``) never loads torch modules."""
