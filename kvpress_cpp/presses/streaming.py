"""Streaming prefill for the presses whose papers compress a prompt as it streams in (ZSMerge, WeightedKV).

With ``prefill_chunk_size`` set, ``generate`` under the press feeds the prompt in chunks of that many tokens
(transformers' ``GenerationConfig.prefill_chunk_size``): the first chunk is the press's prefill, every later one a
decoding pass of several tokens, so the cache never holds more than the budget plus one chunk, and every prompt
token is scored by the queries that follow it over the compressed cache, as in the papers' token-by-token streams
(a chunk of 1 is exactly that). A prompt that reaches the press in one forward longer than a chunk (kvpress's
pipeline prefills its context so, transformers 4's beam search does not chunk, nor does a hand-written forward) is
refused rather than compressed in one shot.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
import transformers
from kvpress import PrefillDecodingPress
from packaging.version import Version

from kvpress_cpp.cache import pass_cache, pass_inputs

__all__ = ["StreamingPrefill", "CHUNKED_PREFILL_REPEATS_LAST_POSITIONS", "CHUNKED_PREFILL_IGNORES_PADDING",
           "check_chunk_positions"]

#: transformers 5.2.0's chunked prefill gives every chunk the position ids of the prompt's last chunk (its generate
#: computes them once from the whole attention mask): logits off by 5.1 on a tiny Llama, with or without a press.
#: 5.1 and 5.3 give each chunk its own positions.
CHUNKED_PREFILL_REPEATS_LAST_POSITIONS = Version(transformers.__version__).release[:2] == (5, 2)
#: transformers 4's chunked prefill gives every row the positions of its columns (position_ids = cache_position),
#: ignoring a left-padded row's padding: the row then differs from its run alone, with or without a press. 5 takes
#: each row's positions from the attention mask.
CHUNKED_PREFILL_IGNORES_PADDING = Version(transformers.__version__).major < 5


def check_chunk_positions(name: str, option: str, instead: str) -> None:
    """Raise where the installed transformers' chunked prefill, which `option` asks for, positions every chunk as the
    prompt's last (:data:`CHUNKED_PREFILL_REPEATS_LAST_POSITIONS`)."""
    if CHUNKED_PREFILL_REPEATS_LAST_POSITIONS:
        raise ValueError(f"{name}: {option} streams the prompt through generate's chunked prefill, which in "
                         f"transformers {transformers.__version__} gives every chunk the positions of the prompt's "
                         f"last chunk; use {instead}, or transformers 5.1 or 4.57 (kvpress 0.5.5 allows 4.56 to 5.2)")


