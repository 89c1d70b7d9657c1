#pragma once
#include <memory>

#include "runtime/runtime.h"

namespace jax_engram {
std::unique_ptr<Backend> make_cpu_backend();
}
