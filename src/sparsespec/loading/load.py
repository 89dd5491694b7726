"""One call from a ``--model`` argument to a ready model and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..model import Transformer
from .source import ModelSource, resolve_model
from .tokenizer import load_tokenizer
from .weights import load_state

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class LoadedModel:
    """A model with its tokenizer and where it came from."""

    name: str
    source: ModelSource
    config: ModelConfig
    model: Transformer
    tokenizer: object


def load_model(ref: str, dtype: torch.dtype = torch.bfloat16, weights: str = "dense", tokenizer: bool = True) -> LoadedModel:
    """Resolve ``ref`` (fixture name, ``.gguf`` path or Hugging Face folder) and load weights and tokenizer."""
    source = resolve_model(ref)
    config, state = load_state(source)
    model = Transformer(config, state, dtype, weights)
    del state
    return LoadedModel(source.name, source, config, model, load_tokenizer(source) if tokenizer else None)
