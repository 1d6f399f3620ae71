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

#include <ATen/cpu/vec/vec.h>
