// Engram request planning over (node, local) ranks: which rank owns a global id, where its row sits in the
// owner's window, and how the requests of one lookup are grouped per owner. One source of truth for the two
// inter-node paths of a hierarchical Engram table:
//   collective (default): ids are bucketed by owner node; bucket b keeps the flat order of the lookup and
//     holds the node-local id g - b*node_entries (= local*num_entries + row) or -1 (jax_engram/_scaleout.py).
//   GIN (kernels/cuda/engram_gin.cu): the requester reads each row from the owner's window itself. Requests
//     are grouped per owner rank in rank order (node-major, so node b's ranks form one contiguous range: the
//     same order as the collective buckets) and, within a rank, in flat order: request k of peer p is slot
//     peer_offset[p] + k of the lookup. Staging is a fixed area of the requester split into one slice of
//     `staging_rows` rows per peer: request k goes to row k % staging_rows of peer p's slice in round
//     k / staging_rows (one completion per peer and round), so any lookup fits any staging size.
// Global rank = node * ranks_per_node + local (the order P(("node", "gpu")) lays out). Ids are resolved first
// (engram_layout.h resolve_id: padding, out of range, clip), so every path agrees on which ids read a row.
#pragma once
#include <vector>

#include "jax_engram/engram_layout.h"
#include "jax_engram/hd.h"

namespace jax_engram::engram {

struct GinGeometry {
  int64_t num_entries = 0;     // rows owned by each rank
  int32_t ranks_per_node = 1;
  int32_t nodes = 1;
  int64_t row_bytes = 0;       // bytes of one row in the owner's window
  int64_t region_offset = 0;   // byte offset of the table in every rank's window (symmetric)
  int64_t local_stride = 0;    // extra bytes per local rank index: 0 for data rows (each rank holds its own rows);
                               // num_entries*row_bytes for a table replicated inside the node (scale factors:
                               // every rank of node b holds rows [b*node_entries, (b+1)*node_entries))

  JE_HD int64_t node_entries() const { return num_entries * ranks_per_node; }
  JE_HD int64_t total() const { return node_entries() * nodes; }
  JE_HD int32_t nranks() const { return ranks_per_node * nodes; }
};

struct GinOwner {
  int32_t node = -1, local = -1, rank = -1;
  int64_t row = -1;            // row in the owner's table
  int64_t node_local_id = -1;  // id within the owner node: the collective path's bucket entry
};

// Owner of a resolved id r (resolve_id's result; r < 0: no row, returns false).
JE_HD bool gin_owner(int64_t r, const GinGeometry& g, GinOwner* o) {
  if (r < 0) return false;
  const int64_t per_node = g.node_entries();
  o->node = static_cast<int32_t>(r / per_node);
  o->node_local_id = r - o->node * per_node;
  o->local = static_cast<int32_t>(o->node_local_id / g.num_entries);
  o->row = o->node_local_id - o->local * g.num_entries;
  o->rank = o->node * g.ranks_per_node + o->local;
  return true;
}

// Byte offset of an owner's row in its window.
JE_HD int64_t gin_remote_offset(const GinGeometry& g, const GinOwner& o) {
  return g.region_offset + o.local * g.local_stride + o.row * g.row_bytes;
}

// Staging row (in the requester's staging area) and round of request k of peer p, for slices of `staging_rows`.
JE_HD int64_t gin_staging_row(int32_t peer, int64_t k, int64_t staging_rows) {
  return peer * staging_rows + k % staging_rows;
}
JE_HD int64_t gin_round(int64_t k, int64_t staging_rows) { return k / staging_rows; }
// Rows per peer slice of a staging area of `staging_bytes` (0: rows of this size do not fit).
JE_HD int64_t gin_staging_rows(int64_t staging_bytes, int32_t nranks, int64_t row_bytes) {
  return row_bytes > 0 && nranks > 0 ? staging_bytes / nranks / row_bytes : 0;
}

// Host-side plan of one lookup of n ids (flat positions i = t*E + e). Every vector indexed by flat position
// holds -1 where the id reads no row.
struct GinPlan {
  std::vector<int32_t> owner_node, owner_local, owner_rank;  // [n]
  std::vector<int64_t> row, node_local_id, remote_offset;    // [n]
  std::vector<int64_t> slot;                                 // [n] slot of the request (peer-grouped order)
  std::vector<int64_t> staging_row, round;                   // [n] where and in which round it is staged
  std::vector<int64_t> peer_count, peer_offset;              // [nranks], [nranks + 1] (exclusive prefix sum)
  std::vector<int64_t> node_count;                           // [nodes]: valid ids per collective bucket
  std::vector<int64_t> order;                                // [requests]: flat position of slot k
};

inline GinPlan gin_plan(const int32_t* ids, int64_t n, int32_t mode, const GinGeometry& g, int64_t staging_rows) {
  GinPlan p;
  const int32_t R = g.nranks();
  p.owner_node.assign(n, -1);
  p.owner_local.assign(n, -1);
  p.owner_rank.assign(n, -1);
  p.row.assign(n, -1);
  p.node_local_id.assign(n, -1);
  p.remote_offset.assign(n, -1);
  p.slot.assign(n, -1);
  p.staging_row.assign(n, -1);
  p.round.assign(n, -1);
  p.peer_count.assign(R, 0);
  p.peer_offset.assign(R + 1, 0);
  p.node_count.assign(g.nodes, 0);
  const int64_t total = g.total();
  for (int64_t i = 0; i < n; ++i) {
    bool oor = false;
    GinOwner o;
    if (!gin_owner(resolve_id(ids[i], total, mode, &oor), g, &o)) continue;
    p.owner_node[i] = o.node;
    p.owner_local[i] = o.local;
    p.owner_rank[i] = o.rank;
    p.row[i] = o.row;
    p.node_local_id[i] = o.node_local_id;
    p.remote_offset[i] = gin_remote_offset(g, o);
    ++p.peer_count[o.rank];
    ++p.node_count[o.node];
  }
  for (int32_t r = 0; r < R; ++r) p.peer_offset[r + 1] = p.peer_offset[r] + p.peer_count[r];
  std::vector<int64_t> next(p.peer_offset.begin(), p.peer_offset.end() - 1);
  p.order.assign(p.peer_offset[R], -1);
  for (int64_t i = 0; i < n; ++i) {
    if (p.owner_rank[i] < 0) continue;
    const int32_t r = p.owner_rank[i];
    p.slot[i] = next[r]++;
    p.order[p.slot[i]] = i;
    const int64_t k = p.slot[i] - p.peer_offset[r];
    p.staging_row[i] = gin_staging_row(r, k, staging_rows);
    p.round[i] = gin_round(k, staging_rows);
  }
  return p;
}

}  // namespace jax_engram::engram
