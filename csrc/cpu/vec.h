// at::vec picks its SIMD implementation from the CPU_CAPABILITY macros, which torch's own build sets per translation
// unit. The extension is compiled for the CPU it is built on (-march, see setup.py), so derive them from the
// compiler's target instead; without this at::vec falls back to scalar loops.
#pragma once

#if !defined(CPU_CAPABILITY)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/common.h"

namespace kvcomp::cpu {

using FloatVec = at::vec::Vectorized<float>;

// at::parallel_for runs a range inline when it is no longer than the grain: aim for tasks of at least this many
// element operations, so that small steps (one decode step is a few microseconds) never pay a thread wake-up.
constexpr int64_t kMinWorkPerTask = 1 << 16;

inline int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kMinWorkPerTask / std::max<int64_t>(1, work_per_item));
}

// count (<= FloatVec::size()) adjacent values as floats, zero-padded.
template <typename scalar_t>
inline FloatVec load_as_float(const scalar_t* values, int64_t count = FloatVec::size()) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return FloatVec::loadu(values, count);
  } else {
    if (count == FloatVec::size()) {  // a whole vector: widened in registers, not through a stack buffer
      FloatVec out;
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        at::vec::load_fp32_from_bf16(values, out);
      } else {
        at::vec::load_fp32_from_fp16(values, out);
      }
      return out;
    }
    float widened[FloatVec::size()] = {};
    for (int64_t i = 0; i < count; ++i) widened[i] = static_cast<float>(values[i]);
    return FloatVec::loadu(widened);
  }
}

// Stores the first count (<= FloatVec::size()) lanes, rounded to scalar_t.
template <typename scalar_t>
inline void store_from_float(const FloatVec& lanes, scalar_t* out, int64_t count = FloatVec::size()) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    lanes.store(out, count);
  } else {
    float narrowed[FloatVec::size()];
    lanes.store(narrowed);
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<scalar_t>(narrowed[i]);
  }
}

// Index of the first largest of count > 0 values, NaN counting as -inf (kernels::MergesFirst's order, which the CUDA
// kernels reduce with): 0 when every value is NaN or -inf. A vectorised maximum, then the first value equal to it; a
// NaN maximum (at::vec::maximum propagates NaN) matches nothing and takes the scalar scan.
inline int64_t first_argmax(const float* values, int64_t count) {
  const float largest =
      at::vec::reduce_all<float>([](FloatVec& a, FloatVec& b) { return at::vec::maximum(a, b); }, values, count);
  const float* found = std::find(values, values + count, largest);
  if (found != values + count) return found - values;
  const auto key = [](float value) { return kernels::is_nan(value) ? -kernels::infinity() : value; };
  int64_t first = 0;
  for (int64_t i = 1; i < count; ++i) {
    if (key(values[i]) > key(values[first])) first = i;
  }
  return first;
}

}  // namespace kvcomp::cpu
