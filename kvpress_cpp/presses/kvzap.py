"""KVzap ("KVzap: Fast, Adaptive, and Faithful KV Cache Pruning", ``../shared/docs/methods.md``).

A per-layer surrogate (linear ``Dh → H``, or MLP ``Dh → Dh/8 → GELU → H``) reads the layer's attention input (the
output of its input norm) and predicts each token's log KVzip+ score for every kv head. Tokens are pruned DMS style:
a token is decided once, when it leaves the sliding window of the last w = 128 tokens, and evicted if its score is
below the threshold τ. This works in prefill and in decoding alike.

* :class:`KVzapPress` is a kvpress scorer (a subclass of kvpress's own ``KVzapPress``) whose ``score`` runs
  ``kvcomp::kvzap_score``; kvpress's ``DMSPress`` and ``AdaKVPress`` accept it.
* :class:`KVzapThresholdPress` prunes our cache itself, in prefill and at every decoding step: evicted slots get
  log-weight -inf and each layer is compacted to its longest head (``compact_to_longest_head``), so memory is really
  freed. The compression reached is readable afterwards (``compression_ratio``, ``layer_compression_ratios``).

Surrogate weights load from a local directory in the layout of kvpress's ``KVzapModel`` (``config.json`` +
``model.safetensors``, written by ``KVzapModel.save_pretrained``); nothing is fetched from a hub. Without
``surrogate_dir`` the packaged weights are used: ``kvpress_cpp/surrogates/<model name>/<model_type>/``, with the
model name ``model.config.name_or_path.split("/")[-1]`` as kvpress names its hub checkpoints.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from kvpress.presses.kvzap_press import KVzapModel
from kvpress.presses.kvzap_press import KVzapPress as _KVzapScorer
from safetensors import SafetensorError
from torch import nn

from kvpress_cpp import ops
from kvpress_cpp.cache import compact_to_longest_head
from kvpress_cpp.distributed import kv_head_shard
from kvpress_cpp.models import NO_HUB_KERNELS
from kvpress_cpp.paged_cache import PagedLayer, pass_paged_layer, shared_padding_dropped
from kvpress_cpp.presses.base import KVCompDecodingPress, require_int, require_real

__all__ = ["KVzapPress", "KVzapThresholdPress", "load_surrogate", "save_surrogate", "default_surrogate_dir",
           "has_packaged_surrogate", "SURROGATES_DIR", "DEFAULT_THRESHOLD"]

#: Packaged surrogate weights: ``SURROGATES_DIR / <model name> / <model_type> / {config.json, model.safetensors}``.
SURROGATES_DIR = Path(__file__).resolve().parent.parent / "surrogates"
TRAIN_COMMAND = "python -m kvpress_cpp.train_kvzap"

#: τ for the default model (SmolLM2-135M-Instruct), on the paper's scale: the shipped surrogates are trained on
#: KVzip+ scores normalised by the attention input, as the authors' (kvpress's KVzipPress(kvzip_plus_normalization=
#: True)). The paper uses -4 for Qwen3 and -7 for Llama-3.1 and keeps 34-43% of LongBench's slots (Table 2); on the
#: needle prompts of ``benchmarks/results/kvzap_tau.json`` (2000 tokens of Austen) this τ keeps 45% (MLP) / 41%
#: (linear) and answers the 3 needle questions (the full cache answers 2).
DEFAULT_THRESHOLD = -3.5


def default_surrogate_dir(model: nn.Module, model_type: str) -> Path:
    """Where the packaged surrogate of `model` lives: ``kvpress_cpp/surrogates/<model name>/<model_type>``."""
    return SURROGATES_DIR / str(model.config.name_or_path).split("/")[-1] / model_type


def has_packaged_surrogate(model: nn.Module, model_type: str) -> bool:
    """Whether a surrogate of `model_type` is packaged for `model` (a model built in memory has no name to find one
    by)."""
    return bool(str(model.config.name_or_path)) and (default_surrogate_dir(model, model_type) / "config.json").is_file()


def load_surrogate(model: nn.Module, model_type: str = "mlp", surrogate_dir: str | Path | None = None) -> KVzapModel:
    """kvpress's ``KVzapModel`` for `model` from a local directory (``surrogate_dir``, or the packaged default),
    checked against the model's shape. Raises FileNotFoundError naming the expected path when it is missing."""
    require_surrogate("KVzap", model_type, surrogate_dir)
    if surrogate_dir is None and not str(model.config.name_or_path):
        raise FileNotFoundError(
            f"KVzap: the model has no name (config.name_or_path is empty: a model built in memory), so no packaged "
            f"{model_type} surrogate is looked up for it; pass surrogate_dir= to a directory that holds one (train "
            f"one with `{TRAIN_COMMAND}`)")
    path = Path(surrogate_dir) if surrogate_dir is not None else default_surrogate_dir(model, model_type)
    missing = [name for name in ("config.json", "model.safetensors") if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"KVzap: no {model_type} surrogate for {model.config.name_or_path!r}: expected {', '.join(missing)} in "
            f"{path} (kvpress's KVzapModel layout, written by KVzapModel.save_pretrained). Train one with "
            f"`{TRAIN_COMMAND}`, or pass surrogate_dir= to a directory that holds one. Nothing is downloaded."
        )
    try:
        surrogate, loading = KVzapModel.from_pretrained(path, local_files_only=True, output_loading_info=True,
                                                        **NO_HUB_KERNELS)
    except (OSError, ValueError, TypeError, KeyError, SafetensorError) as error:
        raise ValueError(f"KVzap: the {model_type} surrogate in {path} cannot be read (a damaged or partly written "
                         f"config.json or model.safetensors?): {type(error).__name__}: {error}") from error
    absent = sorted(loading["missing_keys"])
    if absent:  # (transformers fills them with new random weights, and only logs it)
        raise ValueError(f"KVzap: the surrogate in {path} lacks {len(absent)} tensor(s) its config.json calls for: "
                         f"{', '.join(absent[:4])}{', ...' if len(absent) > 4 else ''} (a partial model.safetensors?)")
    check_surrogate_fits(surrogate, model, f"in {path}", model_type)
    return surrogate.eval()


