"""Every press on a tensor-parallel model: the cases of ``tests/test_tensor_parallel.py`` and the worker that runs them.

``torchrun --nproc-per-node N tests/tp_worker.py MODEL_DIR OUT_DIR --surrogates DIR [--uneven-model DIR]`` loads the
model with ``tp_plan="auto"`` (gloo on CPU, NCCL on GPUs), runs every case of :data:`CASES` (greedy generation under the
press) and writes each rank's results to ``OUT_DIR/rank<r>.pt``: tokens, the cache it holds (keys, values,
log-weights and the press's per-slot state per layer, and the slots kvpress's head-wise presses mask), its bytes and
the press's reported ratios, plus the errors of the configurations that must be refused. The test runs the same
cases in one process (:func:`run_case`) and compares.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script by torchrun
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpress import (  # noqa: E402
    AdaKVPress,
    ChunkPress,
    ComposedPress,
    CriticalKVPress,
    DMSPress,
    KeyRerotationPress,
    KnormPress,
    KVzipPress,
    PerLayerCompressionPress,
    PyramidKVPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)

from kvpress_cpp.cache import cache_bytes, get_state  # noqa: E402
from kvpress_cpp import distributed  # noqa: E402
from kvpress_cpp.distributed import model_tensor_parallel_mesh  # noqa: E402
from kvpress_cpp.paged_cache import PagedKVCache, PagedLayer  # noqa: E402
from kvpress_cpp.presses import (  # noqa: E402
    GVotePress,
    KeepKVPress,
    KVzapPress,
    KVzapThresholdPress,
    WeightedKVPress,
    ZSMergePress,
)
from transformers import DynamicCache  # noqa: E402

from tests.generation import prompt_ids  # noqa: E402
from tests.reference import gather_paged  # noqa: E402

PROMPT_TOKENS = 96
NEW_TOKENS = 12

#: The tiny model's shape: 4 kv heads (2 per rank at N = 2, so each rank still compacts several heads together),
#: 2 query heads per kv head; otherwise tests.models.TINY_SHAPE.
TP_SHAPE = dict(num_attention_heads=8, num_key_value_heads=4)


def _kvzap_scorer(model, surrogates: Path, model_type: str = "linear") -> KVzapPress:
    scorer = KVzapPress(model_type=model_type, surrogate_dir=surrogates / model_type)
    scorer.post_init_from_model(model)  # KeepKV and DMSPress use it as a scorer, which does not load it
    return scorer


#: name → press factory (model, surrogate root), or None. Budgets are far below the prompt: every press evicts or
#: merges.
CASES = {
    "no-press": lambda model, surrogates: None,  # transformers' tensor parallelism alone
    "zsmerge": lambda model, surrogates: ZSMergePress(budget=32),
    "zsmerge-similarity": lambda model, surrogates: ZSMergePress(budget=32, prefill_merge="similarity"),
    "weightedkv": lambda model, surrogates: WeightedKVPress(cache_size=32),
    "keepkv": lambda model, surrogates: KeepKVPress(budget=40, recent=8),
    "keepkv-pyramid": lambda model, surrogates: KeepKVPress(budget=40, recent=8, layer_budgets="pyramid"),
    "keepkv-kvzap-scorer": lambda model, surrogates: KeepKVPress(budget=40, recent=8,
                                                                 scorer=_kvzap_scorer(model, surrogates)),
    "kvzap-linear": lambda model, surrogates: KVzapThresholdPress(
        threshold=0.0, sliding_window=16, model_type="linear", surrogate_dir=surrogates / "linear",
        compaction_slack=4),
    "kvzap-mlp": lambda model, surrogates: KVzapThresholdPress(
        threshold=0.0, sliding_window=16, model_type="mlp", surrogate_dir=surrogates / "mlp", compaction_slack=4),
    "kvzap-in-kvpress-dms": lambda model, surrogates: DMSPress(_kvzap_scorer(model, surrogates, "mlp"),
                                                               threshold=0.0, sliding_window_size=16, decoding=True),
    "snapkv-in-kvpress-dms": lambda model, surrogates: DMSPress(SnapKVPress(window_size=16), threshold=0.01,
                                                                sliding_window_size=16),
    "gvote": lambda model, surrogates: GVotePress(future_positions=64),
    # kvpress's AdaKVPress: one budget shared across all kv heads of the model, however many ranks hold them.
    "adakv-snapkv": lambda model, surrogates: AdaKVPress(SnapKVPress(compression_ratio=0.6, window_size=16)),
    "adakv-kvzap": lambda model, surrogates: AdaKVPress(KVzapPress(compression_ratio=0.6, model_type="mlp",
                                                                   surrogate_dir=surrogates / "mlp")),
    # at ratio 0 kvpress marks nothing, and leaves no marks to take the rank's heads from
    "adakv-kvzap-ratio-0": lambda model, surrogates: AdaKVPress(KVzapPress(compression_ratio=0.0, model_type="mlp",
                                                                           surrogate_dir=surrogates / "mlp")),
    # kvpress's scorers alone: each head's own queries and keys (SnapKV), or every head's attention (TOVA).
    "snapkv": lambda model, surrogates: SnapKVPress(compression_ratio=0.6, window_size=16),
    "pyramidkv": lambda model, surrogates: PyramidKVPress(compression_ratio=0.6, window_size=16),
    "tova": lambda model, surrogates: TOVAPress(compression_ratio=0.6),
    # kvpress's wrappers that act per head, around scorers that score each head alone.
    "snapkv-rerotated": lambda model, surrogates: KeyRerotationPress(SnapKVPress(compression_ratio=0.6,
                                                                                 window_size=16)),
    "knorm-in-chunks": lambda model, surrogates: ChunkPress(KnormPress(compression_ratio=0.5), chunk_length=32),
    "streamingllm-per-layer": lambda model, surrogates: PerLayerCompressionPress(
        StreamingLLMPress(), compression_ratios=[0.4, 0.6]),
}
#: The cases that keep every token: the others must compress something for their comparison to mean anything.
KEEP_EVERY_TOKEN_CASES = {"no-press", "adakv-kvzap-ratio-0"}
#: The cases whose forward hook is kvpress's own code (its presses, and its DMSPress and AdaKVPress around ours).
KVPRESS_HOOK_CASES = {"kvzap-in-kvpress-dms", "snapkv-in-kvpress-dms", "adakv-snapkv", "adakv-kvzap",
                      "adakv-kvzap-ratio-0", "snapkv",
                      "pyramidkv", "tova", "snapkv-rerotated", "knorm-in-chunks", "streamingllm-per-layer"}
#: The cases a model splitting its kv heads over the ranks refuses (:func:`refusals`); one gathering them runs them.
ALL_HEADS_CASES = {"tova"}


#: `architecture` of :func:`write_assets` → (maker in tests.models, its config beyond :data:`TP_SHAPE`). Llama's plan
#: shards the kv heads over the ranks; Phi-3's gathers its packed projection's output, so every rank holds them all.
ARCHITECTURES = {"llama": ("make_tiny_llama", {}), "phi3": ("make_tiny_phi3", {"hidden_size": 128})}


def write_assets(root: Path, architecture: str = "llama") -> tuple[Path, Path]:
    """(model dir, surrogate root): the tiny model of `architecture` and shape :data:`TP_SHAPE` saved with
    save_pretrained (with its tokenizer), and random KVzap surrogates for it (linear and MLP)."""
    from tests import models
    from tests.test_kvzap_press import write_surrogate

    maker, config = ARCHITECTURES[architecture]
    model, tokenizer = getattr(models, maker)(**TP_SHAPE, **config)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    for kind in ("linear", "mlp"):
        write_surrogate(root / "surrogates" / kind, model, kind, seed=1, scale=4.0)
    return root / "model", root / "surrogates"


#: --cache kind → the cache the cases generate with.
CACHE_TYPES = {"dynamic": DynamicCache, "paged": PagedKVCache}


def run_case(model, tokenizer, name: str, surrogates: Path, cache_kind: str = "dynamic") -> dict:
    """Greedy tokens under the press, the cache each layer holds and the press's reported ratios."""
    press = CASES[name](model, surrogates)
    input_ids = prompt_ids(tokenizer, PROMPT_TOKENS).to(model.device)
    cache = CACHE_TYPES[cache_kind]()
    attention_layers = [decoder.self_attn for decoder in model.model.layers]
    for attention in attention_layers:
        attention.masked_key_indices = None  # a previous case's marks
    distributed._LAYER_MESHES.clear()  # what a previous case's press noted of the layers: each press reads them
    with press(model) if press is not None else nullcontext():
        out = model.generate(input_ids, past_key_values=cache, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False)
    tokens = out[:, PROMPT_TOKENS:].cpu()
    layers = []
    for layer, attention in zip(cache.layers, attention_layers):
        state = get_state(layer)
        keys, values, log_weights, per_slot, lengths = layer.keys.cpu(), layer.values.cpu(), None, {}, None
        masked, marked = None, attention.masked_key_indices
        if marked is not None and not isinstance(layer, PagedLayer):  # (a paged layer evicts marks for real)
            masked = torch.zeros(keys.shape[:3], dtype=torch.bool)  # kvpress's head-wise presses' hidden slots
            masked[tuple(index.cpu() for index in marked)] = True
        if state is not None:  # slots appended after the press's last write are plain tokens (b = 0)
            log_weights = state.align(layer.keys.shape[-2], 0).cpu()
            per_slot = {name: tensor.cpu() for name, tensor in state.per_slot.items()}
        elif isinstance(layer, PagedLayer):
            # No log-weights to tell a head's slots from the view's padding (kvpress's masking presses evict for
            # real here, per head): read each head's own slots from its blocks instead.
            key_blocks, value_blocks, _, tables, lengths = (t.cpu() for t in layer.attention_inputs())
            keys, values = gather_paged(key_blocks, tables, lengths), gather_paged(value_blocks, tables, lengths)
        held_on = [layer.keys, layer.values, *([] if state is None else [state.log_weights, *state.per_slot.values()])]
        layers.append({"keys": keys, "values": values, "log_weights": log_weights, "per_slot": per_slot,
                       "lengths": lengths, "masked": masked,
                       "devices": sorted({str(tensor.device) for tensor in held_on})})
    ratios = None
    if isinstance(press, (GVotePress, KVzapThresholdPress)):
        ratios = {"overall": press.compression_ratio, "layers": dict(press.layer_compression_ratios)}
        if isinstance(press, GVotePress):
            ratios["memory"] = dict(press.layer_memory_compression_ratios)
    elif isinstance(press, DMSPress):
        ratios = {"overall": press.compression_ratio, "layers": dict(press.compression_ratios)}
    return {"tokens": tokens, "layers": layers, "bytes": cache_bytes(cache), "ratios": ratios}


