// CUDA driver API entry points resolved at run time through the runtime (cudaGetDriverEntryPointByVersion),
// so the module never links libcuda: it imports on machines without a driver, and uses the driver that the
// CUDA runtime (and JAX) already loaded.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

namespace jax_engram {

struct CudaDriver {
  PFN_cuGetErrorString_v6000 cuGetErrorString = nullptr;
  PFN_cuGetErrorName_v6000 cuGetErrorName = nullptr;
  PFN_cuDeviceGet_v2000 cuDeviceGet = nullptr;
  PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute = nullptr;
  PFN_cuCtxGetCurrent_v4000 cuCtxGetCurrent = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity = nullptr;
  PFN_cuMemAddressReserve_v10020 cuMemAddressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 cuMemAddressFree = nullptr;
  PFN_cuMemCreate_v10020 cuMemCreate = nullptr;
  PFN_cuMemRelease_v10020 cuMemRelease = nullptr;
  PFN_cuMemMap_v10020 cuMemMap = nullptr;
  PFN_cuMemUnmap_v10020 cuMemUnmap = nullptr;
  PFN_cuMemSetAccess_v10020 cuMemSetAccess = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 cuMemExportToShareableHandle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 cuMemImportFromShareableHandle = nullptr;
  // Optional (nullptr when the driver lacks it; its users fall back): the EP copy-engine dispatch's flags.
  PFN_cuStreamWriteValue64_v11070 cuStreamWriteValue64 = nullptr;
  // Optional: the Engram host path's per-chunk gate (a copy waits in stream order for a flag the CPU sets) and its
  // start flag (the stream tells the CPU that the ids are in pinned memory).
  PFN_cuStreamWaitValue32_v11070 cuStreamWaitValue32 = nullptr;
  PFN_cuStreamWriteValue32_v11070 cuStreamWriteValue32 = nullptr;
};

// The table, resolved once (thread-safe). nullptr and *err set if the CUDA runtime or driver is unusable
// (no driver installed, driver too old for an entry point, ...).
const CudaDriver* cuda_driver(std::string* err);

// "CUDA_ERROR_X (description)" for a driver result; works before/without a resolved table.
std::string cu_error_string(CUresult r);

// Device attribute, or `fallback` when the query fails (old driver, unknown attribute).
int cu_device_attribute(int device, CUdevice_attribute attr, int fallback);

}  // namespace jax_engram