def check_surrogate_fits(surrogate: KVzapModel, model: nn.Module, source: str, model_type: str | None) -> None:
    """Raise a ValueError naming `source` (where the surrogate came from) unless `surrogate` has one layer per layer
    of `model` (or of the model an attention module belongs to: its config), mapping the hidden size to the kv heads,
    and (unless `model_type` is None) is of that type."""
    config, model_config = surrogate.config, model.config.get_text_config()  # (a multimodal model's decoder)
    expected = {
        "n_modules": (config.n_modules, model_config.num_hidden_layers, "layers of the model"),
        "input_dim": (config.input_dim, model_config.hidden_size, "hidden size of the model"),
        "output_dim": (config.output_dim, model_config.num_key_value_heads, "kv heads of the model"),
    }
    for name, (got, want, meaning) in expected.items():
        if got != want:
            raise ValueError(f"KVzap: the surrogate {source} has {name} = {got}, expected {want} ({meaning})")
    if model_type is not None and (config.hidden_dim is None) != (model_type == "linear"):
        raise ValueError(f"KVzap: the surrogate {source} is {'linear' if config.hidden_dim is None else 'an MLP'}, "
                         f"but model_type = {model_type!r}")


def save_surrogate(surrogate: KVzapModel, path: str | Path) -> Path:
    """Write `surrogate` in the layout ``KVzapModel.save_pretrained`` writes (config.json + model.safetensors), which
    ``KVzapModel.from_pretrained`` and :func:`load_surrogate` read.

    With transformers 4.57, ``KVzapModel.save_pretrained`` itself raises a TypeError: it instantiates the config
    class without arguments to look for generation defaults, and KVzapConfig's arguments are required.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    surrogate.config.architectures = [type(surrogate).__name__]
    surrogate.config.dtype = "float32"
    surrogate.config.to_json_file(path / "config.json")
    tensors = {name: t.detach().float().contiguous() for name, t in surrogate.state_dict().items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def require_surrogate(press: str, model_type, surrogate_dir) -> None:
    if model_type not in ("linear", "mlp"):
        raise ValueError(f"{press}: model_type must be 'linear' or 'mlp', got {model_type!r}")
    if surrogate_dir is not None and not isinstance(surrogate_dir, (str, os.PathLike)):
        raise ValueError(f"{press}: surrogate_dir must be a folder's path (a str or os.PathLike) or None, got "
                         f"{surrogate_dir!r}")


def surrogate_tensors(layer: nn.Module) -> tuple[torch.Tensor, ...]:
    """(weight1, bias1) of a linear surrogate layer, (weight1, bias1, weight2, bias2) of an MLP one."""
    if isinstance(layer, nn.Linear):
        return layer.weight, layer.bias
    first, activation, last = layer
    if not (isinstance(first, nn.Linear) and isinstance(last, nn.Linear) and isinstance(activation, nn.GELU)
            and activation.approximate == "none"):
        raise TypeError(f"KVzap: expected a surrogate layer Linear or Linear → GELU() → Linear, got {layer}")
    return first.weight, first.bias, last.weight, last.bias


@dataclass
class KVzapPress(_KVzapScorer):
    """kvpress's KVzap scorer with ``score`` computed by ``kvcomp::kvzap_score`` (float32 scores (B, H, T)) and the
    surrogate read from a local directory.

    Use it where kvpress expects a ScorerPress: ``DMSPress(KVzapPress(), threshold=-3.5, decoding=True)``,
    ``AdaKVPress(KVzapPress(compression_ratio=0.5))``. Setting ``kvzap_model`` by hand (a ``KVzapModel``) also
    works; it is then used as is, checked only against the shape of each model the press is used on.

    Attributes:
        model_type: "linear" or "mlp" (paper: KVzap-Linear, KVzap-MLP).
        surrogate_dir: directory with config.json + model.safetensors; None for the packaged weights of the model
            (``kvpress_cpp/surrogates/<model name>/<model_type>``).
    """

    surrogate_dir: str | Path | None = None
    # (folder, model_type, the surrogate loaded from there), to tell it from one set by hand since
    _loaded: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _weights: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _weights_of: object = field(default=None, init=False, repr=False, compare=False)
    # The decoder config of the model the surrogate was last loaded or checked for: layer_surrogate refits on another
    _fitted_config: object = field(default=None, init=False, repr=False, compare=False)

    def __setattr__(self, name, value):
        # Checked at every assignment, not only at construction: kvpress's evaluation sets it on a built press.
        if name == "compression_ratio":
            require_real("KVzapPress", "compression_ratio", value, "[0, 1)")
        elif name in ("model_type", "surrogate_dir") and "surrogate_dir" in self.__dict__:  # constructed
            fields = {"model_type": self.model_type, "surrogate_dir": self.surrogate_dir, name: value}
            require_surrogate("KVzapPress", fields["model_type"], fields["surrogate_dir"])
        super().__setattr__(name, value)

    def __post_init__(self):
        super().__post_init__()
        require_surrogate("KVzapPress", self.model_type, self.surrogate_dir)

    def post_init_from_model(self, model):
        """Load the surrogate (once per folder and model_type), and check it against `model` at every use: one press
        object may be used on several models."""
        surrogate = getattr(self, "kvzap_model", None)
        if surrogate is not None and (self._loaded is None or surrogate is not self._loaded[2]):
            check_surrogate_fits(surrogate, model, "set as kvzap_model", None)  # set by hand: its type is what it is
        else:
            path = Path(self.surrogate_dir) if self.surrogate_dir is not None else default_surrogate_dir(
                model, self.model_type)
            if self._loaded is None or (path, self.model_type) != self._loaded[:2]:
                self.kvzap_model = load_surrogate(model, self.model_type, self.surrogate_dir)
                self._loaded = path, self.model_type, self.kvzap_model
            else:
                check_surrogate_fits(surrogate, model, f"in {path}", self.model_type)
        self._fitted_config = model.config.get_text_config()  # what the attention modules hold (a decoder's config)

    def layer_weights(self, layer_idx: int, device: torch.device, dtype: torch.dtype,
                      heads: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
        """The surrogate tensors of one layer on `device` in `dtype`, converted once and cached; with `heads`
        (first, stop), only the output rows of those kv heads (a tensor-parallel rank's own)."""
        surrogate = getattr(self, "kvzap_model", None)
        if surrogate is None:
            raise RuntimeError("KVzapPress: no surrogate loaded; use the press on a model (`with press(model):`, "
                               "which loads it) or set press.kvzap_model")
        if self._weights_of is not surrogate:
            self._weights, self._weights_of = {}, surrogate
        key = (layer_idx, device, dtype, heads)
        if key not in self._weights:
            tensors = list(surrogate_tensors(surrogate.layers[layer_idx]))
            if heads is not None:  # the last layer's weight and bias map to the kv heads
                tensors[-2:] = [t[heads[0]:heads[1]] for t in tensors[-2:]]
            self._weights[key] = tuple(t.detach().to(device, dtype).contiguous() for t in tensors)
        return self._weights[key]

    def layer_surrogate(self, module: nn.Module, hidden_states: torch.Tensor) -> tuple:
        """(weight1, bias1, weight2, bias2) of attention layer `module`'s surrogate (weight2 = bias2 = None for a linear
        one) on hidden_states' device and dtype, for the kv heads it holds (all of them, or a tensor-parallel rank's
        own)."""
        if getattr(self, "kvzap_model", None) is None or module.config is not self._fitted_config:
            # Some kvpress wrappers (CriticalAdaKVPress, PerLayerCompressionPress) never pass post_init_from_model on
            # to their scorer, even on another model than the last (whose surrogate would score this one's layers);
            # it reads only the model's config, which the attention module shares.
            self.post_init_from_model(module)
        weights = self.layer_weights(module.layer_idx, hidden_states.device, hidden_states.dtype,
                                     kv_head_shard(module))
        return (*weights, None, None)[:4]

    def layer_scores(self, module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, H, T) float32 scores of the tokens of hidden_states (B, T, Dh) at attention layer `module`."""
        return ops.kvzap_score(hidden_states, *self.layer_surrogate(module, hidden_states))

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        dropped = shared_padding_dropped(module, kwargs)
        if keys is not None and dropped and hidden_states.shape[1] == dropped + keys.shape[-2]:
            hidden_states = hidden_states[:, dropped:]  # a paged prefill holds no column of the padding rows share
        if keys is not None and hidden_states.shape[1] != keys.shape[-2]:
            # Scores of other tokens than the keys' would select slots by the wrong tokens' scores, or index past them.
            raise ValueError(
                f"KVzapPress: scores one slot per hidden state, got the hidden states of {hidden_states.shape[1]} "
                f"tokens for {keys.shape[-2]} slots at layer {module.layer_idx}: a press before it (in a "
                f"ComposedPress) shrank the prompt, or a wrapper passes the hidden states of some tokens only "
                f"(kvpress's DecodingPress: its buffered decoding tokens). KVzap compresses while decoding as "
                f"kvpress_cpp's KVzapThresholdPress or inside DMSPress(KVzapPress(), decoding=True)")
        return self.layer_scores(module, hidden_states)


@dataclass
class KVzapThresholdPress(KVCompDecodingPress):
    """KVzap in prefill and at every decoding step, on our cache (paper Algorithm 1 with DMS's score buffer).

    Every token is decided once, in absolute cache positions: when it leaves the window of the last
    ``sliding_window`` tokens it is evicted if its surrogate score is below ``threshold`` (NaN is kept, as in
    kvpress's DMSPress); the window itself is never evicted. Evicted slots get log-weight -inf at once; a layer is
    compacted to its longest head (memory freed) at prefill and, while decoding, once every ``compaction_slack``
    new tokens, so the cache is neither copied at every step nor ever ``compaction_slack`` or more slots longer than
    its longest head. Only those steps read the longest head back (one host sync); the others wait on nothing and
    can be captured in a CUDA graph. Each slot's absolute position and score are kept in the layer's state
    (``per_slot["positions"]``, ``per_slot["scores"]``).

    On a :class:`~kvpress_cpp.paged_cache.PagedLayer` a decoding pass works in the layer's pools and reads no view
    (:meth:`_step_paged_layer`, one ``kvzap_paged_step``): it scores the new tokens, decides only the slots whose
    tokens leave the window, and evicts the slots it marked -inf (dead slots, attended as the rectangular cache attends
    them) once every ``compaction_slack`` tokens, when the rectangular cache compacts. It reads nothing back either,
    once a pass has found the layer's rows in order (see :meth:`_step_paged_layer`).

    Attributes:
        threshold: τ on the predicted log-scores (paper: -4 Qwen3, -7 Llama-3.1; higher prunes more).
        sliding_window: w ≥ 1, the most recent tokens, never evicted (paper: 128). At least the newest token stays:
            a layer the threshold emptied would read as a cache emptied for a new prompt.
        model_type: "linear" or "mlp".
        surrogate_dir: the surrogate's directory; None for ``kvpress_cpp/surrogates/<model name>/<model_type>``.
        compaction_slack: compact a layer during decoding every this many new tokens (≥ 1; 1: at every step).
    """

    threshold: float = DEFAULT_THRESHOLD
    sliding_window: int = 128
    model_type: Literal["linear", "mlp"] = "mlp"
    surrogate_dir: str | Path | None = None
    compaction_slack: int = 32
    scorer: KVzapPress = field(init=False, repr=False, compare=False)
    # Per layer index, the paged layer whose rows a pass last found in position order at their end (the window and the
    # tokens leaving it), as (weak reference, its rearrangements then): see _step_paged_layer.
    _rows_in_order_at: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    #: Padding enters as slots of b = -inf, which the DMS rule never revives, so each row equals its run alone.
    handles_padding = True
    #: The keep rule reads the surrogate's scores only, never the attention or the queries.
    reads_decode_probabilities = False
    #: A step marks slots -inf in the log-weights only; a compaction gathers the keys and values into new tensors.
    decoding_rewrites_slots = False
    scores_prompt_with_queries = False

    def check_parameters(self) -> None:
        require_int("KVzapThresholdPress", "sliding_window", self.sliding_window, 1)
        require_int("KVzapThresholdPress", "compaction_slack", self.compaction_slack, 1)
        require_real("KVzapThresholdPress", "threshold (τ)", self.threshold, "[-inf, inf]")
        require_surrogate("KVzapThresholdPress", self.model_type, self.surrogate_dir)

    def __post_init__(self):
        super().__post_init__()
        self.scorer = KVzapPress(model_type=self.model_type, surrogate_dir=self.surrogate_dir)

    def post_init_from_model(self, model):
        super().post_init_from_model(model)
        if (self.scorer.model_type, self.scorer.surrogate_dir) != (self.model_type, self.surrogate_dir):
            self.scorer = KVzapPress(model_type=self.model_type, surrogate_dir=self.surrogate_dir)  # fields changed
        self.scorer.post_init_from_model(model)

    def compress_prefill(self, module, hidden_states, keys, values, attentions, log_weights, kwargs):
        batch, heads, length = keys.shape[:3]
        scores = self.scorer.layer_scores(module, hidden_states)
        positions = torch.arange(length, device=keys.device).expand(batch, heads, length)
        log_weights, _ = ops.kvzap_threshold(log_weights, scores, positions, self.threshold, self.sliding_window,
                                             0, length)
        keys, values, state = compact_to_longest_head(keys, values, log_weights != float("-inf"), log_weights,
                                                      {"scores": scores, "positions": positions})
        state.counters["tokens"] = length
        state.counters["since_compaction"] = 0
        return keys, values, state

    def _compress_pass(self, module, kwargs, attentions):
        self._refuse_head_wise_marks(module)  # before written_state() reads the layer (and evicts them)
        layer = pass_paged_layer(module, kwargs)
        if layer is None or not self._step_paged_layer(module, layer, kwargs["hidden_states"]):
            super()._compress_pass(module, kwargs, attentions)

    def _step_paged_layer(self, module, layer: PagedLayer, hidden_states: torch.Tensor) -> bool:
        """compress_decoding of the q tokens update() just appended to a paged layer this press prefilled, in the
        layer's pools (``ops.kvzap_paged_step``): the new tokens' positions and scores are written to their slots and
        the tokens leaving the window are decided in theirs. Returns False, with nothing but the new tokens' positions
        and scores written, where those slots do not hold them (a left-padded row's first tokens, a cache cut back by
        kvpress's pipeline) or where the general path must run (a prefill, another press's state, a tensor-parallel
        layer): the view is then read and written as for a DynamicCache.

        Whether the slots held those tokens is read back from the device only until a pass finds every row's last
        slots (the window and the tokens leaving it) holding consecutive positions: appending the next tokens keeps
        them so, and dropping dead slots (decided ones) leaves them be, so the passes that follow over a layer
        nothing else rearranged (``PagedLayer.rearrangements``; the slots appended since being the pass's own tokens is
        checked first) read nothing.
        """
        state = layer.written_state()
        # Only over the state this press wrote last, whose counts of held slots this step adds to (not another press's
        # state, nor another cache's: two conversations or a copy, of another batch size maybe). The general path
        # compresses those, counted in none.
        if (state is None or self._last_written(module.layer_idx) is not state or kv_head_shard(module) is not None
                or not {"scores", "positions"} <= set(layer.slot_blocks)):
            return False
        new_tokens = hidden_states.shape[1]
        if not torch.equal(layer.lengths - layer.bases, torch.full_like(layer.lengths, new_tokens)):
            # Slots appended since the press last wrote the layer other than this pass's (tokens fed while its context
            # was closed, which it has no scores for): the general path refuses them, as on a DynamicCache. (Host
            # tensors: nothing read back.)
            return False
        _, _, log_weight_blocks, block_tables, lengths = layer.attention_inputs()
        counters = layer.counters
        before = counters["tokens"]
        in_order = self._rows_known_in_order(module.layer_idx, layer)
        # The layer built its tables: checked in the kernel, they cost no host sync.
        held_now = ops.kvzap_paged_step(log_weight_blocks, layer.slot_blocks["scores"], layer.slot_blocks["positions"],
                                        block_tables, lengths, self.scorer.layer_scores(module, hidden_states),
                                        self.threshold, self.sliding_window, before, check_tables_on_device=True)
        first_decided = max(0, before - self.sliding_window)
        decided = max(0, before + new_tokens - self.sliding_window) - first_decided
        if decided and not in_order:
            held_where_expected, in_order = self._read_rows(layer, held_now, first_decided, before + new_tokens)
            if not held_where_expected:
                self._rows_in_order_at.pop(module.layer_idx, None)
                return False
        # Tokens not decided before are held (b = 0): the decided slots held before this pass are all of them.
        layer_idx = module.layer_idx
        self._slots_held[layer_idx] = self._held(layer_idx) + held_now + (new_tokens - decided)
        counters["tokens"] = before + new_tokens
        counters["since_compaction"] = counters.get("since_compaction", 0) + new_tokens
        layer.own_appended_slots()
        if counters["since_compaction"] >= self.compaction_slack:
            layer.drop_dead_slots()
            counters["since_compaction"] = 0
        if in_order:
            self._rows_in_order_at[layer_idx] = (weakref.ref(layer), layer.rearrangements)
        else:
            self._rows_in_order_at.pop(layer_idx, None)
        self._count_later_tokens(layer_idx, new_tokens)
        self._held_to_gather.add(layer_idx)
        return True

    def _rows_known_in_order(self, layer_idx: int, layer: PagedLayer) -> bool:
        """Whether a pass of this press found `layer`'s rows in order at their end and nothing rearranged the layer
        since (host integers: nothing is read back). That only this pass's tokens were appended since is the caller's
        check (lengths - bases)."""
        known = self._rows_in_order_at.get(layer_idx)
        return known is not None and known[0]() is layer and known[1] == layer.rearrangements

    @staticmethod
    def _read_rows(layer: PagedLayer, held_now: torch.Tensor, first: int, end: int) -> tuple[bool, bool]:
        """(whether every row held the tokens leaving the window where kvzap_paged_step looked for them, whether every
        row's last slots hold positions first .. end - 1 in order), in one read back from the device."""
        found = held_now.min() >= 0
        tail = layer.last_slots("positions", end - first)
        if tail is None:
            in_order = torch.zeros((), dtype=torch.bool, device=found.device)
        else:
            in_order = (tail == torch.arange(first, end, device=tail.device)).all()
        held_where_expected, in_order = torch.stack([found, in_order]).tolist()
        return held_where_expected, in_order

    def decode_step(self, module, hidden_states, log_weights, state):
        """The scores of the q new tokens of hidden_states and the keep rule over the state they grow
        (``ops.kvzap_decode_step``): (log_weights, scores, positions) of the T + q slots, held (B, H)."""
        return ops.kvzap_decode_step(hidden_states, *self.scorer.layer_surrogate(module, hidden_states), log_weights,
                                     state.per_slot["scores"], state.per_slot["positions"], self.threshold,
                                     self.sliding_window, state.counters["tokens"])

    def compress_decoding(self, module, hidden_states, keys, values, attentions, state, kwargs):
        new_tokens = hidden_states.shape[1]
        length = keys.shape[2]
        before = state.counters["tokens"]
        log_weights, scores, positions, held = self.decode_step(
            module, hidden_states, state.align(length - new_tokens, new_tokens), state)
        # A head holds at most one more slot per new token, so the layer outgrows its longest head by at most the
        # tokens since the last compaction: compacting every compaction_slack tokens keeps that below the slack.
        since_compaction = state.counters.get("since_compaction", 0) + new_tokens
        counters = {**state.counters, "tokens": before + new_tokens, "since_compaction": since_compaction}
        longest = int(held.max()) if since_compaction >= self.compaction_slack else length  # the one host sync
        if longest < length:
            keys, values, state = compact_to_longest_head(keys, values, log_weights != float("-inf"), log_weights,
                                                          {"scores": scores, "positions": positions}, longest)
        else:
            state.log_weights, state.per_slot = log_weights, {"scores": scores, "positions": positions}
        if since_compaction >= self.compaction_slack:
            counters["since_compaction"] = 0
        state.counters = counters
        return keys, values, state
