// Validation shared by the CPU and CUDA EP handlers: dtype names and sizes, buffer shape/dtype checks whose
// messages name the argument, and the static EP configuration checks.
#pragma once
#include <initializer_list>
#include <string>

#include "handlers/common.h"
#include "jax_engram/ep_layout.h"

namespace jax_engram {
namespace validate {

using DT = ffi::DataType;

inline const char* dt_name(DT t) {
  switch (t) {
    case DT::BF16: return "bfloat16";
    case DT::F16: return "float16";
    case DT::F32: return "float32";
    case DT::S32: return "int32";
    case DT::S64: return "int64";
    case DT::F8E4M3FN: return "float8_e4m3fn";
    default: return "other";
  }
}

inline int64_t elt_bytes(DT t) {
  switch (t) {
    case DT::F8E4M3FN: return 1;
    case DT::BF16: case DT::F16: return 2;
    case DT::F32: case DT::S32: return 4;
    default: return 0;
  }
}

// No iostreams here or in any error path: on the GPU image, std::ostream number formatting inside our module
// crashed (locale facets of another libstdc++ in the process); std::to_string is safe.
inline std::string shape_str(const ffi::AnyBuffer& b) {
  std::string s = "[";
  auto d = b.dimensions();
  for (size_t i = 0; i < d.size(); ++i) s += (i ? "," : "") + std::to_string(d[i]);
  return s + "]";
}

// Checks shape (-1 = any extent) and dtype (empty list = any); message names the argument.
inline ffi::Error check(int32_t op, const char* name, const ffi::AnyBuffer& b, std::initializer_list<int64_t> shape,
                 std::initializer_list<DT> dtypes) {
  auto d = b.dimensions();
  bool ok = d.size() == shape.size();
  size_t i = 0;
  for (int64_t want : shape) {
    if (ok && want >= 0 && d[i] != want) ok = false;
    ++i;
  }
  std::string want_s = "[";
  i = 0;
  for (int64_t w : shape) want_s += (i++ ? "," : "") + (w < 0 ? std::string("?") : std::to_string(w));
  want_s += "]";
  if (!ok) return op_error(op, std::string(name) + " must have shape " + want_s + ", got " + shape_str(b));
  if (dtypes.size()) {
    bool dt_ok = false;
    std::string names;
    for (DT t : dtypes) {
      dt_ok |= b.element_type() == t;
      names += (names.empty() ? "" : " or ") + std::string(dt_name(t));
    }
    if (!dt_ok)
      return op_error(op, std::string(name) + " must be " + names + ", got " + dt_name(b.element_type()));
  }
  return ffi::Error::Success();
}

#define JE_CHECK(expr)                     \
  do {                                     \
    ffi::Error _e = (expr);                \
    if (!_e.success()) return _e;          \
  } while (0)

struct Common {
  int64_t R, M, E, E_loc, K, N, rows;
};

inline ffi::Error check_config(int32_t op, Member& m, int64_t num_experts, int64_t M, int64_t expand, int64_t A,
                        int64_t N, int64_t K, Common* c) {
  const int64_t R = m.nranks;
  if (num_experts <= 0 || num_experts % R != 0 || num_experts > kEpMaxExperts)
    return op_error(op, "num_experts=" + std::to_string(num_experts) + " must be a positive multiple of the " +
                            std::to_string(R) + " ranks and <= " + std::to_string(kEpMaxExperts));
  if (num_experts / R > kEpMaxLocalExperts)
    return op_error(op, "num_experts / ranks = " + std::to_string(num_experts / R) + " exceeds " +
                            std::to_string(kEpMaxLocalExperts));
  if (M <= 0 || N > M)
    return op_error(op, "max_tokens_per_rank=" + std::to_string(M) + " must be >= the token count " +
                            std::to_string(N) + " and > 0");
  if (K <= 0 || K > kEpMaxTopk) return op_error(op, "top-k " + std::to_string(K) + " must be in [1, 32]");
  if (A <= 0) return op_error(op, "expert_alignment must be >= 1");
  *c = Common{R, M, num_experts, num_experts / R, K, N, ep_rows(expand != 0, R, M, K, num_experts / R, A)};
  return ffi::Error::Success();
}


}  // namespace validate
}  // namespace jax_engram