def refusals(model, uneven_model_dir: Path) -> dict[str, str]:
    """The errors of the configurations a tensor-parallel run must refuse ("" where none was raised): a press on a
    model whose kv heads do not split over the ranks, and a press that cannot run sharded."""
    from transformers import AutoModelForCausalLM

    uneven = AutoModelForCausalLM.from_pretrained(uneven_model_dir, tp_plan="auto", dtype=torch.float32)
    cases = {"uneven-heads": (uneven, ZSMergePress(budget=32)),
             "kvpress-scorer": (model, KeepKVPress(budget=40, recent=8, scorer=SnapKVPress())),
             "adakv-cross-head-scorer": (model, AdaKVPress(TOVAPress(compression_ratio=0.5))),
             "dms-cross-head-scorer": (model, DMSPress(TOVAPress(), threshold=0.01)),
             "cross-head-press": (model, TOVAPress(compression_ratio=0.6)),
             "composed-cross-head-press": (model, ComposedPress([SnapKVPress(0.2), TOVAPress(0.2)])),
             "wrapped-scorer": (model, CriticalKVPress(SnapKVPress(0.5))),
             "own-context": (model, KVzipPress(compression_ratio=0.5))}
    errors = {}
    for name, (target, press) in cases.items():
        errors[name] = ""
        try:
            with press(target):
                pass
        except ValueError as error:
            errors[name] = str(error)
    return errors


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--surrogates", type=Path, required=True)
    parser.add_argument("--uneven-model", type=Path, help="run the refusals, this model's heads among them")
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--cache", choices=list(CACHE_TYPES), default="dynamic")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, tp_plan="auto", dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    results = {"cases": {}, "ranks": model.tp_size, "rank": model_tensor_parallel_mesh(model).get_local_rank()}
    for name in args.cases:
        with torch.no_grad():
            results["cases"][name] = run_case(model, tokenizer, name, args.surrogates, args.cache)
    if args.uneven_model is not None:
        results["refusals"] = refusals(model, args.uneven_model)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(results, args.out_dir / f"rank{int(os.environ['RANK'])}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
