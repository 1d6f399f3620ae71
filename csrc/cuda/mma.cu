// mma.cuh's host side: whether this build's kernels hold sm_80+ code for the current device.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/CallOnce.h>
#include <c10/util/Exception.h>

#include <memory>
#include <vector>

#include "cuda/mma.cuh"

namespace kvcomp::mma {
namespace {

// Built with the same architecture flags as every kernel of the extension: the code the device runs for it is the
// code it runs for all of them.
__global__ void probe_kernel() {}

}  // namespace

bool code_for_current_device() {
  static const int devices = c10::cuda::device_count();
  static std::vector<c10::once_flag> asked(devices);
  static std::unique_ptr<bool[]> answers(new bool[devices]());
  const c10::DeviceIndex device = c10::cuda::current_device();
  TORCH_CHECK(device >= 0 && device < devices, "kvcomp: CUDA device ", static_cast<int>(device), " is not among the ",
              devices, " devices counted at the first call");
  c10::call_once(asked[device], [device] {
    cudaFuncAttributes attributes;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, probe_kernel));
    answers[device] = attributes.ptxVersion >= 80;
  });
  return answers[device];
}

}  // namespace kvcomp::mma
