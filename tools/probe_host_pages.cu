// How the backing of a large host table changes a CPU gather of random 256-B rows, the host path's first step.
// Every table named on the command line is allocated and filled first, then the gathers run in interleaved rounds
// (each round measures every table once), so a drift of the machine over time falls on all of them alike:
//   cumem    cuMemCreate on the host NUMA node, mapped for the GPU and the CPU, as the library's host segments
//   thp      anonymous memory advised MADV_HUGEPAGE (transparent huge pages)
//   4k       anonymous memory advised MADV_NOHUGEPAGE
//   thp_reg  thp, then cudaHostRegister (pinned, GPU-mapped)
//   4k_reg   4k, then cudaHostRegister
//   hugetlb2m, hugetlb1g  MAP_HUGETLB with 2 MiB / 1 GiB pages (reserved by root: /proc/sys/vm/nr_hugepages, ...)
// Each table's smaps line says how the kernel maps it (KernelPageSize, AnonHugePages). Each gather moves 24 MiB or
// 3 MiB of rows (the model step's fetch at T = 4096 / T = 512) into one buffer with the library's loop (rows
// prefetched 32 ahead, 16-byte non-temporal stores), with 8 and THREADS spinning threads, over fresh ids (more than
// 1 GiB of rows per cycle, beyond any last-level cache); each line gives best / median / worst GB/s of the round.
//
//   nvcc -O2 -std=c++17 -o probe_host_pages tools/probe_host_pages.cu -lcuda     (-DNO_CUMEM: no driver, no cumem)
//   ./probe_host_pages GIB THREADS ROUNDS MODE...        e.g. ./probe_host_pages 24 12 5 cumem thp 4k thp_reg
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <emmintrin.h>
#include <atomic>
#include <cerrno>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#ifndef MAP_HUGE_SHIFT
#define MAP_HUGE_SHIFT 26
#endif

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

static void smaps(void* p, size_t bytes) {
  std::ifstream f("/proc/self/smaps");
  std::string line;
  uintptr_t a = (uintptr_t)p;
  bool in = false;
  long rss = 0, anonhuge = 0, kps = 0, mmups = 0, n = 0;
  std::string name;
  while (std::getline(f, line)) {
    unsigned long lo, hi;
    if (sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2 && line.find(' ') != std::string::npos && line[line.find('-')+1] != ' ') {
      in = lo < a + bytes && hi > a;
      if (in) { ++n; if (name.empty()) name = line.size() > 73 ? line.substr(73) : line; }
      continue;
    }
    if (!in) continue;
    long v;
    if (sscanf(line.c_str(), "Rss: %ld", &v) == 1) rss += v;
    if (sscanf(line.c_str(), "AnonHugePages: %ld", &v) == 1) anonhuge += v;
    if (sscanf(line.c_str(), "KernelPageSize: %ld", &v) == 1) kps = v;
    if (sscanf(line.c_str(), "MMUPageSize: %ld", &v) == 1) mmups = v;
  }
  printf("  smaps: %ld vmas, name '%s', Rss %ld MiB, AnonHugePages %ld MiB, KernelPageSize %ld kB, MMUPageSize %ld kB\n",
         n, name.c_str(), rss >> 10, anonhuge >> 10, kps, mmups);
}

struct Pool {
  int T;
  std::vector<std::thread> th;
  std::atomic<long> gen{0}, done{0};
  std::atomic<bool> quit{false};
  const uint8_t* tab = nullptr;
  const int32_t* ids = nullptr;
  long n = 0;
  uint8_t* out = nullptr;
  explicit Pool(int t) : T(t) {
    for (int i = 0; i < T; ++i) th.emplace_back([this, i] { run(i); });
  }
  void run(int me) {
    long seen = 0;
    while (true) {
      while (gen.load(std::memory_order_acquire) == seen && !quit.load()) _mm_pause();
      if (quit.load()) return;
      seen = gen.load();
      long b = n * me / T, e = n * (me + 1) / T;
      constexpr int D = 32;
      for (long i = b; i < std::min(e, b + D); ++i)
        for (int l = 0; l < 4; ++l) __builtin_prefetch(tab + (long)ids[i] * 256 + l * 64, 0, 0);
      for (long i = b; i < e; ++i) {
        if (i + D < e)
          for (int l = 0; l < 4; ++l) __builtin_prefetch(tab + (long)ids[i + D] * 256 + l * 64, 0, 0);
        const __m128i* s = (const __m128i*)(tab + (long)ids[i] * 256);
        __m128i* d = (__m128i*)(out + i * 256);
        for (int k = 0; k < 16; k += 4) {
          __m128i x0 = _mm_loadu_si128(s + k), x1 = _mm_loadu_si128(s + k + 1), x2 = _mm_loadu_si128(s + k + 2),
                  x3 = _mm_loadu_si128(s + k + 3);
          _mm_stream_si128(d + k, x0); _mm_stream_si128(d + k + 1, x1);
          _mm_stream_si128(d + k + 2, x2); _mm_stream_si128(d + k + 3, x3);
        }
      }
      _mm_sfence();
      done.fetch_add(1);
    }
  }
  double gather(const uint8_t* t, const int32_t* i, long rows, uint8_t* o) {
    tab = t; ids = i; n = rows; out = o;
    done = 0;
    double t0 = now();
    gen.fetch_add(1, std::memory_order_release);
    while (done.load() < T) _mm_pause();
    return now() - t0;
  }
  ~Pool() { quit = true; for (auto& t : th) t.join(); }
};

