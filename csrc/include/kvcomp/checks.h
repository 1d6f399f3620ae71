// Validation helpers shared by every op. Each error names the op and the offending value, so a user reading
// "kvcomp::update_scores: expected attn ..." knows which call to fix.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <ostream>
#include <sstream>
#include <utility>

#include "kernels/common.h"

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

// A double streamed as its shortest round-trip digits (Python's repr): the stream's default 6 digits print
// 1.0000001 as 1, so a value just outside a range would read as one inside it.
struct Exact {
  double value;
};

inline std::ostream& operator<<(std::ostream& out, Exact exact) {
  char digits[32];
  const char* end = std::to_chars(digits, digits + sizeof(digits), exact.value).ptr;
  return out.write(digits, end - digits);
}

inline void check_range(const char* op, const char* name, double value, double low, double high) {
  TORCH_CHECK(value >= low && value <= high, op, ": expected ", name, " in [", Exact{low}, ", ", Exact{high}, "], got ",
              Exact{value});
}

// Scalars arrive as Python floats (double) and the kernels compute with them in float32, where a double beyond
// float32's range (about 3.4e38) is inf: a scale of 1e39 passed std::isfinite and gave NaN probabilities.
inline bool is_finite_float32(double value) {
  return std::isfinite(value) && std::fabs(value) <= static_cast<double>(std::numeric_limits<float>::max());
}

inline void check_finite(const char* op, const char* name, double value) {
  TORCH_CHECK(is_finite_float32(value), op, ": expected a finite float32 ", name, ", got ", Exact{value});
}

// A finite float32 value > 0, or >= 0 where zero_allowed (an attention scale, a score weight).
inline void check_finite_positive(const char* op, const char* name, double value, bool zero_allowed = false) {
  TORCH_CHECK(is_finite_float32(value) && (zero_allowed ? value >= 0.0 : value > 0.0), op,
              ": expected a finite float32 ", name, zero_allowed ? " >= 0" : " > 0", ", got ", Exact{value});
}

inline void check_at_least(const char* op, const char* name, int64_t value, int64_t low) {
  TORCH_CHECK(value >= low, op, ": expected ", name, " >= ", low, ", got ", value);
}

// For the tensors an op updates in place: a silent .contiguous() copy would update the copy, not the caller's cache.
inline void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), op, ": expected a contiguous ", name, " (it is updated in place), got strides ",
              t.strides(), " for shape ", t.sizes());
}

// Whether t (B, H, ...) has each (batch, kv head) row contiguous and the rows in (batch, head) order, each at or after
// the end of the previous, at any stride: a contiguous tensor, or a paged cache's strided view over its block pools.
// An empty tensor is, whatever its strides (a contiguous one with d = 0 has strides of size-1 dims): nothing moves.
inline bool has_contiguous_rows(const at::Tensor& t) {
  if (t.numel() == 0) return t.dim() >= 2;
  bool ordered = t.dim() >= 2;
  int64_t row = 1;
  for (int64_t dim = t.dim() - 1; dim >= 2; --dim) {
    ordered &= t.size(dim) <= 1 || t.stride(dim) == row;
    row *= t.size(dim);
  }
  if (ordered) {
    ordered &= t.size(1) <= 1 || t.stride(1) >= row;
    const int64_t heads_span = t.size(1) <= 1 ? row : (t.size(1) - 1) * t.stride(1) + row;
    ordered &= t.size(0) <= 1 || t.stride(0) >= heads_span;
  }
  return ordered;
}

// For the tensors an op updates in place one row at a time: has_contiguous_rows (the op then updates a paged cache's
// view where it lies, without a copy in or out).
inline void check_contiguous_rows(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(has_contiguous_rows(t), op, ": expected ", name, " with contiguous (batch, kv head) rows in order (it is updated in ",
              "place row by row), got strides ", t.strides(), " for shape ", t.sizes());
}

// The row strides of a tensor with contiguous rows (has_contiguous_rows), for the kernels.
inline kernels::RowStrides row_strides(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.size(1)}; }

// Whether the (batch, kv head) rows of t (B, H, T, d), at t's batch and head strides, can be moved 16 bytes at a time:
// each starts on a 16-byte boundary and each slot is whole 16-byte chunks.
inline bool rows_in_16_byte_chunks(const at::Tensor& t) {
  const int64_t element = static_cast<int64_t>(t.element_size());
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 && (t.size(3) * element) % 16 == 0 &&
         (t.stride(0) * element) % 16 == 0 && (t.stride(1) * element) % 16 == 0;
}

// row_strides(t) in units of `elements` elements (the 16-byte chunks of rows_in_16_byte_chunks).
inline kernels::RowStrides row_strides(const at::Tensor& t, int64_t elements) {
  return {t.stride(0) / elements, t.stride(1) / elements, t.size(1)};
}

