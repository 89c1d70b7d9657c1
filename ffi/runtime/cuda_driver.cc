#include "runtime/cuda_driver.h"

#include <cuda_runtime_api.h>

#include <mutex>

namespace jax_engram {
namespace {

// ABI version of the entry points we ask for: every symbol above has had the same signature since 12.0,
// and asking for 12.0 keeps working with drivers newer than the toolkit we build with.
constexpr unsigned int kDriverAbi = 12000;

template <typename T>
bool resolve(const char* name, T* out, std::string* err) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, kDriverAbi, cudaEnableDefault, &q);
#else
  cudaError_t e = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &q);
#endif
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn) {
    *err = std::string("cannot resolve CUDA driver entry point ") + name + ": " +
           (e != cudaSuccess ? std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")"
                             : q == cudaDriverEntryPointVersionNotSufficent ? std::string("driver too old")
                                                                             : std::string("symbol not found")) +
           ". Is an NVIDIA driver installed and a GPU visible (CUDA_VISIBLE_DEVICES)?";
    cudaGetLastError();  // do not leave a sticky-looking error for the next runtime call of this thread
    return false;
  }
  *out = reinterpret_cast<T>(fn);
  return true;
}

struct Loaded {
  CudaDriver table;
  std::string error;
  bool ok = false;
};

Loaded& loaded() {
  static Loaded* l = [] {
    auto* x = new Loaded();  // leaked on purpose: used until process exit
    std::string err;
    CudaDriver& t = x->table;
    x->ok = resolve("cuGetErrorString", &t.cuGetErrorString, &err) &&
            resolve("cuGetErrorName", &t.cuGetErrorName, &err) &&
            resolve("cuDeviceGet", &t.cuDeviceGet, &err) &&
            resolve("cuDeviceGetAttribute", &t.cuDeviceGetAttribute, &err) &&
            resolve("cuCtxGetCurrent", &t.cuCtxGetCurrent, &err) &&
            resolve("cuMemGetAllocationGranularity", &t.cuMemGetAllocationGranularity, &err) &&
            resolve("cuMemAddressReserve", &t.cuMemAddressReserve, &err) &&
            resolve("cuMemAddressFree", &t.cuMemAddressFree, &err) &&
            resolve("cuMemCreate", &t.cuMemCreate, &err) && resolve("cuMemRelease", &t.cuMemRelease, &err) &&
            resolve("cuMemMap", &t.cuMemMap, &err) && resolve("cuMemUnmap", &t.cuMemUnmap, &err) &&
            resolve("cuMemSetAccess", &t.cuMemSetAccess, &err) &&
            resolve("cuMemExportToShareableHandle", &t.cuMemExportToShareableHandle, &err) &&
            resolve("cuMemImportFromShareableHandle", &t.cuMemImportFromShareableHandle, &err);
    x->error = err;
    std::string optional_err;
    if (!resolve("cuStreamWriteValue64", &t.cuStreamWriteValue64, &optional_err)) t.cuStreamWriteValue64 = nullptr;
    if (!resolve("cuStreamWaitValue32", &t.cuStreamWaitValue32, &optional_err)) t.cuStreamWaitValue32 = nullptr;
    if (!resolve("cuStreamWriteValue32", &t.cuStreamWriteValue32, &optional_err)) t.cuStreamWriteValue32 = nullptr;
    return x;
  }();
  return *l;
}

}  // namespace

const CudaDriver* cuda_driver(std::string* err) {
  Loaded& l = loaded();
  if (!l.ok) {
    if (err) *err = l.error;
    return nullptr;
  }
  return &l.table;
}

std::string cu_error_string(CUresult r) {
  const CudaDriver* d = cuda_driver(nullptr);
  const char* name = nullptr;
  const char* desc = nullptr;
  if (d) {
    d->cuGetErrorName(r, &name);
    d->cuGetErrorString(r, &desc);
  }
  std::string s = name ? name : "CUresult " + std::to_string(static_cast<int>(r));
  if (desc) s += std::string(" (") + desc + ")";
  return s;
}

int cu_device_attribute(int device, CUdevice_attribute attr, int fallback) {
  const CudaDriver* d = cuda_driver(nullptr);
  if (!d) return fallback;
  CUdevice dev;
  if (d->cuDeviceGet(&dev, device) != CUDA_SUCCESS) return fallback;
  int v = 0;
  if (d->cuDeviceGetAttribute(&v, attr, dev) != CUDA_SUCCESS) return fallback;
  return v;
}

}  // namespace jax_engram
