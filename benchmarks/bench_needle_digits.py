"""Where a needle's digits go under each press, question-aware, exactly as kvpress's evaluation runs it.

For examples of the question-aware needle evaluation (``kvpress_cpp.evaluation.results --query-aware --families
niah``: the same generated data, kvpress's pipeline preprocessing, its ``generate_answer``), each press compresses
the context + question, answers, and for every layer and kv head we check which of the needle's digit tokens (one
token per digit on SmolLM2) are still held as a plain slot: a slot whose key equals the uncompressed cache's key of
that token. A digit not held plain was merged (its key changed: ZSMerge's residual slot, KeepKV's ZIP merge, or a
plain slot another token merged into) or evicted (WeightedKV drops the key and folds the value into the right
neighbour). Reported after the prefill and after the answer, with the question's own tokens likewise.

    python -m benchmarks.bench_needle_digits --examples 1:3 --presses zsmerge weightedkv keepkv streaming --detail

``--examples b:r`` names row r of batch b of the evaluation data (``2048-niah<b>``, generated here as the
documented question-aware run generates it: ``--examples 4`` per batch, data seed 0); ``--detail`` prints the per
layer / kv head map (x: digit held plain).
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch
from kvpress import SnapKVPress, StreamingLLMPress, TOVAPress
from transformers import DynamicCache

from benchmarks.common import positive_int, prompt_fraction, write_results
from kvpress_cpp.evaluation import launch
from kvpress_cpp.evaluation.models import DEFAULT_MODEL_NAME, kvpress_pipeline
from kvpress_cpp.evaluation.results import Config, family_examples, prepare_data
from kvpress_cpp.presses import KeepKVPress, WeightedKVPress, ZSMergePress

# The question-aware needle run of docs/evaluation.md: 2048 tokens, 4 examples per batch, the results run's data seed.
LENGTH, EXAMPLES_PER_BATCH, DATA_SEED = 2048, 4, 0
PRESSES = {
    "zsmerge": lambda kept: ZSMergePress(budget=kept),
    "weightedkv": lambda kept: WeightedKVPress(cache_size=kept),
    "keepkv": lambda kept: KeepKVPress(budget=kept),
    "keepkv recent 32": lambda kept: KeepKVPress(budget=kept, recent=32),
    "streaming": lambda kept: StreamingLLMPress(compression_ratio=1 - kept),
    "tova": lambda kept: TOVAPress(compression_ratio=1 - kept),
    "snapkv": lambda kept: SnapKVPress(compression_ratio=1 - kept),
}


def held_plain(cache, reference, positions: list[int]) -> torch.Tensor:
    """(layers, kv heads, positions) bool: some slot of the layer and head holds the reference key of the position."""
    held = []
    for layer, keys in zip(cache.layers, reference):
        wanted = keys[0][:, positions]  # (H, P, d)
        distance = (layer.keys[0].unsqueeze(2) - wanted.unsqueeze(1)).abs().amax(-1)  # (H, slots, P)
        held.append((distance < 1e-4).any(1))
    return torch.stack(held)


def subsequence(sequence: list[int], part: list[int]) -> int:
    return next(i for i in range(len(sequence) - len(part) + 1) if sequence[i:i + len(part)] == part)


def batch_and_row(text: str) -> tuple[int, int]:
    """An argparse type: "b:r", row r (0 to EXAMPLES_PER_BATCH - 1) of the evaluation's needle batch b >= 0."""
    try:
        batch, row = map(int, text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected b:r (two integers), got {text!r}") from None
    if batch < 0 or not 0 <= row < EXAMPLES_PER_BATCH:
        raise argparse.ArgumentTypeError(f"expected a batch >= 0 and a row in 0-{EXAMPLES_PER_BATCH - 1}, got {text}")
    return batch, row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", nargs="+", type=batch_and_row, default=[(0, 0), (1, 3)],
                        help=f"b:r, row r (0-{EXAMPLES_PER_BATCH - 1}) of needle batch b")
    parser.add_argument("--presses", nargs="+", choices=list(PRESSES), default=["zsmerge", "weightedkv", "keepkv"])
    parser.add_argument("--kept", type=prompt_fraction, default=0.25, help="fraction of the prompt kept")
    parser.add_argument("--detail", action="store_true")
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = kvpress_pipeline("kv-press-text-generation", DEFAULT_MODEL_NAME)
    model, tokenizer = pipe.model, pipe.tokenizer
    batches = [Config("no_press", 0.0, LENGTH, "niah", batch) for batch in sorted({b for b, _ in args.examples})]
    files = prepare_data(launch.cache_dir("evaluation-data"), DEFAULT_MODEL_NAME,
                         family_examples(batches, EXAMPLES_PER_BATCH), DATA_SEED)
    rows = []
    for batch, row in args.examples:
        example = f"{batch}:{row}"
        data = pd.read_parquet(files[f"{LENGTH}-niah{batch}"]).iloc[row]
        inputs = pipe.preprocess(data.context + data.question, [""], data.answer_prefix, max_context_length=10 ** 9)
        context, question = inputs["context_ids"], inputs["questions_ids"][0]
        answer = list(data.answer)[0]
        ids, length = context[0].tolist(), context.shape[1]
        needle = tokenizer.encode(answer, add_special_tokens=False)
        start = subsequence(ids, needle)
        digits = list(range(start, start + len(needle)))
        asked = list(range(length - len(tokenizer.encode(data.question, add_special_tokens=False)), length))
        with torch.no_grad():
            full = DynamicCache()
            model.model(input_ids=context, past_key_values=full)
        reference = [layer.keys.clone() for layer in full.layers]
        print(f"== {example} {data.task}: answer {answer}, {length} tokens, needle at {start} "
              f"({start / length:.2f} of the prompt)", flush=True)
        for name in args.presses:
            cache = DynamicCache()
            with torch.no_grad(), PRESSES[name](args.kept)(model):
                model.model(input_ids=context, past_key_values=cache)
                after_prefill = held_plain(cache, reference, digits)
                question_held = held_plain(cache, reference, asked)
                said = pipe.generate_answer(question, cache, length, int(data.max_new_tokens))
                after_answer = held_plain(cache, reference, digits)
            result = {"example": example, "task": data.task, "answer": answer, "needle_at": round(start / length, 3),
                      "press": name, "said": said, "correct": answer in said,
                      "digits_held_after_prefill": [round(x, 2) for x in after_prefill.float().mean((0, 1)).tolist()],
                      "digits_held_after_answer": [round(x, 2) for x in after_answer.float().mean((0, 1)).tolist()],
                      "question_held": round(float(question_held.float().mean()), 3)}
            rows.append(result)
            print(f"{name:17s} said {said!r:20s} digits held plain (share of layer x head) after prefill "
                  f"{result['digits_held_after_prefill']}, after the answer {result['digits_held_after_answer']}; "
                  f"question tokens held {result['question_held']:.2f}", flush=True)
            if args.detail:
                for layer, heads in enumerate(after_prefill.tolist()):
                    print(f"   layer {layer:2d} " + " ".join("".join("x" if d else "." for d in h) for h in heads))
    write_results("needle_digits", rows)


if __name__ == "__main__":
    main()
