// Every kvcomp operator schema, in one place. Kernels live in csrc/cpu/<family>.cpp and csrc/cuda/<family>.cu,
// shared validation in csrc/include/kvcomp/<family>.h, device-free math in csrc/kernels/<family>.h, Python fakes in
// kvpress_cpp/_fake.py and typed wrappers in kvpress_cpp/ops.py.
#include <torch/library.h>

TORCH_LIBRARY(kvcomp, m) {
  // scores family: fold the attention probabilities of q new queries (B, Hq, q, T) into per-kv-head float32 scores
  // (B, H, T - q) -> (B, H, T): out = decay^q * scores + input_scale * sum_j decay^(q-1-j) * sum_g attn[g, j].
  m.def("update_scores(Tensor scores, Tensor attn, float decay, float input_scale) -> Tensor");

  // weightedkv family: `evictions` greedy steps of WeightedKV's Algorithm 1 on each (batch, kv-head): evict the middle
  // slot (not the first `sinks`, not the last `recent`) of least mean sums/counts, fold its value into its right
  // neighbour's, weighted by the two means. keys (B, H, T, d), values (B, H, T, d_v), sums, counts (B, H, T) float32
  // -> the same with T - evictions slots.
  m.def(
      "weightedkv_evict(Tensor keys, Tensor values, Tensor sums, Tensor counts, int sinks, int recent, int evictions)"
      " -> (Tensor, Tensor, Tensor, Tensor)");
}
