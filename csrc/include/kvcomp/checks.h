// Validation helpers shared by every op. Each error names the op and the offending value, so a user reading
// "kvcomp::update_scores: expected attn ..." knows which call to fix.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace kvcomp {

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim, const char* layout) {
  TORCH_CHECK(t.dim() == dim, op, ": expected ", name, " of shape ", layout, ", got a ", t.dim(),
              "-d tensor of shape ", t.sizes());
}

inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim, int64_t expected,
                       const char* meaning) {
  TORCH_CHECK(t.size(dim) == expected, op, ": expected ", name, ".size(", dim, ") == ", expected, " (", meaning,
              "), got ", name, " of shape ", t.sizes());
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType expected) {
  TORCH_CHECK(t.scalar_type() == expected, op, ": expected ", name, " of dtype ", expected, ", got ",
              t.scalar_type());
}

// The cache dtypes a kernel is instantiated for.
inline void check_floating(const char* op, const char* name, const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op, ": expected ", name,
              " of dtype float32, float16 or bfloat16, got ", dtype);
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                              const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": expected ", name, " on the device of ", ref_name, " (",
              ref.device(), "), got ", t.device());
}

inline void check_range(const char* op, const char* name, double value, double low, double high) {
  TORCH_CHECK(value >= low && value <= high, op, ": expected ", name, " in [", low, ", ", high, "], got ", value);
}

inline void check_finite(const char* op, const char* name, double value) {
  TORCH_CHECK(std::isfinite(value), op, ": expected a finite ", name, ", got ", value);
}

inline void check_at_least(const char* op, const char* name, int64_t value, int64_t low) {
  TORCH_CHECK(value >= low, op, ": expected ", name, " >= ", low, ", got ", value);
}

// For the tensors an op updates in place: a silent .contiguous() copy would update the copy, not the caller's cache.
inline void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), op, ": expected a contiguous ", name, " (it is updated in place), got strides ",
              t.strides(), " for shape ", t.sizes());
}

}  // namespace kvcomp
