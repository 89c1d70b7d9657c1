#include "runtime/runtime.h"
#include "runtime/host_gather.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <cstdio>

#include "jax_engram/ep_layout.h"

namespace jax_engram {

Status Registry::create_member(int64_t ctx, int32_t ordinal, int32_t group, int32_t rank, int32_t nranks, double timeout_s,
                               const std::string& label) {
  if (nranks < 1 || nranks > kMaxRanks) return "nranks must be in [1, " + std::to_string(kMaxRanks) + "]";
  if (rank < 0 || rank >= nranks) return "rank out of range";
  std::unique_lock lock(mu_);
  auto key = std::make_pair(ctx, ordinal);
  if (members_.count(key)) return "device ordinal " + std::to_string(ordinal) + " already has a member of context " +
                                  std::to_string(ctx);
  auto m = std::make_unique<Member>();
  m->ctx_id = ctx;
  m->ordinal = ordinal;
  m->group = group;
  m->rank = rank;
  m->nranks = nranks;
  m->timeout_s = timeout_s;
  m->label = label;
  Status s = backend_->init_member(*m);
  if (!s.empty()) return s;
  members_[key] = std::move(m);
  return {};
}

Status Registry::drain(const std::vector<Member*>& same, const Member* report, bool stop_gathers) {
  for (Member* x : same)  // bounded: a handler waits for its peers at most the context's timeout
    for (int i = 0; x->inflight.load() > 0 && i < 20 * 60 * 1000; ++i) usleep(50);
  Status q;
  for (Member* x : same) {
    Status s = backend_->quiesce(*x);
    if (x == report) q = s;
    if (stop_gathers) stop_host_gather(*x);  // after the quiesce: a stream waiting on a gather's flags was released
  }
  return q;
}

Status Registry::destroy_member(int64_t ctx, int32_t ordinal) {
  std::unique_ptr<Member> m;
  // Every member of the context in this process stops first, not only this one: their handlers, kernels and host
  // gather workers read the peers' allocations, this member's among them, which are freed below.
  std::vector<Member*> same;
  Member* raw = nullptr;
  {
    std::unique_lock lock(mu_);
    auto it = members_.find({ctx, ordinal});
    if (it == members_.end()) return {};
    raw = it->second.get();
    for (auto& [key, mm] : members_)
      if (key.first == ctx) {
        mm->closing = true;  // no new handler acquires it
        same.push_back(mm.get());
      }
  }
  Status q = drain(same, raw, true);
  {
    std::unique_lock lock(mu_);
    auto it = members_.find({ctx, ordinal});
    m = std::move(it->second);
    members_.erase(it);
  }
  for (auto* table : {&m->allocs, &m->retired}) {
    for (auto& [id, a] : *table) {
      backend_->close_exports(*m, *a);
      backend_->free_alloc(*m, *a);
    }
    table->clear();
  }
  backend_->destroy_member(*m);
  return q;
}

Status Registry::create_alloc(int64_t ctx, int32_t ordinal, int64_t alloc_id, const std::vector<SegmentSpec>& segs,
                              Export* out) {
  Member* m = find(ctx, ordinal);
  if (!m) return "no member for context " + std::to_string(ctx) + " on device " + std::to_string(ordinal);
  auto a = std::make_unique<Allocation>();
  a->id = alloc_id;
  a->segments = segs;
  for (auto& s : segs) {
    if (s.bytes % kSegmentAlignment) return "segment size must be a multiple of 2 MiB";
    a->total_bytes += s.bytes;
  }
  if (a->total_bytes == 0) return "allocation of 0 bytes";
  Status st = backend_->create_alloc(*m, *a);
  if (!st.empty()) return st;
  *out = a->exported;
  std::unique_lock lock(mu_);
  std::lock_guard<std::mutex> lk(m->allocs_mu);
  if (m->allocs.count(alloc_id)) return "allocation id already used";
  m->allocs[alloc_id] = std::move(a);
  return {};
}

Status Registry::connect_alloc(int64_t ctx, int32_t ordinal, int64_t alloc_id, const std::vector<Export>& peers) {
  Member* m = find(ctx, ordinal);
  if (!m) return "no member for context " + std::to_string(ctx);
  Allocation* a = m->alloc(alloc_id);
  if (!a) return "no allocation " + std::to_string(alloc_id);
  if (static_cast<int>(peers.size()) != m->nranks) return "connect needs one export per rank";
  return backend_->connect_alloc(*this, *m, *a, peers);
}

Status Registry::close_exports(int64_t ctx, int32_t ordinal, int64_t alloc_id) {
  Member* m = find(ctx, ordinal);
  if (!m) return {};
  Allocation* a = m->alloc(alloc_id);
  if (a) backend_->close_exports(*m, *a);
  return {};
}

Status Registry::free_alloc(int64_t ctx, int32_t ordinal, int64_t alloc_id) {
  Member* m = find(ctx, ordinal);
  if (!m) return {};
  // The first free of an allocation id takes it out of every local member of the context (their handlers read
  // each other's allocations, and a handler queued later then fails naming it), waits for the handlers still
  // executing and for the work they queued, and only then frees; the members' later calls free their own parts.
  std::vector<Member*> same;
  bool first = false;
  {
    std::unique_lock lock(mu_);
    for (auto& [key, mm] : members_) {
      if (key.first != ctx) continue;
      same.push_back(mm.get());
      std::lock_guard<std::mutex> lk(mm->allocs_mu);
      auto it = mm->allocs.find(alloc_id);
      if (it != mm->allocs.end()) {
        mm->retired[alloc_id] = std::move(it->second);
        mm->allocs.erase(it);
        first = true;
      }
    }
  }
  const Status q = first ? drain(same, m, false) : Status{};
  std::unique_ptr<Allocation> a;
  {
    std::unique_lock lock(mu_);
    std::lock_guard<std::mutex> lk(m->allocs_mu);
    auto it = m->retired.find(alloc_id);
    if (it == m->retired.end()) return q;
    a = std::move(it->second);
    m->retired.erase(it);
  }
  backend_->close_exports(*m, *a);
  backend_->free_alloc(*m, *a);
  return q;
}

Member* Registry::find(int64_t ctx, int32_t ordinal) {
  std::shared_lock lock(mu_);
  auto it = members_.find({ctx, ordinal});
  return it == members_.end() ? nullptr : it->second.get();
}

Member* Registry::acquire(int64_t ctx, int32_t ordinal, bool* closing) {
  std::shared_lock lock(mu_);
  *closing = false;
  auto it = members_.find({ctx, ordinal});
  if (it == members_.end()) return nullptr;
  if (it->second->closing.load()) {
    *closing = true;
    return nullptr;
  }
  it->second->inflight.fetch_add(1);
  return it->second.get();
}

Member* Registry::find_rank(int64_t ctx, int32_t group, int32_t rank) {
  std::shared_lock lock(mu_);
  for (auto& [k, m] : members_)
    if (k.first == ctx && m->group == group && m->rank == rank) return m.get();
  return nullptr;
}

std::vector<Member*> Registry::members() {
  std::shared_lock lock(mu_);
  std::vector<Member*> out;
  for (auto& [k, m] : members_) out.push_back(m.get());
  return out;
}

std::string describe_routing_refusal(const Member& m, int32_t rank, int32_t peer, int64_t token, int32_t kind,
                                     int64_t id, int64_t num_experts) {
  using std::to_string;
  const std::string who = peer == rank ? "this rank (" + to_string(rank) + ")" : "rank " + to_string(peer);
  std::string s = "jax_engram ep dispatch on rank " + to_string(rank) + " of " + m.label +
                  " (validate_routing=True): topk_idx of " + who + ", token " + to_string(token) + ", ";
  if (kind == kEpBadDuplicateExpert)
    s += "lists expert " + to_string(id) + " more than once (duplicate expert ids within a token are illegal)";
  else
    s += "holds expert id " + to_string(id) + " outside [-1, num_experts=" + to_string(num_experts) + ")";
  return s + ". Nothing was sent and the context is still usable: fix the routing (mask invalid or repeated experts "
             "with -1) and call again";
}

// Plain string building: std::ostream number formatting crashed inside our module on the GPU image (locale
// facets of another libstdc++ in the process), so no iostreams in any error path.
std::string describe_error(const Member& m, const ErrorRecord& e, int64_t num_experts) {
  if (e.code <= kErrNone) return {};
  using std::to_string;
  std::string s = std::string("jax_engram ") + op_name(e.op) + " on rank " + to_string(e.rank) + " of " + m.label + ": ";
  const bool ep = e.op == kOpEpDispatch || e.op == kOpEpCombine;
  switch (e.code) {
    case kErrTimeout: {
      char secs[32];
      snprintf(secs, sizeof(secs), "%.3g", e.elapsed_ns / 1e9);
      if (e.op == kOpEngramFetch) {  // the "tma" gather: observed = chunk, detail = CTA * 1000 + warp
        s += std::string("timed out after ") + secs + " s waiting for the bulk copies of chunk " +
             to_string(e.observed) + " (" + to_string(e.expected) + " bytes; CTA " + to_string(e.detail / 1000) +
             ", warp " + to_string(e.detail % 1000) + ") to land: the table's memory did not answer. "
             "EngramConfig(fetch_gather=\"sm\", lookup_gather=\"sm\") runs the vector gather instead";
        break;
      }
      s += std::string("timed out after ") + secs + " s waiting for peer rank " + to_string(e.peer) + " (expected " +
           to_string(e.expected) + ", saw " + to_string(e.observed) +
           "). The peer did not arrive: it crashed, hung, or ran a different sequence of jax_engram ops. Raise "
           "timeout_s in jax_engram.init() if it is only slow";
      break;
    }
    case kErrBadInput:
      if (ep) {  // detail = token * 64 + EpBadKind, observed = the offending value, peer = the rank that has it
        const int64_t where = e.detail / 64, kind = e.detail % 64;
        const std::string who = e.peer == e.rank ? "this rank (" + to_string(e.rank) + ")" : "rank " + to_string(e.peer);
        const std::string range = num_experts > 0 ? "num_experts=" + to_string(num_experts) : std::string("num_experts");
        if (kind == kEpBadDuplicateExpert)
          s += "topk_idx of " + who + ", token " + to_string(where) + ", lists expert " + to_string(e.observed) +
               " more than once (duplicate expert ids within a token are illegal)";
        else if (kind == kEpBadExpertRange)
          s += "topk_idx of " + who + ", token " + to_string(where) + ", holds expert id " + to_string(e.observed) +
               " outside [-1, " + range + ")";
        else
          s += "the handle's arrays are inconsistent on " + who + " (entry " + to_string(where) + ", value " +
               to_string(e.observed) + "): pass the handle returned by the dispatch this call reverses or replays";
        if (kind == kEpBadDuplicateExpert || kind == kEpBadExpertRange)
          s += " (dispatch(..., validate_routing=True) raises this before anything is sent and keeps the context "
               "usable)";
        break;
      }
      s += "invalid input on the device (detail " + to_string(e.detail) + ", expected " + to_string(e.expected) +
           ", saw " + to_string(e.observed) + ")";
      break;
    case kErrIdOutOfRange:
      s += "index out of range in mode='checked': id " + to_string(e.observed) + " at flat position " +
           to_string(e.detail) + " is not in [0, " + to_string(e.expected) + ")";
      break;
    case kErrHostGather:
      s += "a worker of the host gather pool failed while gathering the rows of a host-table fetch (" +
           to_string(e.detail) + " work items), so that fetch's rows are invalid";
      break;
    case kErrSequence:
      s += "the handler counted " + to_string(e.expected) + " dispatch calls on this context but the device " +
           to_string(e.observed) + " (copy-engine dispatch: the copies chose the staging half by the host's count). "
           "An op was launched without its handler running (e.g. replayed from a CUDA graph) or failed to launch";
      break;
    default:
      s += "error code " + to_string(e.code);
  }
  return s + ". The context is unusable; close it and init a new one.";
}

void record_error(ErrorRecord* rec, int32_t code, int32_t op, int32_t rank, int32_t peer, int64_t expected,
                  int64_t observed, int64_t elapsed_ns, int64_t detail) {
  if (!rec) return;
  int32_t zero = 0;
  auto* c = reinterpret_cast<std::atomic<int32_t>*>(&rec->code);
  // Claim with a placeholder so concurrent writers cannot interleave fields; publish the code last.
  if (!c->compare_exchange_strong(zero, -1)) return;
  rec->op = op;
  rec->rank = rank;
  rec->peer = peer;
  rec->expected = expected;
  rec->observed = observed;
  rec->elapsed_ns = elapsed_ns;
  rec->detail = detail;
  c->store(code, std::memory_order_release);
}

std::string host_id() {
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  char name[256] = {0};
  gethostname(name, sizeof(name) - 1);
  return boot + "/" + name;
}

}  // namespace jax_engram
