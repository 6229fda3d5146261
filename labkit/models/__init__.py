"""Real models for the quality lab: offline loading of packaged GGUFs and local HF checkpoints."""

from labkit.models.loader import PRESETS, ModelNotFound, cache_dir, checkpoint_path, load_model, resolve

__all__ = ["PRESETS", "ModelNotFound", "cache_dir", "checkpoint_path", "load_model", "resolve"]
