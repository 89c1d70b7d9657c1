// Validation shared by the CPU and CUDA EP handlers: dtype names and sizes, buffer shape/dtype checks whose
// messages name the argument, the static EP configuration checks, and every buffer of each EP op (check_dispatch,
// check_dispatch_cached, check_combine: one definition of what the ops accept, for both backends).
#pragma once
#include <initializer_list>
#include <string>

#include "handlers/common.h"
#include "handlers/ep_bindings.h"
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

// Checks shape (-1 = any extent) and dtype (empty list = any); message names the argument. Every handler runs
// several of these per call, so the passing path only compares: the message is built when a check fails.
inline ffi::Error check(int32_t op, const char* name, const ffi::AnyBuffer& b, std::initializer_list<int64_t> shape,
                 std::initializer_list<DT> dtypes) {
  auto d = b.dimensions();
  bool ok = d.size() == shape.size();
  size_t i = 0;
  for (int64_t want : shape) {
    if (ok && want >= 0 && d[i] != want) ok = false;
    ++i;
  }
  if (!ok) {
    std::string want_s = "[";
    i = 0;
    for (int64_t w : shape) want_s += (i++ ? "," : "") + (w < 0 ? std::string("?") : std::to_string(w));
    want_s += "]";
    return op_error(op, std::string(name) + " must have shape " + want_s + ", got " + shape_str(b));
  }
  bool dt_ok = dtypes.size() == 0;
  for (DT t : dtypes) dt_ok |= b.element_type() == t;
  if (!dt_ok) {
    std::string names;
    for (DT t : dtypes) names += (names.empty() ? "" : " or ") + std::string(dt_name(t));
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


// The token threaded between EP ops: float32 (what the Python layer passes: no convert kernel between chained
// ops) or int32, a scalar; token_out has its dtype (the backends copy its 4 bytes).
inline ffi::Error check_token(int32_t op, const ffi::AnyBuffer& token, const ffi::AnyBuffer& token_out) {
  JE_CHECK(check(op, "token", token, {}, {DT::F32, DT::S32}));
  JE_CHECK(check(op, "token_out", token_out, {}, {token.element_type()}));
  return ffi::Error::Success();
}

// Sizes of one EP call, from its validated buffers and static attributes (the same on both backends).
struct EpShapes {
  Common c{};
  int64_t N = 0, H = 0, K = 0;  // tokens, hidden, top-k
  int64_t P = 0;                // dispatch: scale entries per token
  int64_t rows = 0;             // rows of recv_x (dispatch) / y (combine)
  int64_t rows_tok = 0;         // R * max_tokens_per_rank: rows of the rank-major (non-expand) layout
  int64_t row_bytes = 0;        // bytes of an x / y row
  bool has_w = false, has_b0 = false, has_b1 = false;
};

// Row indices are int32 in the kernels and the handle.
inline ffi::Error check_row_count(int32_t op, const EpShapes& s) {
  if (s.rows_tok >= (int64_t{1} << 31) || s.rows >= (int64_t{1} << 31))
    return op_error(op, "R*max_tokens_per_rank must stay below 2^31 rows");
  return ffi::Error::Success();
}

// recv_topk_weights of a dispatch: [rows] (expand) or [R*M, K] (non-expand) with weights, [0] without.
inline ffi::Error check_recv_weights(int32_t op, const ffi::AnyBuffer& recv_topk_weights, const EpShapes& s,
                                     bool expand) {
  if (!s.has_w) return check(op, "recv_topk_weights", recv_topk_weights, {0}, {DT::F32});
  if (expand) return check(op, "recv_topk_weights", recv_topk_weights, {s.rows}, {DT::F32});
  return check(op, "recv_topk_weights", recv_topk_weights, {s.rows_tok, s.K}, {DT::F32});
}

// x [N, H] and x_scales [N, P] of a dispatch, with the config; fills N, H, K (given), P, rows, rows_tok, row_bytes.
inline ffi::Error check_dispatch_input(int32_t op, Member& m, const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scales,
                                       const ffi::AnyBuffer& topk_weights, int64_t K, int64_t num_experts, int64_t M,
                                       int64_t expand, int64_t A, int64_t zero_padding, EpShapes* s) {
  s->N = x.dimensions()[0];
  s->H = x.dimensions()[1];
  s->K = K;
  JE_CHECK(check_config(op, m, num_experts, M, expand, A, s->N, K, &s->c));
  if (zero_padding && !expand) return op_error(op, "zero_padding requires expand");
  JE_CHECK(check(op, "x", x, {s->N, s->H}, {DT::BF16, DT::F16, DT::F32, DT::F8E4M3FN}));
  JE_CHECK(check(op, "x_scales", x_scales, {s->N, -1}, {DT::F32, DT::S32}));
  s->P = x_scales.dimensions()[1];
  s->has_w = topk_weights.dimensions().size() == 2 && topk_weights.dimensions()[1] != 0;
  JE_CHECK(check(op, "topk_weights", topk_weights, {s->N, s->has_w ? K : 0}, {DT::F32}));
  s->rows = s->c.rows;
  s->rows_tok = s->c.R * s->c.M;
  s->row_bytes = s->H * elt_bytes(x.element_type());
  return check_row_count(op, *s);
}

// What full and cached dispatch share besides their inputs: the received rows (recv_x, recv_x_scales,
// recv_topk_weights) and the handle's arrays (psum_rank, psum_expert, unaligned, recv_src_metadata, dst_row),
// which the full dispatch writes and the cached one reads.
inline ffi::Error check_rows_and_handle(int32_t op, const EpShapes& s, const ffi::AnyBuffer& x,
                                        const ffi::AnyBuffer& x_scales, const ffi::AnyBuffer& recv_x,
                                        const ffi::AnyBuffer& recv_x_scales, const ffi::AnyBuffer& recv_topk_weights,
                                        const ffi::AnyBuffer& psum_rank, const ffi::AnyBuffer& psum_expert,
                                        const ffi::AnyBuffer& unaligned, const ffi::AnyBuffer& recv_src_metadata,
                                        const ffi::AnyBuffer& dst_row, bool expand) {
  const Common& c = s.c;
  JE_CHECK(check(op, "recv_x", recv_x, {c.rows, s.H}, {x.element_type()}));
  JE_CHECK(check(op, "recv_x_scales", recv_x_scales, {c.rows, s.P}, {x_scales.element_type()}));
  JE_CHECK(check_recv_weights(op, recv_topk_weights, s, expand));
  JE_CHECK(check(op, "psum_rank", psum_rank, {c.R}, {DT::S32}));
  JE_CHECK(check(op, "psum_expert", psum_expert, {c.E_loc}, {DT::S32}));
  JE_CHECK(check(op, "unaligned", unaligned, {c.E_loc}, {DT::S32}));
  JE_CHECK(check(op, "recv_src_metadata", recv_src_metadata, {s.rows_tok, s.K + 2}, {DT::S32}));
  return check(op, "dst_row", dst_row, {s.N, c.R}, {DT::S32});
}

// Every buffer of a full dispatch.
inline ffi::Error check_dispatch(int32_t op, Member& m, const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scales,
                                 const ffi::AnyBuffer& topk_idx, const ffi::AnyBuffer& topk_weights,
                                 const ffi::AnyBuffer& token, const ffi::AnyBuffer& recv_x,
                                 const ffi::AnyBuffer& recv_x_scales, const ffi::AnyBuffer& recv_topk_idx,
                                 const ffi::AnyBuffer& recv_topk_weights, const ffi::AnyBuffer& psum_rank,
                                 const ffi::AnyBuffer& psum_expert, const ffi::AnyBuffer& unaligned,
                                 const ffi::AnyBuffer& recv_src_metadata, const ffi::AnyBuffer& dst_row,
                                 const ffi::AnyBuffer& num_recv_tokens, const ffi::AnyBuffer& group_sizes,
                                 const ffi::AnyBuffer& token_out, const EpDispatchAttrs& at, EpShapes* s) {
  const int64_t expand = at.expand;
  if (x.dimensions().size() != 2) return op_error(op, "x must be 2-D [N, hidden], got " + shape_str(x));
  if (topk_idx.dimensions().size() != 2) return op_error(op, "topk_idx must be 2-D [N, K], got " + shape_str(topk_idx));
  const int64_t K = topk_idx.dimensions()[1];
  JE_CHECK(check_dispatch_input(op, m, x, x_scales, topk_weights, K, at.num_experts, at.max_tokens_per_rank, expand,
                                at.expert_alignment, at.zero_padding, s));
  const Common& c = s->c;
  JE_CHECK(check(op, "topk_idx", topk_idx, {s->N, K}, {DT::S32}));
  JE_CHECK(check(op, "recv_topk_idx", recv_topk_idx, {expand ? 0 : s->rows_tok, K}, {DT::S32}));
  JE_CHECK(check_rows_and_handle(op, *s, x, x_scales, recv_x, recv_x_scales, recv_topk_weights, psum_rank, psum_expert,
                                 unaligned, recv_src_metadata, dst_row, expand != 0));
  JE_CHECK(check(op, "num_recv_tokens", num_recv_tokens, {}, {DT::S32}));
  JE_CHECK(check(op, "group_sizes", group_sizes, {c.E_loc}, {DT::S32}));
  return check_token(op, token, token_out);
}

// Every buffer of a cached dispatch (the handle in place of topk_idx).
inline ffi::Error check_dispatch_cached(int32_t op, Member& m, const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scales,
                                        const ffi::AnyBuffer& topk_weights, const ffi::AnyBuffer& recv_src_metadata,
                                        const ffi::AnyBuffer& psum_rank, const ffi::AnyBuffer& psum_expert,
                                        const ffi::AnyBuffer& unaligned, const ffi::AnyBuffer& dst_row,
                                        const ffi::AnyBuffer& token, const ffi::AnyBuffer& recv_x,
                                        const ffi::AnyBuffer& recv_x_scales, const ffi::AnyBuffer& recv_topk_weights,
                                        const ffi::AnyBuffer& token_out, const EpDispatchAttrs& at, EpShapes* s) {
  const int64_t expand = at.expand;
  if (x.dimensions().size() != 2) return op_error(op, "x must be 2-D [N, hidden], got " + shape_str(x));
  if (recv_src_metadata.dimensions().size() != 2)
    return op_error(op, "recv_src_metadata must be 2-D [R*M, K+2], got " + shape_str(recv_src_metadata));
  const int64_t K = recv_src_metadata.dimensions()[1] - 2;
  JE_CHECK(check_dispatch_input(op, m, x, x_scales, topk_weights, K, at.num_experts, at.max_tokens_per_rank, expand,
                                at.expert_alignment, at.zero_padding, s));
  JE_CHECK(check_rows_and_handle(op, *s, x, x_scales, recv_x, recv_x_scales, recv_topk_weights, psum_rank, psum_expert,
                                 unaligned, recv_src_metadata, dst_row, expand != 0));
  return check_token(op, token, token_out);
}

// Every buffer of a combine. rows = y's rows: R*M (non-expand) or the dispatch's expand row count, which depends
// on the alignment the combine does not know (the metadata bounds the rows it reads).
inline ffi::Error check_combine(int32_t op, Member& m, const ffi::AnyBuffer& y, const ffi::AnyBuffer& topk_weights,
                                const ffi::AnyBuffer& bias0, const ffi::AnyBuffer& bias1,
                                const ffi::AnyBuffer& recv_src_metadata, const ffi::AnyBuffer& dst_row,
                                const ffi::AnyBuffer& topk_idx, const ffi::AnyBuffer& psum_rank,
                                const ffi::AnyBuffer& token, const ffi::AnyBuffer& combined_x,
                                const ffi::AnyBuffer& combined_topk_weights, const ffi::AnyBuffer& token_out,
                                const EpCombineAttrs& at, EpShapes* s) {
  const int64_t expand = at.expand;
  if (y.dimensions().size() != 2) return op_error(op, "y must be 2-D [rows, hidden], got " + shape_str(y));
  if (topk_idx.dimensions().size() != 2) return op_error(op, "topk_idx must be 2-D [N, K], got " + shape_str(topk_idx));
  const int64_t H = y.dimensions()[1], N = topk_idx.dimensions()[0], K = topk_idx.dimensions()[1];
  s->N = N;
  s->H = H;
  s->K = K;
  JE_CHECK(check_config(op, m, at.num_experts, at.max_tokens_per_rank, 0, 1, N, K, &s->c));
  const Common& c = s->c;
  s->rows_tok = c.R * c.M;
  s->rows = y.dimensions()[0];
  if (!expand && s->rows != s->rows_tok)
    return op_error(op, "y must have R*M=" + std::to_string(s->rows_tok) + " rows (non-expand), got " + shape_str(y));
  JE_CHECK(check(op, "y", y, {s->rows, H}, {DT::BF16, DT::F32}));
  s->has_w = topk_weights.dimensions().size() > 0 && topk_weights.element_count() != 0;
  if (!s->has_w) JE_CHECK(check(op, "topk_weights", topk_weights, {0}, {DT::F32}));
  else if (expand) JE_CHECK(check(op, "topk_weights", topk_weights, {s->rows}, {DT::F32}));
  else JE_CHECK(check(op, "topk_weights", topk_weights, {s->rows_tok, K}, {DT::F32}));
  s->has_b0 = bias0.dimensions().size() == 2 && bias0.dimensions()[0] != 0;
  s->has_b1 = bias1.dimensions().size() == 2 && bias1.dimensions()[0] != 0;
  JE_CHECK(check(op, "bias0", bias0, {s->has_b0 ? N : 0, H}, {y.element_type()}));
  JE_CHECK(check(op, "bias1", bias1, {s->has_b1 ? N : 0, H}, {y.element_type()}));
  JE_CHECK(check(op, "recv_src_metadata", recv_src_metadata, {s->rows_tok, K + 2}, {DT::S32}));
  JE_CHECK(check(op, "dst_row", dst_row, {N, c.R}, {DT::S32}));
  JE_CHECK(check(op, "topk_idx", topk_idx, {N, K}, {DT::S32}));
  JE_CHECK(check(op, "psum_rank", psum_rank, {c.R}, {DT::S32}));
  JE_CHECK(check(op, "combined_x", combined_x, {N, H}, {y.element_type()}));
  JE_CHECK(check(op, "combined_topk_weights", combined_topk_weights, {N, s->has_w ? K : 0}, {DT::F32}));
  JE_CHECK(check_token(op, token, token_out));
  s->row_bytes = H * elt_bytes(y.element_type());
  return check_row_count(op, *s);
}

// The op a guard stands for (kOpEpDispatch or kOpEpCombine, the name its errors carry): known before the member's
// lookup, whose refusal names it.
inline ffi::Error guard_op(const EpGuardAttrs& at, int32_t* op) {
  if (at.combine != 0 && at.combine != 1)
    return op_error(kOpEpDispatch, "guard combine=" + std::to_string(at.combine) + " must be 0 or 1");
  if (at.records < 0 || at.records > 2)
    return op_error(kOpEpDispatch, "guard records=" + std::to_string(at.records) + " must be 0, 1 or 2");
  *op = at.combine ? kOpEpCombine : kOpEpDispatch;
  return ffi::Error::Success();
}

// validate_routing=True (the guard's records = 2): a group's routing records rec [R + 1, 3] (ep_first_offender),
// on the host. The first offender refuses the call with its message; nothing is recorded (the context stays usable).
inline ffi::Error refuse_routing(const Member& m, const int32_t* rec, int64_t R, int64_t num_experts) {
  const int64_t r = ep_first_offender(rec, R);
  if (r < 0) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    describe_routing_refusal(m, rec[R * 3], static_cast<int32_t>(r), rec[r * 3 + 1], rec[r * 3],
                                             rec[r * 3 + 2], num_experts));
}

// Every buffer of a guard: the token, topk_idx [N, K] (int32, K <= 32) and its copy topk_out, num_experts as a
// dispatch takes it.
inline ffi::Error check_guard(int32_t op, const ffi::AnyBuffer& token, const ffi::AnyBuffer& topk_idx,
                              const ffi::AnyBuffer& token_out, const ffi::AnyBuffer& topk_out,
                              const EpGuardAttrs& at) {
  if (topk_idx.dimensions().size() != 2) return op_error(op, "topk_idx must be 2-D [N, K], got " + shape_str(topk_idx));
  JE_CHECK(check(op, "topk_idx", topk_idx, {-1, -1}, {DT::S32}));
  if (topk_idx.dimensions()[1] > kEpMaxTopk)
    return op_error(op, "top-k " + std::to_string(topk_idx.dimensions()[1]) + " must be <= 32");
  if (topk_idx.dimensions()[0] >= (int64_t{1} << 31))
    return op_error(op, "topk_idx must have fewer than 2^31 tokens, got " + shape_str(topk_idx));
  JE_CHECK(check(op, "topk_out", topk_out, {topk_idx.dimensions()[0], topk_idx.dimensions()[1]}, {DT::S32}));
  if (at.records && (topk_idx.dimensions()[0] < 2 || topk_idx.dimensions()[1] != 3))
    return op_error(op, "the routing records must be [R + 1, 3], got " + shape_str(topk_idx));
  if (at.num_experts <= 0 || at.num_experts > kEpMaxExperts)
    return op_error(op, "num_experts=" + std::to_string(at.num_experts) + " must be in [1, " +
                            std::to_string(kEpMaxExperts) + "]");
  return check_token(op, token, token_out);
}

// The local row scatter (bind_ep_local_scatter): x [N, H], dest [N, K <= kEpMaxTopk] s32, src [rows] s32, out
// [rows, H] of x's dtype.
inline ffi::Error check_local_scatter(int32_t op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& dest,
                                      const ffi::AnyBuffer& src, const ffi::AnyBuffer& out) {
  if (x.dimensions().size() != 2) return op_error(op, "x must be 2-D [N, H], got " + shape_str(x));
  const int64_t N = x.dimensions()[0], H = x.dimensions()[1];
  if (dest.dimensions().size() != 2) return op_error(op, "the receive rows must be 2-D [N, K], got " + shape_str(dest));
  JE_CHECK(check(op, "the receive rows", dest, {N, -1}, {DT::S32}));
  if (dest.dimensions()[1] > kEpMaxTopk)
    return op_error(op, "top-k " + std::to_string(dest.dimensions()[1]) + " must be <= " + std::to_string(kEpMaxTopk));
  if (src.dimensions().size() != 1) return op_error(op, "the source tokens must be 1-D [rows], got " + shape_str(src));
  JE_CHECK(check(op, "the source tokens", src, {-1}, {DT::S32}));
  if (out.dimensions().size() != 2 || out.dimensions()[0] != src.dimensions()[0] || out.dimensions()[1] != H ||
      out.element_type() != x.element_type())
    return op_error(op, "recv_x must be [" + std::to_string(src.dimensions()[0]) + ", " + std::to_string(H) +
                            "] of x's dtype, got " + shape_str(out));
  if (N >= (int64_t{1} << 31) || src.dimensions()[0] >= (int64_t{1} << 31))
    return op_error(op, "the local scatter takes fewer than 2^31 tokens and rows");
  return ffi::Error::Success();
}

// The local expand dispatch (bind_ep_local_dispatch): the token pair, topk [N, K] s32 with 1 <= N * K < 2^31 and
// K <= kEpMaxTopk, E in [1, kEpMaxLocalExperts] (one rank holds every expert), M >= N, fewer than 2^31 rows, metadata
// entries and layout rows (N * K + (A - 1) * E); x [N, H] and recv_x [rows, H] of one dtype, fewer than 2^31 bytes per
// row; w [N * K] float32 with recv_w [rows], or both [0] (no weights); every layout output int32 of its documented
// shape; scratch s32 [ep_local_dispatch_scratch_words(N, K, E)]. Returns the sizes.
struct LocalLayoutShape {
  int64_t N = 0, K = 0, E = 0, M = 0, rows = 0;
};
inline ffi::Error check_local_dispatch(int32_t op, const ffi::AnyBuffer& token, const ffi::AnyBuffer& token_out,
                                       const ffi::AnyBuffer& topk, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                       const ffi::AnyBuffer& recv_x, const ffi::AnyBuffer& recv_w,
                                       const ffi::AnyBuffer& exp_row,
                                     const ffi::AnyBuffer& src_entry, const ffi::AnyBuffer& src_tok,
                                     const ffi::AnyBuffer& count, const ffi::AnyBuffer& aligned,
                                     const ffi::AnyBuffer& psum_expert, const ffi::AnyBuffer& meta,
                                     const ffi::AnyBuffer& dst_row, const ffi::AnyBuffer& num_recv,
                                     const ffi::AnyBuffer& scratch, int64_t alignment, LocalLayoutShape* shape) {
  if (topk.dimensions().size() != 2) return op_error(op, "topk_idx must be 2-D [N, K], got " + shape_str(topk));
  const int64_t N = topk.dimensions()[0], K = topk.dimensions()[1];
  JE_CHECK(check(op, "topk_idx", topk, {N, K}, {DT::S32}));
  if (N * K < 1 || N * K >= (int64_t{1} << 31) || K > kEpMaxTopk)
    return op_error(op, "the local layout takes 1 to 2^31 - 1 entries of top-k <= " + std::to_string(kEpMaxTopk) +
                            ", got " + shape_str(topk));
  if (count.dimensions().size() != 1) return op_error(op, "the counts must be 1-D [E], got " + shape_str(count));
  const int64_t E = count.dimensions()[0];
  if (E < 1 || E > kEpMaxLocalExperts)
    return op_error(op, "num_experts=" + std::to_string(E) + " must be in [1, " + std::to_string(kEpMaxLocalExperts) +
                            "] at one rank");
  if (meta.dimensions().size() != 2) return op_error(op, "the metadata must be 2-D [M, K + 2], got " + shape_str(meta));
  const int64_t M = meta.dimensions()[0];
  if (M < N) return op_error(op, "max_tokens_per_rank=" + std::to_string(M) + " is below the " + std::to_string(N) +
                                     " tokens");
  if (src_entry.dimensions().size() != 1)
    return op_error(op, "the source entries must be 1-D [rows], got " + shape_str(src_entry));
  const int64_t rows = src_entry.dimensions()[0];
  if (rows >= (int64_t{1} << 31)) return op_error(op, "the local layout takes fewer than 2^31 rows");
  // Every segment start and receive row is below N * K + (A - 1) * E, which must fit int32 (the kernels' type).
  if (alignment < 1 || alignment >= (int64_t{1} << 31) || N * K + (alignment - 1) * E >= (int64_t{1} << 31))
    return op_error(op, "expert_alignment=" + std::to_string(alignment) + " must be >= 1 and keep N * K + (A - 1) * E = " +
                            "the layout's last row below 2^31 (N * K = " + std::to_string(N * K) + ", E = " +
                            std::to_string(E) + ")");
  if (M * (K + 2) >= (int64_t{1} << 31))
    return op_error(op, "recv_src_metadata [M, K + 2] must have fewer than 2^31 entries, got M = " +
                            std::to_string(M));
  JE_CHECK(check(op, "the receive rows", exp_row, {N, K}, {DT::S32}));
  JE_CHECK(check(op, "the source entries", src_entry, {rows}, {DT::S32}));
  JE_CHECK(check(op, "the source tokens", src_tok, {rows}, {DT::S32}));
  JE_CHECK(check(op, "the counts", count, {E}, {DT::S32}));
  JE_CHECK(check(op, "the aligned counts", aligned, {E}, {DT::S32}));
  JE_CHECK(check(op, "psum_num_recv_tokens_per_expert", psum_expert, {E}, {DT::S32}));
  JE_CHECK(check(op, "recv_src_metadata", meta, {M, K + 2}, {DT::S32}));
  JE_CHECK(check(op, "dst_row", dst_row, {N, 1}, {DT::S32}));
  JE_CHECK(check(op, "num_recv_tokens", num_recv, {1}, {DT::S32}));
  JE_CHECK(check(op, "the dispatch's scratch", scratch, {ep_local_dispatch_scratch_words(N, K, E)}, {DT::S32}));
  JE_CHECK(check_token(op, token, token_out));
  if (x.dimensions().size() != 2 || x.dimensions()[0] != N)
    return op_error(op, "x must be [" + std::to_string(N) + ", H], got " + shape_str(x));
  const int64_t row_bytes = x.dimensions()[1] * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  if (row_bytes >= (int64_t{1} << 31)) return op_error(op, "x's rows must have fewer than 2^31 bytes");
  if (recv_x.dimensions().size() != 2 || recv_x.dimensions()[0] != rows ||
      recv_x.dimensions()[1] != x.dimensions()[1] || recv_x.element_type() != x.element_type())
    return op_error(op, "recv_x must be [" + std::to_string(rows) + ", " + std::to_string(x.dimensions()[1]) +
                            "] of x's dtype, got " + shape_str(recv_x));
  const int64_t nw = w.element_count();
  if (nw != 0 && nw != N * K) return op_error(op, "topk_weights must have N * K entries or none, got " + shape_str(w));
  JE_CHECK(check(op, "topk_weights", w, {nw}, {DT::F32}));
  JE_CHECK(check(op, "recv_topk_weights", recv_w, {nw ? rows : 0}, {DT::F32}));
  *shape = LocalLayoutShape{N, K, E, M, rows};
  return ffi::Error::Success();
}

}  // namespace validate
}  // namespace jax_engram