// For the (B, H, ...) tensors a kernel only reads row by row through row_strides(): t itself when its rows are
// contiguous (a paged cache's view is read where it lies), otherwise a contiguous copy.
inline at::Tensor with_contiguous_rows(const at::Tensor& t) { return has_contiguous_rows(t) ? t : t.contiguous(); }

// Any strides over the leading dims are read in place; the last dim must be contiguous, otherwise t is copied.
inline at::Tensor with_unit_stride_last(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// Sums of size arguments (slot budgets) computed without overflow: a wrapped sum would pass the size checks and let a
// kernel read wild memory.
inline int64_t checked_sum(const char* op, std::initializer_list<std::pair<const char*, int64_t>> terms) {
  int64_t total = 0;
  bool overflow = false;
  for (const auto& term : terms) overflow |= __builtin_add_overflow(total, term.second, &total);
  if (overflow) {
    std::ostringstream names, values;
    for (const auto& term : terms) {
      names << (names.tellp() > 0 ? " + " : "") << term.first;
      values << (values.tellp() > 0 ? ", " : "") << term.first << " = " << term.second;
    }
    TORCH_CHECK(false, op, ": expected ", names.str(), " to fit in 64 bits, got ", values.str());
  }
  return total;
}

// Whether two tensors' byte ranges in one storage intersect (at::get_overlap_status for dense tensors; for strided
// rows, conservative: interleaved tensors of one storage count as overlapping).
inline bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.has_storage() || !b.has_storage() ||
      !a.storage().is_alias_of(b.storage())) {
    return false;
  }
  const auto byte_range = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t dim = 0; dim < t.dim(); ++dim) last += (t.size(dim) - 1) * t.stride(dim);
    const int64_t begin = t.storage_offset() * static_cast<int64_t>(t.element_size());
    return std::make_pair(begin, begin + (last + 1) * static_cast<int64_t>(t.element_size()));
  };
  const auto [a_begin, a_end] = byte_range(a);
  const auto [b_begin, b_end] = byte_range(b);
  return a_begin < b_end && b_begin < a_end;
}

// The arguments an op updates in place: none may overlap itself or another one (the kernel would read what it just
// wrote), and none may require grad (the op has no backward, and an in-place update would silently detach the cache).
// Their layout (contiguous, or contiguous rows in order) is checked first, so no argument overlaps itself and the
// storage ranges compared here bound what each one touches.
inline void check_inplace_arguments(const char* op,
                                    std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  for (auto a = tensors.begin(); a != tensors.end(); ++a) {
    const at::Tensor& t = *a->second;
    TORCH_CHECK(!t.requires_grad(), op, ": expected ", a->first, " not to require grad (it is updated in place and ",
                "the op has no backward), got a tensor with requires_grad=True");
    TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": expected ", a->first,
                " without internal overlap (it is updated in place), got strides ", t.strides(), " for shape ",
                t.sizes());
    for (auto b = tensors.begin(); b != a; ++b) {
      TORCH_CHECK(!may_overlap(t, *b->second), op, ": expected ", a->first,
                  " and ", b->first, " to be separate memory (both are updated in place), got overlapping tensors");
    }
  }
}

// The arguments an op only reads, against those it updates in place: none may share memory with one (a read after
// the kernel's own writes would see them: a length or a block index read back after a position was written over it
// leaves the range validated before the kernel, and reads or writes wild memory), and none may require grad (the op
// has no backward: what it writes in place from them would silently lose their graph).
inline void check_inputs_apart(const char* op,
                               std::initializer_list<std::pair<const char*, const at::Tensor*>> updated,
                               std::initializer_list<std::pair<const char*, const at::Tensor*>> read) {
  for (const auto& input : read) {
    TORCH_CHECK(!input.second->requires_grad(), op, ": expected ", input.first, " not to require grad (the op ",
                "updates its cache in place from it and has no backward), got a tensor with requires_grad=True");
    for (const auto& target : updated) {
      TORCH_CHECK(!may_overlap(*input.second, *target.second), op, ": expected ", input.first, " and ", target.first,
                  " to be separate memory (", target.first, " is updated in place), got overlapping tensors");
    }
  }
}

// A CUDA grid dimension: x holds up to 2^31 - 1 blocks, y and z up to 65535. Checked rather than cast blindly, so a
// huge batch is an error naming the op, not a launch of a wrapped-around grid.
inline unsigned grid_dim(const char* op, const char* what, int64_t blocks,
                         int64_t limit = std::numeric_limits<int32_t>::max()) {
  TORCH_CHECK(blocks >= 0 && blocks <= limit, op, ": expected at most ", limit, " CUDA blocks for ", what, ", got ",
              blocks);
  return static_cast<unsigned>(blocks);
}

}  // namespace kvcomp
