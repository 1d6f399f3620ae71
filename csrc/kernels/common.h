// Shared by the device-free math headers: they compile as plain C++ (CPU loops, GoogleTest) and as CUDA.
#pragma once

#if defined(__CUDACC__)
#define KVCOMP_HOST_DEVICE __host__ __device__
#else
#define KVCOMP_HOST_DEVICE
#endif
