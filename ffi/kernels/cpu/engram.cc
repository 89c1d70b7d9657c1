// CPU Engram gather: row copies straight from the owner's window segment (mapped in this process) into
// the output, the scale factors from the replicated table. Runs on XLA's executor thread.
#include "kernels/cpu/engram.h"

#include <cstring>

#include "jax_engram/engram_layout.h"

namespace jax_engram::cpu {

int64_t engram_first_out_of_range(const int32_t* ids, int64_t n, int64_t total) {
  for (int64_t i = 0; i < n; ++i)
    if (static_cast<int64_t>(ids[i]) >= total) return i;
  return -1;
}

void engram_gather(const EngramGather& g) {
  const int64_t n = g.T * g.E;
  const int64_t total = static_cast<int64_t>(g.nranks) * g.num_entries;
  const int64_t rb = g.row_bytes;
  for (int64_t i = 0; i < n; ++i) {
    bool oob = false;
    const int64_t id = engram::resolve_id(g.ids[i], total, g.mode, &oob);
    uint8_t* dst = g.out + i * rb;
    if (id < 0) {
      std::memset(dst, 0, rb);
      continue;
    }
    const int64_t owner = id / g.num_entries, row = id % g.num_entries;
    std::memcpy(dst, g.peers[owner] + g.offset + row * rb, rb);
  }
  if (!g.sf_table || g.P == 0) return;
  const int64_t EP = g.E * g.P;
  if (g.sf_layout == engram::kSfTmaColMajor) {
    std::memset(g.sf_out, 0, engram::sf_out_elems(g.T, EP, g.sf_layout) * sizeof(uint32_t));
  }
  for (int64_t i = 0; i < n; ++i) {
    bool oob = false;
    const int64_t id = engram::resolve_id(g.ids[i], total, g.mode, &oob);
    const int64_t t = i / g.E, e = i % g.E;
    for (int64_t p = 0; p < g.P; ++p) {
      const int64_t j = e * g.P + p;
      g.sf_out[engram::sf_out_index(t, j, g.T, EP, g.sf_layout)] = id < 0 ? 0u : g.sf_table[id * g.P + p];
    }
  }
}

}  // namespace jax_engram::cpu
