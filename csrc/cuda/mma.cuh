// Warp-level tensor-core building blocks (sm_80 and newer): asynchronous global -> shared copies, ldmatrix, and
// mma.sync m16n8k16 with float16 / bfloat16 inputs and float32 accumulation. The fragment layouts below are PTX's
// (ISA, "Matrix Fragments for mma.m16n8k16"); lane l of a warp is (group l / 4, column pair l % 4):
//   A (16 x 16, row-major), a[4]: a[0] rows group, columns 2 (l % 4) + {0, 1}; a[1] the same 8 rows down;
//                                  a[2], a[3] as a[0], a[1] 8 columns right.
//   B (16 x 8, column-major), b0: rows (k) 2 (l % 4) + {0, 1}, column (n) group; b1 the same 8 rows down.
//   C (16 x 8, float32), c[4]:     c[0], c[1] row group, columns 2 (l % 4) + {0, 1}; c[2], c[3] the same 8 rows down.
// A matrix stored row-major as [m][k] in shared memory is A; one stored as [n][k] (keys or queries one per row, d
// contiguous) is B. ldmatrix hands out exactly these layouts from 8 x 8 blocks of such rows.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace kvcomp::mma {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define KVCOMP_MMA_UNSUPPORTED_ARCH 1  // device code of these helpers traps; the host never launches it there
#endif

__device__ inline unsigned shared_address(const void* pointer) {
  return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

// `bytes` (4 or 16) from global to shared memory without passing through registers; zeros instead when !valid
// (`source` must still be a valid address: nothing is read from it).
template <int bytes>
__device__ inline void copy_async(void* destination, const void* source, bool valid) {
#ifdef KVCOMP_MMA_UNSUPPORTED_ARCH
  __trap();
#else
  static_assert(bytes == 4 || bytes == 16, "cp.async copies 4, 8 or 16 bytes; 16 bypasses L1");
  if constexpr (bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(destination)), "l"(source),
                 "r"(valid ? 16 : 0));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(destination)), "l"(source),
                 "r"(valid ? 4 : 0));
  }
#endif
}

// The copies issued so far by this thread form one group; wait_copies waits for all of this thread's groups (a
// __syncthreads after it makes every thread's copies visible to the block).
__device__ inline void commit_copies() {
#ifndef KVCOMP_MMA_UNSUPPORTED_ARCH
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

__device__ inline void wait_copies() {
#ifndef KVCOMP_MMA_UNSUPPORTED_ARCH
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// Four 8 x 8 blocks of 16-bit elements from shared memory: lane l passes the address of row l % 8 of block l / 8
// (16 contiguous bytes, 16-byte aligned) and receives in r[m] the elements (row l / 4, columns 2 (l % 4) + {0, 1})
// of block m.
__device__ inline void load_blocks_x4(const void* row, uint32_t (&r)[4]) {
#ifdef KVCOMP_MMA_UNSUPPORTED_ARCH
  __trap();
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
#endif
}

// As load_blocks_x4, each block transposed: lane l receives the elements (rows 2 (l % 4) + {0, 1}, column l / 4) of
// block m in r[m]. From a matrix stored row-major as [k][n] (values one slot per row, d contiguous), the B fragments:
// blocks of rows k .. k + 7 and k + 8 .. k + 15 at the same 8 columns give b0 and b1.
__device__ inline void load_blocks_x4_transposed(const void* row, uint32_t (&r)[4]) {
#ifdef KVCOMP_MMA_UNSUPPORTED_ARCH
  __trap();
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
#endif
}

// (a, b) as one A-fragment register of scalar_t (a in the low half, as the fragment's lower column) split in two:
// high = (a, b) rounded, low = what rounding lost, rounded again. high + low carries about twice the dtype's
// significand bits (16 for bfloat16), so an mma with each keeps float32 operands (softmax weights) close to exact.
template <typename scalar_t>
__device__ inline void split_pair(float a, float b, uint32_t& high, uint32_t& low) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    const __nv_bfloat162 rounded = __floats2bfloat162_rn(a, b);
    const __nv_bfloat162 rest = __floats2bfloat162_rn(a - __low2float(rounded), b - __high2float(rounded));
    high = *reinterpret_cast<const uint32_t*>(&rounded);
    low = *reinterpret_cast<const uint32_t*>(&rest);
  } else {
    static_assert(std::is_same_v<scalar_t, at::Half>, "mma::split_pair takes float16 or bfloat16");
    const __half2 rounded = __floats2half2_rn(a, b);
    const __half2 rest = __floats2half2_rn(a - __low2float(rounded), b - __high2float(rounded));
    high = *reinterpret_cast<const uint32_t*>(&rounded);
    low = *reinterpret_cast<const uint32_t*>(&rest);
  }
}

// c += A · B for one 16 x 8 x 16 step (layouts above); scalar_t is at::Half or at::BFloat16.
template <typename scalar_t>
__device__ inline void multiply_add(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef KVCOMP_MMA_UNSUPPORTED_ARCH
  __trap();
#else
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<scalar_t, at::Half>, "mma::multiply_add takes float16 or bfloat16");
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

// 2^x on the special-function unit: relative error about 2^-22, ex2(-inf) = +0, NaN stays NaN; results below
// float32's normal range flush to 0.
__device__ inline float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Softmax in base 2 (logits pre-scaled by log2 e, one ex2 per probability): the shift of a set whose max is `max`,
// 0 for an all -inf set (ex2(-inf - -inf) would be NaN).
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
__device__ inline float exp2_base(float max) { return max == -INFINITY ? 0.0f : max; }

// The sum over the four lanes that hold one row of an accumulator (C layout above), added in a fixed order; every
// lane gets it.
__device__ inline float quad_sum(float value) {
  value += __shfl_xor_sync(0xffffffffu, value, 1);
  return value + __shfl_xor_sync(0xffffffffu, value, 2);
}

#undef KVCOMP_MMA_UNSUPPORTED_ARCH

// Whether the code this build's kernels run on the current device is sm_80+, so that the helpers above do not trap
// (a build for an older architecture, JIT-compiled from its PTX, would). Asked once per device (mma.cu): the answer
// is fixed for the process, and every layer of a prefill or a decoding step would ask again.
bool code_for_current_device();

}  // namespace kvcomp::mma