static void fill(uint8_t* p, size_t bytes) {
  std::vector<std::thread> th;
  int T = 16;
  for (int i = 0; i < T; ++i)
    th.emplace_back([=] { size_t b = bytes * i / T, e = bytes * (i + 1) / T; memset(p + b, i + 1, e - b); });
  for (auto& t : th) t.join();
}

static void measure(const char* mode, uint8_t* tab, size_t bytes, int threads) {
  smaps(tab, bytes);
  const long rows = (long)(bytes / 256);
  uint8_t* out = (uint8_t*)aligned_alloc(2 << 20, 24l << 20);
  memset(out, 0, 24l << 20);
  for (long mib : {24l, 3l}) {
    const long n = (mib << 20) / 256;
    const long sets = (1l << 30) / (mib << 20) + 1;  // > 1 GiB of fresh rows per cycle
    std::vector<int32_t> ids(n * sets);
    uint64_t x = 0x9e3779b97f4a7c15ull + mib;
    for (auto& id : ids) { x ^= x << 13; x ^= x >> 7; x ^= x << 17; id = (int32_t)(x % (uint64_t)std::min<long>(rows, INT32_MAX)); }
    for (int T : {8, threads}) {
      Pool pool(T);
      std::vector<double> r;
      const int reps = mib == 3 ? 200 : 40;
      for (int rep = 0; rep < reps; ++rep) r.push_back(n * 256 / pool.gather(tab, ids.data() + (rep % sets) * n, n, out) / 1e9);
      std::sort(r.begin(), r.end());
      printf("RESULT mode=%s table_gib=%.1f gather_mib=%ld threads=%d GB/s best %.1f median %.1f worst %.1f\n", mode,
             bytes / double(1 << 30), mib, T, r.back(), r[r.size() / 2], r.front());
      fflush(stdout);
    }
  }
  long bad = 0;
  for (long i = 0; i < 1000; ++i) bad += out[i * 256] == 0;
  printf("  check zero rows of 1000: %ld\n", bad);
  free(out);
}

struct Table { std::string mode; uint8_t* p; };

int main(int argc, char** argv) {
  double gib = argc > 1 ? atof(argv[1]) : 24;
  int threads = argc > 2 ? atoi(argv[2]) : 12;
  int rounds = argc > 3 ? atoi(argv[3]) : 3;
  size_t bytes = (size_t)(gib * (1ull << 30));
  bytes = (bytes + (1 << 30) - 1) / (1 << 30) * (1 << 30);
  std::vector<Table> tabs;
  for (int a = 4; a < argc; ++a) {
    std::string m = argv[a];
    double t0 = now();
#ifndef NO_CUMEM
    if (m == "cumem") {
      cuInit(0);
      CUdevice dev; cuDeviceGet(&dev, 0);
      CUcontext ctx; cuDevicePrimaryCtxRetain(&ctx, dev); cuCtxSetCurrent(ctx);
      CUmemAllocationProp prop{};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
      prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
      prop.location.id = 0;
      CUmemGenericAllocationHandle h;
      CUresult r = cuMemCreate(&h, bytes, &prop, 0);
      if (r != CUDA_SUCCESS) { printf("cumem: cuMemCreate failed %d\n", r); continue; }
      CUdeviceptr va;
      cuMemAddressReserve(&va, bytes, 2 << 20, 0, 0);
      cuMemMap(va, bytes, 0, h, 0);
      CUmemAccessDesc acc[2] = {};
      acc[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE; acc[0].location.id = 0; acc[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      acc[1].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA; acc[1].location.id = 0; acc[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      r = cuMemSetAccess(va, bytes, acc, 2);
      fill((uint8_t*)va, bytes);
      printf("mode cumem: setaccess rc %d, alloc+fill %.1f s\n", r, now() - t0);
      tabs.push_back({m, (uint8_t*)va});
      continue;
    }
#endif
    if (m == "thp" || m == "4k" || m == "thp_reg" || m == "4k_reg") {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      madvise(p, bytes, m.rfind("4k", 0) == 0 ? MADV_NOHUGEPAGE : MADV_HUGEPAGE);
      fill((uint8_t*)p, bytes);
      if (m.size() > 4 && m.substr(m.size() - 4) == "_reg") {
        cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
        printf("  %s cudaHostRegister rc %d\n", m.c_str(), (int)e);
      }
      printf("mode %s: alloc+fill %.1f s (addr %% 2MiB = %lu)\n", m.c_str(), now() - t0, (unsigned long)((uintptr_t)p % (2 << 20)));
      tabs.push_back({m, (uint8_t*)p});
    } else if (m == "hugetlb2m" || m == "hugetlb1g") {
      const int shift = m == "hugetlb2m" ? 21 : 30;
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | (shift << MAP_HUGE_SHIFT), -1, 0);
      if (p == MAP_FAILED) { printf("mode %s: mmap failed (%s)\n", m.c_str(), strerror(errno)); continue; }
      fill((uint8_t*)p, bytes);
      printf("mode %s: alloc+fill %.1f s\n", m.c_str(), now() - t0);
      tabs.push_back({m, (uint8_t*)p});
    } else {
      printf("unknown mode %s\n", m.c_str());
    }
  }
  for (int r = 0; r < rounds; ++r)
    for (auto& t : tabs) { printf("round %d\n", r); measure(t.mode.c_str(), t.p, bytes, threads); }
  return 0;
}
