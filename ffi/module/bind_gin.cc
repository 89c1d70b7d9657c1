// nanobind surface of the Engram request plan (engram_gin_plan.h), in both native modules: tests hold the
// collective path's bucketing (jax_engram/_scaleout.py) and a numpy model to it.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>

#include "jax_engram/engram_gin_plan.h"
#include "module/bind_runtime.h"

namespace nb = nanobind;

namespace jax_engram {

void bind_gin(nb::module_& m) {
  m.def(
      "engram_gin_plan",
      [](const std::vector<int32_t>& ids, int32_t mode, int64_t num_entries, int32_t ranks_per_node, int32_t nodes,
         int64_t row_bytes, int64_t region_offset, int64_t local_stride, int64_t staging_rows) {
        if (num_entries < 1 || ranks_per_node < 1 || nodes < 1 || row_bytes < 0 || region_offset < 0 ||
            local_stride < 0 || staging_rows < 1)
          throw std::invalid_argument("engram_gin_plan: num_entries, ranks_per_node, nodes and staging_rows must be "
                                      ">= 1, row_bytes, region_offset and local_stride >= 0");
        if (mode < engram::kModeFill || mode > engram::kModeChecked)
          throw std::invalid_argument("engram_gin_plan: mode must be 0 (fill), 1 (clip) or 2 (checked), got " +
                                      std::to_string(mode));
        engram::GinGeometry g{num_entries, ranks_per_node, nodes, row_bytes, region_offset, local_stride};
        const engram::GinPlan p = engram::gin_plan(ids.data(), static_cast<int64_t>(ids.size()), mode, g, staging_rows);
        nb::dict d;
        d["owner_node"] = p.owner_node;
        d["owner_local"] = p.owner_local;
        d["owner_rank"] = p.owner_rank;
        d["row"] = p.row;
        d["node_local_id"] = p.node_local_id;
        d["remote_offset"] = p.remote_offset;
        d["slot"] = p.slot;
        d["staging_row"] = p.staging_row;
        d["round"] = p.round;
        d["peer_count"] = p.peer_count;
        d["peer_offset"] = p.peer_offset;
        d["node_count"] = p.node_count;
        d["order"] = p.order;
        return d;
      },
      nb::arg("ids"), nb::arg("mode"), nb::arg("num_entries"), nb::arg("ranks_per_node"), nb::arg("nodes"),
      nb::arg("row_bytes"), nb::arg("region_offset") = 0, nb::arg("local_stride") = 0,
      nb::arg("staging_rows") = int64_t{1} << 40,
      "Request plan of one hierarchical Engram lookup (flat ids): owner (node, local, rank, row) per id, the "
      "collective bucket entry (node_local_id), byte offset in the owner's window, per-peer counts/offsets, the "
      "slot per id and the flat position per slot, the staging row and round per id (slices of staging_rows rows "
      "per peer); -1 where an id reads no row.");
  m.def("engram_gin_staging_rows", &engram::gin_staging_rows, nb::arg("staging_bytes"), nb::arg("nranks"),
        nb::arg("row_bytes"), "Rows per peer slice of a GIN staging area (0: a row does not fit).");
}

}  // namespace jax_engram
