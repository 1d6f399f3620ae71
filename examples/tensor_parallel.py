"""Our presses on a tensor-parallel model: transformers' ``tp_plan="auto"`` under torchrun, each rank with H/N kv heads.

    torchrun --nproc-per-node 3 examples/tensor_parallel.py                       # SmolLM2 (3 kv heads: N = 1 or 3)
    torchrun --nproc-per-node 2 examples/tensor_parallel.py --model random-llama   # random Llama, 4 kv heads
    torchrun --nproc-per-node 4 examples/tensor_parallel.py --model /path/to/a/hf/llama --context-tokens 8000

Every rank runs every press on its own kv heads (gloo on CPU, NCCL on GPUs, chosen by transformers). Rank 0 prints,
per press, the answer, the KV bytes of each rank against the single-process cache and, with ``--compare`` (default
for the built-in models), whether the tokens equal those of a single-process run on rank 0.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM

from kvpress_cpp.cache import cache_bytes
from kvpress_cpp.distributed import check_tensor_parallel
from kvpress_cpp.models import NO_HUB_KERNELS, default_model_dir, load_default_tokenizer, local_model_problem
from kvpress_cpp.presses import GVotePress, KeepKVPress, KVzapThresholdPress, WeightedKVPress, ZSMergePress
from kvpress_cpp.presses.kvzap import DEFAULT_THRESHOLD
from kvpress_cpp.tasks import HiddenFact, hidden_fact_prompt


def presses(kvzap: bool) -> list[tuple[str, object]]:
    """(name, press); None is the full cache. KVzap for --model smollm2 only, whose surrogates ship with the package."""
    chosen = [
        ("full cache", None),
        ("ZSMerge 25%", ZSMergePress(budget=0.25)),
        ("WeightedKV 25%", WeightedKVPress(cache_size=0.25)),
        ("KeepKV 25%", KeepKVPress(budget=0.25)),
        ("KeepKV 25% pyramid", KeepKVPress(budget=0.25, layer_budgets="pyramid")),
        ("GVote (own budget)", GVotePress()),
    ]
    if kvzap:
        chosen.append((f"KVzap-MLP τ={DEFAULT_THRESHOLD:g}", KVzapThresholdPress(model_type="mlp")))
    return chosen


def random_llama_dir(kv_heads: int, layers: int) -> Path:
    """A random Llama (2 query heads per kv head, head_dim 64, SmolLM2's tokenizer) written by rank 0; every rank
    reads the same files."""
    path = Path(tempfile.gettempdir()) / f"kvpress_cpp_random_llama_{kv_heads}kv_{layers}l"
    if dist.get_rank() == 0 and not (path / "model.safetensors").is_file():
        tokenizer = load_default_tokenizer()
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
                             num_hidden_layers=layers, num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads,
                             head_dim=64, initializer_range=0.2,  # peaked attention: no near-ties for the presses
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
    dist.barrier()
    return path


def generate(model, inputs, press, max_new_tokens) -> tuple[torch.Tensor, int]:
    cache = DynamicCache()
    with torch.no_grad(), press(model) if press is not None else nullcontext():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:], cache_bytes(cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, random-llama, or a local HF model directory")
    parser.add_argument("--kv-heads", type=int, default=4, help="random-llama: kv heads")
    parser.add_argument("--layers", type=int, default=4, help="random-llama: layers")
    parser.add_argument("--context-tokens", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                        help="also run each press in one process on rank 0 (default: for the built-in models)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("run it under torchrun, e.g. `torchrun --nproc-per-node 3 examples/tensor_parallel.py`")
    if args.model not in ("smollm2", "random-llama") and (problem := local_model_problem(args.model, hub=False)):
        parser.error(f"--model {args.model}: not smollm2, random-llama or a local HF model directory ({problem}); "
                     f"nothing is downloaded")
    if args.context_tokens < 1 or args.max_new_tokens < 1:
        parser.error("--context-tokens and --max-new-tokens must be at least 1")
    for name in ("kv_heads", "layers"):  # 0 ended in a ZeroDivisionError inside transformers' attention
        if (value := getattr(args, name)) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    if args.model == "smollm2":
        path = default_model_dir()
    elif args.model == "random-llama":
        path = random_llama_dir(args.kv_heads, args.layers)
    else:
        path = Path(args.model)
    compare = args.compare if args.compare is not None else args.model in ("smollm2", "random-llama")

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32, **NO_HUB_KERNELS).eval()
    check_tensor_parallel("examples/tensor_parallel.py", model)  # the full-cache run has no press to refuse it
    tokenizer = AutoTokenizer.from_pretrained(path)
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **NO_HUB_KERNELS).to(model.device).eval() \
        if compare and rank == 0 else None
    fact = HiddenFact()
    inputs = tokenizer(hidden_fact_prompt(tokenizer, args.context_tokens, 0.5, fact), return_tensors="pt")
    inputs = inputs.to(model.device)
    kvzap = args.model == "smollm2"
    if rank == 0:
        config = model.config
        print(f"{path.name}: {config.num_key_value_heads} kv / {config.num_attention_heads} query heads over {ranks} "
              f"ranks ({config.num_key_value_heads // ranks} kv heads each), "
              f"{inputs['input_ids'].shape[1]} prompt tokens\n")
        header = (f"{'press':<20} {'answer':<34} {'KV bytes per rank (MiB)':<26} {'largest / single':>16}"
                  f"{'  same tokens' if compare else ''}")
        print(header + "\n" + "-" * len(header))
    for name, press in presses(kvzap):
        tokens, nbytes = generate(model, inputs, press, args.max_new_tokens)
        per_rank = [None] * ranks
        dist.all_gather_object(per_rank, nbytes)
        if rank == 0:
            answer = tokenizer.decode(tokens, skip_special_tokens=True).replace("\n", " ")[:34]
            shown = ", ".join(f"{b / 2**20:.2f}" for b in per_rank)
            line = f"{name:<20} {answer:<34} {shown:<26}"
            if single is not None:
                single_tokens, single_bytes = generate(single, inputs, press, args.max_new_tokens)
                same = "yes" if torch.equal(tokens, single_tokens) else "NO"
                line += f" {max(per_rank) / single_bytes:>16.3f}  {same}"
            print(line, flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
