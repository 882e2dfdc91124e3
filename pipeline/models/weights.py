"""Checkpoint files: the names every loader of the project agrees on."""

from __future__ import annotations

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
