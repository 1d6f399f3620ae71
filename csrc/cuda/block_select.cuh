// Block-wide selection shared by the CUDA kernels: the key of a given rank among one row's slots.
#pragma once

#include <cstdint>

#include "kernels/radix_select.h"

namespace kvcomp::gpu {

// The key of rank `rank` (0-based, ascending) among the unique 64-bit keys key_of(slot) of slots [begin, end), whose
// low 32 bits hold the slot: a radix select from the most significant byte down, one shared-memory histogram per
// byte (the steps of kernels/radix_select.h). Slot bytes that are 0 for every slot < end are skipped. Exactly
// rank + 1 keys are <= the result. Every thread of the block must call it; histogram is shared [256].
template <typename KeyOf>
__device__ uint64_t block_select_key(const KeyOf& key_of, int64_t begin, int64_t end, uint32_t rank,
                                     uint32_t* histogram, uint64_t* shared_prefix, uint32_t* shared_rank) {
  namespace rs = kernels::radix_select;
  uint64_t prefix = 0;
  for (int shift = rs::kFirstShift; shift >= 0; shift -= 8) {
    if (rs::byte_is_zero(shift, end)) continue;
    const uint64_t mask = rs::high_mask(shift);
    for (int i = threadIdx.x; i < 256; i += blockDim.x) histogram[i] = 0;
    __syncthreads();
    for (int64_t slot = begin + threadIdx.x; slot < end; slot += blockDim.x) {
      const uint64_t key = key_of(slot);
      if ((key & mask) == prefix) atomicAdd(&histogram[rs::digit_of(key, shift)], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t below = 0;
      int digit = 0;
      for (; digit < rs::kRadix - 1; ++digit) {
        if (rs::holds_rank(below, histogram[digit], rank)) break;
        below += histogram[digit];
      }
      *shared_prefix = prefix | (static_cast<uint64_t>(digit) << shift);
      *shared_rank = rank - below;
    }
    __syncthreads();
    prefix = *shared_prefix;
    rank = *shared_rank;
  }
  return prefix;
}

}  // namespace kvcomp::gpu
