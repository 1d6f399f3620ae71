"""KV-cache bytes held before and after a per-head eviction that keeps 25% of the slots in expectation (each head's
fraction drawn in [12.5%, 37.5%]; `kept_fraction_mean` in the results is what was drawn), with each layer
compacted to its longest head (kvpress_cpp.cache.compact_to_longest_head), against kvpress's way (evicted slots
masked, nothing freed).

    python -m benchmarks.bench_cache            # writes benchmarks/results/cache.json

Target (issue 3): at most 40% of the full cache.
"""

import torch

from benchmarks.common import parse_without_options, print_table, write_results
from kvpress_cpp.cache import LayerState, compact_to_longest_head

SHAPES = [  # (B, H, T, d): SmolLM2-135M's 3 kv heads, a Llama-3-8B-shaped layer
    (1, 3, 4096, 64),
    (1, 8, 8192, 128),
    (4, 8, 8192, 128),
]


def per_head_keep_mask(batch, heads, length, mean_fraction, generator):
    """Each head keeps a different fraction (uniform in [0.5, 1.5] x mean), slots chosen at random."""
    fractions = mean_fraction * (0.5 + torch.rand(batch, heads, 1, generator=generator))
    return torch.rand(batch, heads, length, generator=generator) < fractions


def main() -> None:
    parse_without_options(__doc__)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch, heads, length, dim in SHAPES:
        keys = torch.randn(batch, heads, length, dim, dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        keep = per_head_keep_mask(batch, heads, length, 0.25, generator)
        full = LayerState(torch.zeros(batch, heads, length))
        new_keys, new_values, state = compact_to_longest_head(keys, values, keep, full.log_weights)
        full_bytes = keys.nbytes + values.nbytes
        kept_bytes = new_keys.nbytes + new_values.nbytes + state.nbytes()
        rows.append({"B": batch, "H": heads, "T": length, "d": dim,
                     "kept_fraction_mean": round(float(keep.float().mean()), 3),
                     "kept_fraction_longest_head": round(new_keys.shape[-2] / length, 3),
                     "full_MB": round(full_bytes / 2**20, 1), "kvpress_masked_MB": round(full_bytes / 2**20, 1),
                     "compacted_MB": round(kept_bytes / 2**20, 1),
                     "compacted_fraction": round(kept_bytes / full_bytes, 3)})
    print_table(rows, list(rows[0]))
    print("wrote", write_results("cache", rows))


if __name__ == "__main__":
    main()