class StreamingPrefill:
    """Mixin of a press dataclass with a field ``prefill_chunk_size: int | None`` (None: the whole prompt in one
    forward)."""

    prefill_chunk_size: int | None

    def check_prefill_chunk_size(self, budget: int | float) -> None:
        """Validate the option; `budget` is the press's cache budget, which must then be a token count."""
        chunk, name = self.prefill_chunk_size, type(self).__name__
        if chunk is None:
            return
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1 or chunk.bit_length() > 63:  # int64
            raise ValueError(f"{name}: prefill_chunk_size must be None or an int in [1, 2^63 - 1], got {chunk!r}")
        if isinstance(budget, float):
            raise ValueError(f"{name}: prefill_chunk_size needs a budget in tokens, got the fraction {budget!r} (the "
                             f"prompt's length is unknown while it streams in)")

    def _check_resumed_positions(self, base_model, args: tuple, kwargs: dict):
        """The decoder stack's pre-hook (see KVCompPress), which here also refuses, on a prompt's first pass (an empty
        cache), a prompt not streamed and a left-padded batch's stream where it cannot be right."""
        cache, mask = pass_cache(kwargs), kwargs.get("attention_mask")
        if (self.prefill_chunk_size is not None and kwargs.get("use_cache") is not False
                and (cache is None or cache.get_seq_length() == 0)):
            self._refuse_unstreamed_prompt(pass_inputs(args, kwargs))
            if cache is not None and mask is not None and mask.dim() == 2:
                self._refuse_padded_stream(mask)
        return super()._check_resumed_positions(base_model, args, kwargs)

    def _refuse_unstreamed_prompt(self, inputs: torch.Tensor | None) -> None:
        tokens = inputs.shape[1] if inputs is not None else 0
        if tokens > self.prefill_chunk_size:
            raise ValueError(f"{type(self).__name__}: a prompt of {tokens} tokens reached the press in one forward, "
                             f"where prefill_chunk_size={self.prefill_chunk_size} asks for it in chunks: only "
                             f"generate streams it so, and not every generate does (transformers "
                             f"{transformers.__version__}'s beam search does not chunk in 4.x; kvpress's pipeline "
                             f"prefills its context in one forward). Use prefill_chunk_size=None there, which "
                             f"compresses the prompt in one shot at the end of its prefill")

    def _refuse_padded_stream(self, first_chunk_mask: torch.Tensor) -> None:
        padding = first_chunk_mask == 0
        padded = padding.any(-1)
        if not bool(padded.any()):
            return
        name, rows = type(self).__name__, padded.nonzero().flatten().tolist()
        if CHUNKED_PREFILL_IGNORES_PADDING:
            raise ValueError(f"{name}: prefill_chunk_size streams the prompt through generate's chunked prefill, which "
                             f"in transformers {transformers.__version__} positions the rows of a left-padded batch "
                             f"from their first column, padding included (batch rows {rows} are padded): they would "
                             f"differ from their runs alone. Generate the rows one by one, use prefill_chunk_size=None, "
                             f"or transformers 5 (from 5.3)")
        empty = padding.all(-1)
        if bool(empty.any()):
            raise ValueError(f"{name}: the first chunk of prefill_chunk_size={self.prefill_chunk_size} tokens, which "
                             f"is {name}'s prefill, holds only padding for batch rows "
                             f"{empty.nonzero().flatten().tolist()}: the chunk must reach every row's first token "
                             f"(a prefill_chunk_size above the longest left padding)")
        warnings.warn(f"{name}: batch rows {rows} are left-padded by {padding.sum(-1)[padded].tolist()} of the first "
                      f"chunk's {self.prefill_chunk_size} columns: generate cuts every row at the same columns, so each "
                      f"of these rows' chunks end that many tokens earlier in its text than in its run alone (its first "
                      f"chunk, the press's prefill, is that much shorter), and what the press keeps of it, and its "
                      f"output, can differ from that run", stacklevel=2)

    @contextmanager
    def context_under(self, hooking_press, model):
        # Here, not in __call__: kvpress's wrappers (ComposedPress, PrefillDecodingPress) open the press through it.
        if self.prefill_chunk_size is None:
            with super().context_under(hooking_press, model):
                yield
            return
        name = type(self).__name__
        check_chunk_positions(name, "prefill_chunk_size", "prefill_chunk_size=None")
        if hooking_press is not self and isinstance(hooking_press, PrefillDecodingPress):
            # kvpress's PrefillDecodingPress sends a pass on a cache already holding tokens to its decoding_press.
            raise ValueError(f"{name}: prefill_chunk_size streams the prompt as a prefill of its first chunk and a "
                             f"pass per later chunk, which {type(hooking_press).__name__} hands to its decoding_press, "
                             f"not to its prefilling_press: only the first chunk would be compressed. Use {name} alone "
                             f"or in a ComposedPress, which streams every chunk into it")
        config = getattr(model, "generation_config", None)
        if config is None:
            raise ValueError(f"{name}: prefill_chunk_size streams the prompt through `generate`, which "
                             f"{type(model).__name__} does not have (use a *ForCausalLM model)")
        before = config.prefill_chunk_size
        config.prefill_chunk_size = self.prefill_chunk_size
        try:
            with super().context_under(hooking_press, model):
                yield
        finally:
            config.prefill_chunk_size = before
