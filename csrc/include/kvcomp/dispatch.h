// Dtype dispatch limited to the cache dtypes the ops accept (check_floating): float32, float16, bfloat16. Unlike
// AT_DISPATCH_FLOATING_TYPES_AND2 it instantiates no float64 kernel that validation would never let run.
#pragma once

#include <ATen/Dispatch.h>

#define KVCOMP_DISPATCH_CACHE_TYPES(TYPE, NAME, ...)               \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                   \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)     \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)      \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))
