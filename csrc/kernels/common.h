// Shared by the device-free math headers: they compile as plain C++ (CPU loops, GoogleTest) and as CUDA.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVCOMP_HOST_DEVICE __host__ __device__
#else
#define KVCOMP_HOST_DEVICE
#endif

namespace kvcomp::kernels {

// The bits of a float and back, on every device: orderings on the bits cannot be optimised away by fast-math flags.
KVCOMP_HOST_DEVICE inline uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

KVCOMP_HOST_DEVICE inline float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

// +inf, usable in host and device code without relaxed-constexpr flags.
KVCOMP_HOST_DEVICE inline float infinity() { return __builtin_huge_valf(); }

// Bitwise NaN test: stays correct under fast-math flags (nvcc --use_fast_math, -ffast-math), which may fold x != x.
KVCOMP_HOST_DEVICE inline bool is_nan(float x) { return (float_bits(x) & 0x7fffffffu) > 0x7f800000u; }

// Where row (b, h) = row / heads, row % heads of a (B, H, ...) tensor with contiguous rows starts, in elements (a
// contiguous tensor, or a paged cache's strided view over its block pools; kvcomp::check_contiguous_rows).
struct RowStrides {
  int64_t batch, head, heads;
  KVCOMP_HOST_DEVICE int64_t offset(int64_t row) const { return row / heads * batch + row % heads * head; }
};

// CPU ops split each (batch, kv head) pair's work into chunks, each a task of at::parallel_for, and combine the
// chunks' partial results in chunk order afterwards. They take enough chunks for kCpuTasksTarget tasks, at most
// kMaxPairChunks per pair and at most `most` (the op's own bound): the count depends on the shape alone, never on the
// thread count, so a result rounds the same on any number of threads (it may round apart in a batch of another size).
constexpr int64_t kCpuTasksTarget = 64;
constexpr int64_t kMaxPairChunks = 16;

inline int64_t chunks_per_pair(int64_t pairs, int64_t most) {
  const int64_t wanted = (kCpuTasksTarget + pairs - 1) / std::max<int64_t>(pairs, 1);
  return std::max<int64_t>(1, std::min({wanted, kMaxPairChunks, most}));
}

// Pool index (block * S + offset) of slot `slot` of the paged-cache (b, h) whose block-table row is `table`.
KVCOMP_HOST_DEVICE inline int64_t pool_slot(const int64_t* table, int64_t slot, int64_t block_size) {
  return table[slot / block_size] * block_size + slot % block_size;
}

}  // namespace kvcomp::kernels
