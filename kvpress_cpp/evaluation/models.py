"""Model names the evaluation understands: the embedded default (SmolLM2-135M-Instruct, loaded from its cached GGUF)
or anything transformers' ``pipeline`` loads (a hub name or a local folder, e.g. on a GPU machine).

kvpress's evaluate.py builds its model with ``pipeline("kv-press-text-generation", model=<name>, ...)``.
:func:`kvpress_pipeline` is the drop-in the launcher gives evaluate.py in place of that ``pipeline``: it resolves
the embedded default's name, and keeps the pipelines it built so that several evaluations in one process (the
results runner) load each model once.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpress_cpp.models import DEFAULT_MODEL_NAME

__all__ = ["DEFAULT_MODEL_NAME", "kvpress_pipeline", "load_tokenizer"]

_pipelines: dict[tuple, Any] = {}


def load_tokenizer(model: str):
    if model == DEFAULT_MODEL_NAME:
        from kvpress_cpp.models import load_default_tokenizer

        return load_default_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _dtype(value) -> torch.dtype:
    if value in (None, "auto"):
        return torch.float32
    return getattr(torch, value) if isinstance(value, str) else value


def kvpress_pipeline(task: str, model: str, model_kwargs: dict | None = None, device: str | None = None,
                     device_map: str | None = None, **kwargs):
    """``transformers.pipeline`` with the embedded default model available by name, cached per arguments."""
    from transformers import pipeline

    model_kwargs = dict(model_kwargs or {})
    key = (task, model, repr(sorted(model_kwargs.items())), device, device_map, repr(sorted(kwargs.items())))
    if key in _pipelines:
        return _pipelines[key]
    if model == DEFAULT_MODEL_NAME:
        from kvpress_cpp.models import load_default_model

        target = device if device is not None else ("cuda" if device_map == "auto" else "cpu")
        loaded, tokenizer = load_default_model(dtype=_dtype(model_kwargs.get("dtype")),
                                               attn_implementation=model_kwargs.get("attn_implementation") or "sdpa",
                                               device=target)
        pipe = pipeline(task, model=loaded, tokenizer=tokenizer, device=loaded.device)
    else:
        extra = {"device": device} if device is not None else {"device_map": device_map}
        pipe = pipeline(task, model=model, model_kwargs=model_kwargs, **extra, **kwargs)
    _pipelines[key] = pipe
    return pipe
