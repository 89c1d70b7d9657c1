// nanobind surface of the runtime, shared by _engram_cpu and _engram_cuda.
#pragma once
#include <nanobind/nanobind.h>

namespace jax_engram {
void bind_runtime(nanobind::module_& m, const char* platform);
void bind_gin(nanobind::module_& m);  // module/bind_gin.cc
}
