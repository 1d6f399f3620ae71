// Shared memory per block. A kernel's static __shared__ arrays and a launch's dynamic bytes count against one
// per-block limit: 48 KiB unless the kernel opts in (cudaFuncAttributeMaxDynamicSharedMemorySize), up to the device's
// opt-in maximum (227 KiB on sm_90). A check that looks at the dynamic bytes alone passes launches that then fail.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

#include <cstddef>

namespace kvcomp::gpu {

constexpr size_t kSharedBytesWithoutOptIn = 48 * 1024;

// The static shared memory of a compiled kernel.
template <typename Kernel>
size_t static_shared_bytes(Kernel kernel) {
  cudaFuncAttributes attributes;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  return attributes.sharedSizeBytes;
}

// Lets every launch of `kernel` on the current device take as much dynamic shared memory as the device allows beside
// its static bytes (static_shared_bytes(kernel), which a decode path asks once), and returns that amount for the
// caller's check (which names its own values). Always the device's most, never one launch's size: a host thread
// setting its smaller size would fail another's launch in between.
template <typename Kernel>
size_t allow_most_dynamic_shared_bytes(Kernel kernel, size_t static_bytes) {
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, c10::cuda::current_device()));
  const size_t allowed = static_cast<size_t>(optin) - static_bytes;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(allowed)));
  return allowed;
}

}  // namespace kvcomp::gpu
