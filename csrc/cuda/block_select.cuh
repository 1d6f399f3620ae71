// Block-wide selection shared by the CUDA kernels: the key of a given rank among one row's slots.
#pragma once

#include <cstdint>

namespace kvcomp::gpu {

// The key of rank `rank` (0-based, ascending) among the unique 64-bit keys key_of(slot) of slots [begin, end), whose
// low 32 bits hold the slot: a radix select from the most significant byte down, one shared-memory histogram per
// byte. Slot bytes that are 0 for every slot < end are skipped. Exactly rank + 1 keys are <= the result. Every thread
// of the block must call it; histogram is shared [256].
template <typename KeyOf>
__device__ uint64_t block_select_key(const KeyOf& key_of, int64_t begin, int64_t end, uint32_t rank,
                                     uint32_t* histogram, uint64_t* shared_prefix, uint32_t* shared_rank) {
  uint64_t prefix = 0, mask = 0;
  const uint64_t largest_slot = static_cast<uint64_t>(end - 1);
  for (int shift = 56; shift >= 0; shift -= 8) {
    if (shift < 32 && shift > 0 && (largest_slot >> shift) == 0) {  // this byte is 0 in every key
      mask |= static_cast<uint64_t>(0xffu) << shift;
      continue;
    }
    for (int i = threadIdx.x; i < 256; i += blockDim.x) histogram[i] = 0;
    __syncthreads();
    for (int64_t slot = begin + threadIdx.x; slot < end; slot += blockDim.x) {
      const uint64_t key = key_of(slot);
      if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 0xffu], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t below = 0;
      int digit = 0;
      for (; digit < 255; ++digit) {
        if (rank < below + histogram[digit]) break;
        below += histogram[digit];
      }
      *shared_prefix = prefix | (static_cast<uint64_t>(digit) << shift);
      *shared_rank = rank - below;
    }
    __syncthreads();
    prefix = *shared_prefix;
    rank = *shared_rank;
    mask |= static_cast<uint64_t>(0xffu) << shift;
  }
  return prefix;
}

}  // namespace kvcomp::gpu
