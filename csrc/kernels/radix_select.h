// Device-free steps of the radix select over unique 64-bit keys whose low 32 bits hold the slot: gpu::block_select_key
// (one block per row) and gvote_union_mask's split select (several blocks per row, a second stage per pass) take the
// same steps, and GoogleTest replays them on the CPU.
//
// One byte per pass, the most significant first: a pass counts the keys that match the digits found so far (all
// bits above its byte) by their byte at `shift`; the digit whose count holds the rank is the result's next byte, and
// the rank becomes the rank among the keys with that digit. After the last pass the digits are the key of that rank.
#pragma once

#include <cstdint>

#include "common.h"

namespace kvcomp::kernels::radix_select {

constexpr int kRadix = 256;
constexpr int kFirstShift = 56;

// The bits above the byte at `shift`: a key takes part in that pass iff it equals the prefix found so far there.
KVCOMP_HOST_DEVICE inline uint64_t high_mask(int shift) {
  return shift >= kFirstShift ? uint64_t{0} : ~uint64_t{0} << (shift + 8);
}

// Whether the pass at `shift` can be skipped: a slot byte (not the lowest) that is 0 in every slot below slot_end,
// so every key has digit 0 there and the prefix keeps a 0.
KVCOMP_HOST_DEVICE inline bool byte_is_zero(int shift, int64_t slot_end) {
  return shift < 32 && shift > 0 && ((slot_end - 1) >> shift) == 0;
}

KVCOMP_HOST_DEVICE inline uint32_t digit_of(uint64_t key, int shift) {
  return static_cast<uint32_t>(key >> shift) & 0xffu;
}

// Whether a digit holds `rank`, `below` counting the matching keys of smaller digits and `count` its own. Exactly one
// digit does while rank < the number of matching keys.
KVCOMP_HOST_DEVICE inline bool holds_rank(uint32_t below, uint32_t count, uint32_t rank) {
  return below <= rank && rank - below < count;
}

}  // namespace kvcomp::kernels::radix_select
