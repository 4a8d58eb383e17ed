// llmchat's ROCm runtime for TVM (HIP), and its CUDA twin.
//
// PyPI's apache-tvm compiles ROCm code objects but ships no ROCm runtime.  This library gives
// TVM's runtime what it needs to run such a model library:
//
//   * `device_api.rocm`: memory (hipMalloc), copies, streams and events, synchronisation,
//     device attributes (hipDeviceGetAttribute), the workspace pool;
//   * `ffi.Module.load_from_bytes.hip`: the loader for the module TVM exports for ROCm
//     (format "hsaco": function table + one AMDGPU code object), whose functions launch
//     through hipModuleLaunchKernel with TVM's argument packing;
//   * `llmchat.gpu.*`: the runtime's state as JSON (driver found or why not, devices), and a
//     description of a loaded module (kernels, wave size, target) for tests and `doctor`.
//
// HIP is loaded at run time (dlopen of libamdhip64.so.7, .6, .5): no ROCm header or library is
// needed to build this file, the same build works with any ROCm, and a machine without ROCm
// loads it and is told what is missing.
//
// The CUDA twin: with LLMCHAT_GPU_RUNTIME=twin set when the library is loaded, the same code
// binds to NVIDIA's driver API (libcuda.so.1: cuMemAlloc, cuModuleLoadData, cuLaunchKernel ...)
// and registers `device_api.cuda` and `ffi.Module.load_from_bytes.cuda` (TVM's CUDA module
// format) instead, so a CUDA model library runs through this code on an NVIDIA GPU and can be
// compared with TVM's own CUDA runtime.  Only the `Driver` binding below differs between the
// two; argument packing, the function table, grid/block handling, streams, the workspace pool
// and the error paths are shared.
//
// The contracts were learnt from the apache-tvm wheel (src/runtime/pack_args.h,
// thread_storage_scope.h, metadata.h, tvm_ffi's library_module.cc); this is llmchat's own code.

#include <dlfcn.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/device_api.h>
#include <tvm/runtime/vm/vm.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "../../native/tvm_function_table.h"
#include "workspace_pool.h"

namespace llmchat_gpu {

using tvm::Device;
using tvm::runtime::DeviceAPI;
using tvm::runtime::DeviceAttrKind;
namespace ffi = tvm::ffi;

constexpr int kVersion = 1;

#define LLMCHAT_FAIL(msg)                                              \
  do {                                                                 \
    std::ostringstream os_;                                            \
    os_ << msg;                                                        \
    TVM_FFI_THROW(RuntimeError) << driver_label() << ": " << os_.str(); \
  } while (0)

static const char* driver_label();

// ==========================================================================================
// The binding layer: the only code that differs between HIP and the CUDA twin
// ==========================================================================================
// Attributes the shared code asks for; each binding maps them to its own enum values.
enum Attr {
  kAttrMaxThreadsPerBlock,
  kAttrWarpSize,
  kAttrMaxSharedMemoryPerBlock,
  kAttrComputeMajor,
  kAttrComputeMinor,
  kAttrClockRate,
  kAttrMultiprocessors,
  kAttrBlockDimX,
  kAttrBlockDimY,
  kAttrBlockDimZ,
  kAttrRegistersPerBlock,
  kAttrL2CacheSize,
  kAttrCount
};

struct Driver {
  // what: "HIP" or "CUDA"; the runtime's TVM device type and module kind
  const char* what = "";
  DLDeviceType device_type = kDLROCM;
  const char* module_kind = "";
  std::vector<std::string> candidates;  // dlopen names, in order
  std::string library;                  // the one loaded
  std::string load_error;               // why none could be loaded
  bool htod_sync = false;               // host->device copies must finish before returning
  int attr_ids[kAttrCount] = {};

  // the calls (0 is success for both APIs)
  int (*init)(unsigned) = nullptr;
  int (*device_count)(int*) = nullptr;
  int (*make_current)(int dev) = nullptr;
  int (*mem_alloc)(void** ptr, size_t bytes) = nullptr;
  int (*mem_free)(void* ptr) = nullptr;
  int (*mem_info)(size_t* free_bytes, size_t* total) = nullptr;
  int (*total_mem)(size_t* bytes, int dev) = nullptr;
  int (*copy_htod)(void* dst, const void* src, size_t bytes, void* stream) = nullptr;
  int (*copy_dtoh)(void* dst, const void* src, size_t bytes, void* stream) = nullptr;
  int (*copy_dtod)(void* dst, const void* src, size_t bytes, void* stream) = nullptr;
  int (*stream_create)(void** stream) = nullptr;
  int (*stream_destroy)(void* stream) = nullptr;
  int (*stream_sync)(void* stream) = nullptr;
  int (*event_create)(void** event) = nullptr;
  int (*event_record)(void* event, void* stream) = nullptr;
  int (*stream_wait)(void* stream, void* event) = nullptr;
  int (*event_destroy)(void* event) = nullptr;
  int (*attribute)(int* value, int attr, int dev) = nullptr;
  int (*device_name)(char* name, int len, int dev) = nullptr;
  std::string (*arch_name)(int dev) = nullptr;  // "gfx1100" / "sm_90"
  int (*driver_version)(int* v) = nullptr;
  int (*module_load)(void** module, const void* image) = nullptr;
  int (*module_unload)(void* module) = nullptr;
  int (*module_function)(void** fn, void* module, const char* name) = nullptr;
  // params: one address per argument (into `buffer`); buffer/size: the same arguments packed
  // with their natural alignment.  HIP launches with the buffer, CUDA with the addresses.
  int (*launch)(void* fn, const unsigned grid[3], const unsigned block[3], unsigned shmem, void* stream,
                void** params, void* buffer, size_t size) = nullptr;
  int (*allow_shared)(void* fn, unsigned bytes) = nullptr;  // opt in to > 48 KiB dynamic shared memory
  // a launch in thread-block clusters (TVM's `clusterCtaIdx.*` launch tags; CUDA sm_90 on; null on
  // HIP, which has none), and the opt-in to clusters over the portable 8 blocks
  int (*launch_cluster)(void* fn, const unsigned grid[3], const unsigned block[3], const unsigned cluster[3],
                        unsigned shmem, void* stream, void** params) = nullptr;
  int (*allow_wide_clusters)(void* fn) = nullptr;
  // stream capture into graphs (the CUDA twin serves TVM's `vm.builtin.cuda_graph.*`; null on HIP)
  int (*capture_begin)(void* stream) = nullptr;
  int (*capture_end)(void* stream, void** graph) = nullptr;
  int (*graph_instantiate)(void** exec, void* graph) = nullptr;
  int (*graph_launch)(void* exec, void* stream) = nullptr;
  int (*graph_exec_destroy)(void* exec) = nullptr;
  int (*graph_destroy)(void* graph) = nullptr;
  std::string (*error_text)(int code) = nullptr;
  bool (*is_oom)(int code) = nullptr;
  bool (*is_no_device)(int code) = nullptr;
  bool (*is_bad_image)(int code) = nullptr;
};

static void* g_lib = nullptr;

template <typename F>
static void bind_sym(F& fn, const char* name, std::vector<std::string>* missing) {
  void* sym = g_lib ? dlsym(g_lib, name) : nullptr;
  if (sym == nullptr) missing->push_back(name);
  fn = reinterpret_cast<F>(sym);
}

// ---------------------------------------------------------------------------- HIP ----------
namespace hip {
// prototypes and values from HIP's public API (stable across ROCm 5, 6 and 7)
using hipError_t = int;
enum { kHtoD = 1, kDtoH = 2, kDtoD = 3 };
static hipError_t (*Init)(unsigned);
static hipError_t (*GetDeviceCount)(int*);
static hipError_t (*SetDevice)(int);
static hipError_t (*Malloc)(void**, size_t);
static hipError_t (*Free)(void*);
static hipError_t (*MemGetInfo)(size_t*, size_t*);
static hipError_t (*DeviceTotalMem)(size_t*, int);
static hipError_t (*MemcpyAsync)(void*, const void*, size_t, int, void*);
static hipError_t (*StreamCreate)(void**);
static hipError_t (*StreamDestroy)(void*);
static hipError_t (*StreamSynchronize)(void*);
static hipError_t (*EventCreate)(void**);
static hipError_t (*EventRecord)(void*, void*);
static hipError_t (*StreamWaitEvent)(void*, void*, unsigned);
static hipError_t (*EventDestroy)(void*);
static hipError_t (*DeviceGetAttribute)(int*, int, int);
static hipError_t (*DeviceGetName)(char*, int, int);
static hipError_t (*GetDeviceProperties)(void*, int);  // R0600 on ROCm 6+, the old struct on 5
static size_t g_arch_offset = 0;                         // gcnArchName in that struct
static hipError_t (*DriverGetVersion)(int*);
static hipError_t (*ModuleLoadData)(void**, const void*);
static hipError_t (*ModuleUnload)(void*);
static hipError_t (*ModuleGetFunction)(void**, void*, const char*);
static hipError_t (*ModuleLaunchKernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                        unsigned, void*, void**, void**);
static const char* (*GetErrorString)(hipError_t);

static std::string arch(int dev) {
  if (GetDeviceProperties == nullptr) return "";
  std::vector<char> props(16384, 0);
  if (GetDeviceProperties(props.data(), dev) != 0) return "";
  const char* name = props.data() + g_arch_offset;
  std::string s(name, strnlen(name, 256));
  return s.substr(0, s.find(':'));  // "gfx90a:sramecc+:xnack-" -> "gfx90a"
}

static bool fill(Driver* d) {
  std::vector<std::string> missing;
  bind_sym(Init, "hipInit", &missing);
  bind_sym(GetDeviceCount, "hipGetDeviceCount", &missing);
  bind_sym(SetDevice, "hipSetDevice", &missing);
  bind_sym(Malloc, "hipMalloc", &missing);
  bind_sym(Free, "hipFree", &missing);
  bind_sym(MemGetInfo, "hipMemGetInfo", &missing);
  bind_sym(DeviceTotalMem, "hipDeviceTotalMem", &missing);
  bind_sym(MemcpyAsync, "hipMemcpyAsync", &missing);
  bind_sym(StreamCreate, "hipStreamCreate", &missing);
  bind_sym(StreamDestroy, "hipStreamDestroy", &missing);
  bind_sym(StreamSynchronize, "hipStreamSynchronize", &missing);
  bind_sym(EventCreate, "hipEventCreate", &missing);
  bind_sym(EventRecord, "hipEventRecord", &missing);
  bind_sym(StreamWaitEvent, "hipStreamWaitEvent", &missing);
  bind_sym(EventDestroy, "hipEventDestroy", &missing);
  bind_sym(DeviceGetAttribute, "hipDeviceGetAttribute", &missing);
  bind_sym(DeviceGetName, "hipDeviceGetName", &missing);
  bind_sym(DriverGetVersion, "hipDriverGetVersion", &missing);
  bind_sym(ModuleLoadData, "hipModuleLoadData", &missing);
  bind_sym(ModuleUnload, "hipModuleUnload", &missing);
  bind_sym(ModuleGetFunction, "hipModuleGetFunction", &missing);
  bind_sym(ModuleLaunchKernel, "hipModuleLaunchKernel", &missing);
  bind_sym(GetErrorString, "hipGetErrorString", &missing);
  // hipDeviceProp_t changed layout in ROCm 6 (hipGetDevicePropertiesR0600); only gcnArchName is read
  GetDeviceProperties = reinterpret_cast<hipError_t (*)(void*, int)>(dlsym(g_lib, "hipGetDevicePropertiesR0600"));
  g_arch_offset = 1160;
  if (GetDeviceProperties == nullptr) {
    GetDeviceProperties = reinterpret_cast<hipError_t (*)(void*, int)>(dlsym(g_lib, "hipGetDeviceProperties"));
    g_arch_offset = 396;
  }
  if (!missing.empty()) {
    d->load_error = d->library + " lacks " + missing.front() + " (too old a ROCm?)";
    return false;
  }
  d->init = [](unsigned f) { return Init(f); };
  d->device_count = [](int* n) { return GetDeviceCount(n); };
  d->make_current = [](int dev) { return SetDevice(dev); };
  d->mem_alloc = [](void** p, size_t n) { return Malloc(p, n); };
  d->mem_free = [](void* p) { return Free(p); };
  d->mem_info = [](size_t* f, size_t* t) { return MemGetInfo(f, t); };
  d->total_mem = [](size_t* n, int dev) { return DeviceTotalMem(n, dev); };
  d->copy_htod = [](void* dst, const void* src, size_t n, void* s) { return MemcpyAsync(dst, src, n, kHtoD, s); };
  d->copy_dtoh = [](void* dst, const void* src, size_t n, void* s) { return MemcpyAsync(dst, src, n, kDtoH, s); };
  d->copy_dtod = [](void* dst, const void* src, size_t n, void* s) { return MemcpyAsync(dst, src, n, kDtoD, s); };
  d->stream_create = [](void** s) { return StreamCreate(s); };
  d->stream_destroy = [](void* s) { return StreamDestroy(s); };
  d->stream_sync = [](void* s) { return StreamSynchronize(s); };
  d->event_create = [](void** e) { return EventCreate(e); };
  d->event_record = [](void* e, void* s) { return EventRecord(e, s); };
  d->stream_wait = [](void* s, void* e) { return StreamWaitEvent(s, e, 0); };
  d->event_destroy = [](void* e) { return EventDestroy(e); };
  d->attribute = [](int* v, int a, int dev) { return DeviceGetAttribute(v, a, dev); };
  d->device_name = [](char* n, int len, int dev) { return DeviceGetName(n, len, dev); };
  d->arch_name = arch;
  d->driver_version = [](int* v) { return DriverGetVersion(v); };
  d->module_load = [](void** m, const void* image) { return ModuleLoadData(m, image); };
  d->module_unload = [](void* m) { return ModuleUnload(m); };
  d->module_function = [](void** f, void* m, const char* name) { return ModuleGetFunction(f, m, name); };
  d->launch = [](void* f, const unsigned g[3], const unsigned b[3], unsigned shmem, void* s, void**, void* buf,
                 size_t size) {
    // HIP_LAUNCH_PARAM_BUFFER_POINTER (1), HIP_LAUNCH_PARAM_BUFFER_SIZE (2), HIP_LAUNCH_PARAM_END (3)
    void* extra[] = {reinterpret_cast<void*>(1), buf, reinterpret_cast<void*>(2), &size, reinterpret_cast<void*>(3)};
    return ModuleLaunchKernel(f, g[0], g[1], g[2], b[0], b[1], b[2], shmem, s, nullptr, extra);
  };
  d->allow_shared = [](void*, unsigned) { return 0; };  // AMD GPUs give a workgroup all of its LDS
  d->error_text = [](int code) {
    const char* s = GetErrorString ? GetErrorString(code) : nullptr;
    return std::string(s ? s : "unknown error") + " (hipError " + std::to_string(code) + ")";
  };
  d->is_oom = [](int code) { return code == 2; };                  // hipErrorOutOfMemory
  d->is_no_device = [](int code) { return code == 100; };          // hipErrorNoDevice
  d->is_bad_image = [](int code) { return code == 200 || code == 209 || code == 218 || code == 303; };
  // hipDeviceAttribute_t (the same numbers in ROCm 5.x, 6.x, 7.x)
  int ids[kAttrCount] = {56, 87, 74, 23, 61, 5, 63, 26, 27, 28, 71, 19};
  std::copy(ids, ids + kAttrCount, d->attr_ids);
  return true;
}
}  // namespace hip

// --------------------------------------------------------------------------- CUDA ----------
namespace cuda {
using CUresult = int;
static CUresult (*Init)(unsigned);
static CUresult (*DeviceGetCount)(int*);
static CUresult (*DeviceGet)(int*, int);
static CUresult (*PrimaryCtxRetain)(void**, int);
static CUresult (*CtxSetCurrent)(void*);
static CUresult (*MemAlloc)(uint64_t*, size_t);
static CUresult (*MemFree)(uint64_t);
static CUresult (*MemGetInfo)(size_t*, size_t*);
static CUresult (*DeviceTotalMem)(size_t*, int);
static CUresult (*MemcpyHtoDAsync)(uint64_t, const void*, size_t, void*);
static CUresult (*MemcpyDtoHAsync)(void*, uint64_t, size_t, void*);
static CUresult (*MemcpyDtoDAsync)(uint64_t, uint64_t, size_t, void*);
static CUresult (*StreamCreate)(void**, unsigned);
static CUresult (*StreamDestroy)(void*);
static CUresult (*StreamSynchronize)(void*);
static CUresult (*EventCreate)(void**, unsigned);
static CUresult (*EventRecord)(void*, void*);
static CUresult (*StreamWaitEvent)(void*, void*, unsigned);
static CUresult (*EventDestroy)(void*);
static CUresult (*DeviceGetAttribute)(int*, int, int);
static CUresult (*DeviceGetName)(char*, int, int);
static CUresult (*DriverGetVersion)(int*);
static CUresult (*ModuleLoadData)(void**, const void*);
static CUresult (*ModuleUnload)(void*);
static CUresult (*ModuleGetFunction)(void**, void*, const char*);
static CUresult (*LaunchKernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                void*, void**, void**);
static CUresult (*FuncSetAttribute)(void*, int, int);
// cuLaunchKernelEx's configuration, laid out as cuda.h's CUlaunchConfig / CUlaunchAttribute
struct LaunchAttribute {
  int id;  // CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
  char pad[4];
  union alignas(8) {
    char raw[64];
    struct {
      unsigned x, y, z;
    } cluster;
  } value;
};
struct LaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
  void* stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};
static CUresult (*LaunchKernelEx)(const LaunchConfig*, void*, void**, void**);
static CUresult (*GetErrorString)(CUresult, const char**);
static CUresult (*StreamBeginCapture)(void*, int);
static CUresult (*StreamEndCapture)(void*, void**);
static CUresult (*GraphInstantiate)(void**, void*, unsigned long long);
static CUresult (*GraphLaunch)(void*, void*);
static CUresult (*GraphExecDestroy)(void*);
static CUresult (*GraphDestroy)(void*);
static std::vector<void*> g_contexts;

static int make_current(int dev) {
  if (dev < 0) return 101;  // CUDA_ERROR_INVALID_DEVICE
  if (static_cast<size_t>(dev) >= g_contexts.size()) g_contexts.resize(dev + 1, nullptr);
  if (g_contexts[dev] == nullptr) {
    int handle = 0;
    CUresult r = DeviceGet(&handle, dev);
    if (r != 0) return r;
    r = PrimaryCtxRetain(&g_contexts[dev], handle);
    if (r != 0) return r;
  }
  return CtxSetCurrent(g_contexts[dev]);
}

static std::string arch(int dev) {
  int major = 0, minor = 0;
  if (DeviceGetAttribute(&major, 75, dev) != 0 || DeviceGetAttribute(&minor, 76, dev) != 0) return "";
  return "sm_" + std::to_string(major) + std::to_string(minor);
}

static uint64_t dptr(const void* p) { return reinterpret_cast<uint64_t>(p); }

static bool fill(Driver* d) {
  std::vector<std::string> missing;
  bind_sym(Init, "cuInit", &missing);
  bind_sym(DeviceGetCount, "cuDeviceGetCount", &missing);
  bind_sym(DeviceGet, "cuDeviceGet", &missing);
  bind_sym(PrimaryCtxRetain, "cuDevicePrimaryCtxRetain", &missing);
  bind_sym(CtxSetCurrent, "cuCtxSetCurrent", &missing);
  bind_sym(MemAlloc, "cuMemAlloc_v2", &missing);
  bind_sym(MemFree, "cuMemFree_v2", &missing);
  bind_sym(MemGetInfo, "cuMemGetInfo_v2", &missing);
  bind_sym(DeviceTotalMem, "cuDeviceTotalMem_v2", &missing);
  bind_sym(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", &missing);
  bind_sym(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", &missing);
  bind_sym(MemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2", &missing);
  bind_sym(StreamCreate, "cuStreamCreate", &missing);
  bind_sym(StreamDestroy, "cuStreamDestroy_v2", &missing);
  bind_sym(StreamSynchronize, "cuStreamSynchronize", &missing);
  bind_sym(EventCreate, "cuEventCreate", &missing);
  bind_sym(EventRecord, "cuEventRecord", &missing);
  bind_sym(StreamWaitEvent, "cuStreamWaitEvent", &missing);
  bind_sym(EventDestroy, "cuEventDestroy_v2", &missing);
  bind_sym(DeviceGetAttribute, "cuDeviceGetAttribute", &missing);
  bind_sym(DeviceGetName, "cuDeviceGetName", &missing);
  bind_sym(DriverGetVersion, "cuDriverGetVersion", &missing);
  bind_sym(ModuleLoadData, "cuModuleLoadData", &missing);
  bind_sym(ModuleUnload, "cuModuleUnload", &missing);
  bind_sym(ModuleGetFunction, "cuModuleGetFunction", &missing);
  bind_sym(LaunchKernel, "cuLaunchKernel", &missing);
  bind_sym(FuncSetAttribute, "cuFuncSetAttribute", &missing);
  std::vector<std::string> optional;  // drivers before CUDA 12 have no cuLaunchKernelEx
  bind_sym(LaunchKernelEx, "cuLaunchKernelEx", &optional);
  bind_sym(GetErrorString, "cuGetErrorString", &missing);
  bind_sym(StreamBeginCapture, "cuStreamBeginCapture_v2", &missing);
  bind_sym(StreamEndCapture, "cuStreamEndCapture", &missing);
  bind_sym(GraphInstantiate, "cuGraphInstantiateWithFlags", &missing);
  bind_sym(GraphLaunch, "cuGraphLaunch", &missing);
  bind_sym(GraphExecDestroy, "cuGraphExecDestroy", &missing);
  bind_sym(GraphDestroy, "cuGraphDestroy", &missing);
  if (!missing.empty()) {
    d->load_error = d->library + " lacks " + missing.front();
    return false;
  }
  d->init = [](unsigned f) { return Init(f); };
  d->device_count = [](int* n) { return DeviceGetCount(n); };
  d->make_current = make_current;
  d->mem_alloc = [](void** p, size_t n) {
    uint64_t v = 0;
    CUresult r = MemAlloc(&v, n);
    *p = reinterpret_cast<void*>(v);
    return r;
  };
  d->mem_free = [](void* p) { return MemFree(dptr(p)); };
  d->mem_info = [](size_t* f, size_t* t) { return MemGetInfo(f, t); };
  d->total_mem = [](size_t* n, int dev) { return DeviceTotalMem(n, dev); };
  d->copy_htod = [](void* dst, const void* src, size_t n, void* s) { return MemcpyHtoDAsync(dptr(dst), src, n, s); };
  d->copy_dtoh = [](void* dst, const void* src, size_t n, void* s) { return MemcpyDtoHAsync(dst, dptr(src), n, s); };
  d->copy_dtod = [](void* dst, const void* src, size_t n, void* s) {
    return MemcpyDtoDAsync(dptr(dst), dptr(src), n, s);
  };
  d->stream_create = [](void** s) { return StreamCreate(s, 0); };
  d->stream_destroy = [](void* s) { return StreamDestroy(s); };
  d->stream_sync = [](void* s) { return StreamSynchronize(s); };
  d->event_create = [](void** e) { return EventCreate(e, 2); };  // CU_EVENT_DISABLE_TIMING
  d->event_record = [](void* e, void* s) { return EventRecord(e, s); };
  d->stream_wait = [](void* s, void* e) { return StreamWaitEvent(s, e, 0); };
  d->event_destroy = [](void* e) { return EventDestroy(e); };
  d->attribute = [](int* v, int a, int dev) { return DeviceGetAttribute(v, a, dev); };
  d->device_name = [](char* n, int len, int dev) { return DeviceGetName(n, len, dev); };
  d->arch_name = arch;
  d->driver_version = [](int* v) { return DriverGetVersion(v); };
  d->module_load = [](void** m, const void* image) { return ModuleLoadData(m, image); };
  d->module_unload = [](void* m) { return ModuleUnload(m); };
  d->module_function = [](void** f, void* m, const char* name) { return ModuleGetFunction(f, m, name); };
  d->launch = [](void* f, const unsigned g[3], const unsigned b[3], unsigned shmem, void* s, void** params, void*,
                 size_t) { return LaunchKernel(f, g[0], g[1], g[2], b[0], b[1], b[2], shmem, s, params, nullptr); };
  d->allow_shared = [](void* f, unsigned bytes) {
    return FuncSetAttribute(f, 8, static_cast<int>(bytes));  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
  };
  if (LaunchKernelEx != nullptr) {
    d->launch_cluster = [](void* f, const unsigned g[3], const unsigned b[3], const unsigned c[3], unsigned shmem,
                           void* s, void** params) {
      LaunchAttribute attr = {};
      attr.id = 4;  // CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
      attr.value.cluster.x = c[0];
      attr.value.cluster.y = c[1];
      attr.value.cluster.z = c[2];
      LaunchConfig cfg = {g[0], g[1], g[2], b[0], b[1], b[2], shmem, s, &attr, 1};
      return LaunchKernelEx(&cfg, f, params, nullptr);
    };
    // CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    d->allow_wide_clusters = [](void* f) { return FuncSetAttribute(f, 14, 1); };
  }
  d->capture_begin = [](void* st) { return StreamBeginCapture(st, 0); };  // CU_STREAM_CAPTURE_MODE_GLOBAL
  d->capture_end = [](void* st, void** g) { return StreamEndCapture(st, g); };
  d->graph_instantiate = [](void** e, void* g) { return GraphInstantiate(e, g, 0); };
  d->graph_launch = [](void* e, void* st) { return GraphLaunch(e, st); };
  d->graph_exec_destroy = [](void* e) { return GraphExecDestroy(e); };
  d->graph_destroy = [](void* g) { return GraphDestroy(g); };
  d->error_text = [](int code) {
    const char* s = nullptr;
    if (GetErrorString) GetErrorString(code, &s);
    return std::string(s ? s : "unknown error") + " (CUresult " + std::to_string(code) + ")";
  };
  d->is_oom = [](int code) { return code == 2; };            // CUDA_ERROR_OUT_OF_MEMORY
  d->is_no_device = [](int code) { return code == 100; };    // CUDA_ERROR_NO_DEVICE
  d->is_bad_image = [](int code) { return code == 200 || code == 209 || code == 218 || code == 222; };
  // CUdevice_attribute
  int ids[kAttrCount] = {1, 10, 8, 75, 76, 13, 16, 2, 3, 4, 12, 38};
  std::copy(ids, ids + kAttrCount, d->attr_ids);
  return true;
}
}  // namespace cuda

// ------------------------------------------------------------------ which binding ----------
static bool twin_mode() {
  const char* env = getenv("LLMCHAT_GPU_RUNTIME");
  return env != nullptr && std::string(env) == "twin";
}

static Driver& driver_info() {
  static Driver d = [] {
    Driver d;
    if (twin_mode()) {
      d.what = "CUDA (llmchat's twin runtime)";
      d.device_type = kDLCUDA;
      d.module_kind = "cuda";
      const char* forced = getenv("LLMCHAT_CUDA_DRIVER_LIBRARY");
      if (forced && *forced) d.candidates = {forced};
      else d.candidates = {"libcuda.so.1", "libcuda.so"};
    } else {
      d.what = "ROCm";
      d.device_type = kDLROCM;
      d.module_kind = "hip";
      d.htod_sync = true;  // HIP may return before reading pageable host memory
      const char* forced = getenv("LLMCHAT_HIP_LIBRARY");
      if (forced && *forced) d.candidates = {forced};
      else d.candidates = {"libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so"};
    }
    return d;
  }();
  return d;
}

static const char* driver_label() { return driver_info().what; }

struct State {
  bool tried = false;
  bool ready = false;
  std::string error;  // why the driver cannot be used
  int devices = 0;
  std::string devices_error;
};

static std::recursive_mutex& lock() {
  static std::recursive_mutex mu;
  return mu;
}

static State& state() {
  static State s;
  return s;
}

// dlopen the driver library and bind its calls (once); false with state().error set otherwise
static std::atomic<bool> g_ready{false};  // the driver is open and bound (checked without the lock)

static bool open_driver() {
  if (g_ready.load(std::memory_order_acquire)) return true;
  std::lock_guard<std::recursive_mutex> guard(lock());
  State& s = state();
  if (s.tried) return s.ready;
  s.tried = true;
  Driver& d = driver_info();
  std::string tried, broken;
  for (const std::string& name : d.candidates) {
    g_lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (g_lib != nullptr) {
      d.library = name;
      break;
    }
    const char* err = dlerror();
    std::string why = err ? err : name;
    if (!tried.empty()) tried += "; ";
    tried += why;
    // present but not loadable (a missing dependency such as libhsa-runtime64): say so
    if (why.find(name + ": cannot open shared object file") == std::string::npos) {
      if (!broken.empty()) broken += "; ";
      broken += why;
    }
  }
  if (g_lib == nullptr) {
    std::string names;
    for (const std::string& n : d.candidates) names += (names.empty() ? "" : ", ") + n;
    s.error = std::string(twin_mode() ? "the NVIDIA driver library" : "the HIP runtime") + " was not found (" +
              names + ")" + (broken.empty() ? "" : ": " + broken);
    d.load_error = tried;
    return false;
  }
  bool ok = twin_mode() ? cuda::fill(&d) : hip::fill(&d);
  if (!ok) {
    s.error = d.load_error;
    return false;
  }
  // a driver that loads but finds no GPU (no /dev/kfd access, no supported GPU) still counts as
  // found: the device list says why it is empty
  int r = d.init(0);
  int n = 0;
  if (r == 0) r = d.device_count(&n);
  if (r != 0) {
    s.devices_error = d.error_text(r);
    n = 0;
  }
  s.devices = n;
  s.ready = true;
  g_ready.store(true, std::memory_order_release);
  return true;
}

static Driver& drv() {
  if (!open_driver()) LLMCHAT_FAIL(state().error);
  return driver_info();
}

static void check_call(int code, const char* what) {
  if (code != 0) LLMCHAT_FAIL(what << " failed: " << driver_info().error_text(code));
}

// the device every call of this thread works on (TVM calls SetDevice / __tvm_set_device)
static thread_local int t_device = 0;
static thread_local int t_bound = -1;  // the device made current on this thread

static void use_device(int dev) {
  Driver& d = drv();
  if (dev < 0 || dev >= state().devices) {
    if (state().devices == 0) {
      LLMCHAT_FAIL("no GPU was found" << (state().devices_error.empty() ? "" : " (" + state().devices_error + ")"));
    }
    LLMCHAT_FAIL("there is no device " << dev << " (" << state().devices << " found)");
  }
  // TVM selects the device before every kernel batch and copy; the driver call is made when this
  // thread's device changes (nothing else in llmchat's process switches it behind our back)
  if (t_bound != dev) {
    check_call(d.make_current(dev), "selecting the device");
    t_bound = dev;
  }
  t_device = dev;
}

static int attribute(int dev, Attr a) {
  Driver& d = drv();
  int v = 0;
  if (d.attribute(&v, d.attr_ids[a], dev) != 0) return 0;
  return v;
}

static std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      snprintf(buf, sizeof buf, "\\u%04x", c);
      o += buf;
    } else {
      o += c;
    }
  }
  return o;
}

static std::string device_name(int dev) {
  char name[256] = {0};
  if (drv().device_name(name, sizeof name - 1, dev) != 0) return "";
  return name;
}

// ==========================================================================================
// The device API (shared)
// ==========================================================================================
// TVM's host-side device types of the GPU runtimes: kDLCUDAHost (3) and kDLROCMHost (11)
static bool is_host_type(DLDeviceType t) { return t == kDLCUDAHost || t == kDLROCMHost; }

class GpuDeviceAPI final : public DeviceAPI {
 public:
  // for the host device API below: a copy of which one side may be host memory
  void Copy(const void* from, size_t from_offset, void* to, size_t to_offset, size_t size, Device dev_from,
            Device dev_to, DLDataType type, TVMStreamHandle stream) {
    CopyDataFromTo(from, from_offset, to, to_offset, size, dev_from, dev_to, type, stream);
  }

  void SetDevice(Device dev) final { use_device(dev.device_id); }

  void GetAttr(Device dev, DeviceAttrKind kind, ffi::Any* rv) final {
    std::lock_guard<std::recursive_mutex> guard(lock());
    bool exists = open_driver() && dev.device_id >= 0 && dev.device_id < state().devices;
    if (kind == tvm::runtime::kExist) {
      *rv = static_cast<int64_t>(exists);
      return;
    }
    if (!exists) return;
    int id = dev.device_id;
    Driver& d = drv();
    switch (kind) {
      case tvm::runtime::kMaxThreadsPerBlock:
        *rv = static_cast<int64_t>(attribute(id, kAttrMaxThreadsPerBlock));
        break;
      case tvm::runtime::kWarpSize:
        *rv = static_cast<int64_t>(attribute(id, kAttrWarpSize));
        break;
      case tvm::runtime::kMaxSharedMemoryPerBlock:
        *rv = static_cast<int64_t>(attribute(id, kAttrMaxSharedMemoryPerBlock));
        break;
      case tvm::runtime::kComputeVersion: {
        if (d.device_type == kDLROCM) {  // "1100" for gfx1100: llmchat names libraries gfx + this
          std::string a = d.arch_name(id);
          *rv = ffi::String(a.rfind("gfx", 0) == 0 ? a.substr(3) : a);
        } else {
          *rv = ffi::String(std::to_string(attribute(id, kAttrComputeMajor)) + "." +
                            std::to_string(attribute(id, kAttrComputeMinor)));
        }
        break;
      }
      case tvm::runtime::kGcnArch: {
        std::string a = d.arch_name(id);
        *rv = static_cast<int64_t>(a.rfind("gfx", 0) == 0 ? strtol(a.c_str() + 3, nullptr, 10) : 0);
        break;
      }
      case tvm::runtime::kDeviceName:
        *rv = ffi::String(device_name(id));
        break;
      case tvm::runtime::kMaxClockRate:
        *rv = static_cast<int64_t>(attribute(id, kAttrClockRate));
        break;
      case tvm::runtime::kMultiProcessorCount:
        *rv = static_cast<int64_t>(attribute(id, kAttrMultiprocessors));
        break;
      case tvm::runtime::kMaxThreadDimensions: {
        std::ostringstream os;
        os << "[" << attribute(id, kAttrBlockDimX) << ", " << attribute(id, kAttrBlockDimY) << ", "
           << attribute(id, kAttrBlockDimZ) << "]";
        *rv = ffi::String(os.str());
        break;
      }
      case tvm::runtime::kMaxRegistersPerBlock:
        *rv = static_cast<int64_t>(attribute(id, kAttrRegistersPerBlock));
        break;
      case tvm::runtime::kApiVersion:
      case tvm::runtime::kDriverVersion: {
        int v = 0;
        d.driver_version(&v);
        if (kind == tvm::runtime::kApiVersion) *rv = static_cast<int64_t>(v);
        else *rv = ffi::String(std::to_string(v));
        break;
      }
      case tvm::runtime::kL2CacheSizeBytes:
        *rv = static_cast<int64_t>(attribute(id, kAttrL2CacheSize));
        break;
      case tvm::runtime::kTotalGlobalMemory: {
        size_t n = 0;
        d.total_mem(&n, id);
        *rv = static_cast<int64_t>(n);
        break;
      }
      case tvm::runtime::kAvailableGlobalMemory: {
        size_t free_bytes = 0, total = 0;
        use_device(id);
        d.mem_info(&free_bytes, &total);
        *rv = static_cast<int64_t>(free_bytes);
        break;
      }
      default:
        break;
    }
  }

  void* AllocDataSpace(Device dev, size_t nbytes, size_t, DLDataType) final {
    std::lock_guard<std::recursive_mutex> guard(lock());
    use_device(dev.device_id);
    Driver& d = drv();
    void* p = nullptr;
    int r = d.mem_alloc(&p, std::max<size_t>(nbytes, 1));
    if (r != 0) {
      if (d.is_oom(r)) {
        size_t free_bytes = 0, total = 0;
        d.mem_info(&free_bytes, &total);
        LLMCHAT_FAIL("out of GPU memory allocating " << nbytes << " bytes (" << free_bytes << " of " << total
                                                     << " bytes free)");
      }
      check_call(r, "allocating GPU memory");
    }
    allocated_ += static_cast<int64_t>(nbytes);
    return p;
  }

  void FreeDataSpace(Device dev, void* ptr) final {
    std::lock_guard<std::recursive_mutex> guard(lock());
    if (ptr == nullptr) return;
    use_device(dev.device_id);
    check_call(drv().mem_free(ptr), "freeing GPU memory");
  }

  void StreamSync(Device dev, TVMStreamHandle stream) final {
    use_device(dev.device_id);
    check_call(drv().stream_sync(stream), "waiting for the GPU");
  }

  TVMStreamHandle CreateStream(Device dev) final {
    use_device(dev.device_id);
    void* s = nullptr;
    check_call(drv().stream_create(&s), "creating a stream");
    return s;
  }

  void FreeStream(Device dev, TVMStreamHandle stream) final {
    if (stream == nullptr) return;
    use_device(dev.device_id);
    check_call(drv().stream_destroy(stream), "destroying a stream");
  }

  void SyncStreamFromTo(Device dev, TVMStreamHandle from, TVMStreamHandle to) final {
    use_device(dev.device_id);
    Driver& d = drv();
    void* ev = nullptr;
    check_call(d.event_create(&ev), "creating an event");
    check_call(d.event_record(ev, from), "recording an event");
    check_call(d.stream_wait(to, ev), "ordering two streams");
    d.event_destroy(ev);
  }

  bool SupportsDevicePointerArithmeticsOnHost() final { return true; }

  void* AllocWorkspace(Device dev, size_t size, DLDataType) final;
  void FreeWorkspace(Device dev, void* data) final;

  static GpuDeviceAPI* Global() {
    static GpuDeviceAPI* inst = new GpuDeviceAPI();
    return inst;
  }

  int64_t allocated_ = 0;

 protected:
  void CopyDataFromTo(const void* from, size_t from_offset, void* to, size_t to_offset, size_t size,
                      Device dev_from, Device dev_to, DLDataType, TVMStreamHandle stream) final {
    if (size == 0) return;
    Driver& d = drv();
    if (is_host_type(dev_from.device_type)) dev_from.device_type = kDLCPU;  // the *_host devices
    if (is_host_type(dev_to.device_type)) dev_to.device_type = kDLCPU;
    if (dev_from.device_type == kDLCPU && dev_to.device_type == kDLCPU) {
      memcpy(static_cast<char*>(to) + to_offset, static_cast<const char*>(from) + from_offset, size);
      return;
    }
    const char* src = static_cast<const char*>(from) + from_offset;
    char* dst = static_cast<char*>(to) + to_offset;
    bool from_gpu = dev_from.device_type == d.device_type;
    bool to_gpu = dev_to.device_type == d.device_type;
    if (from_gpu && to_gpu) {
      if (dev_from.device_id != dev_to.device_id) LLMCHAT_FAIL("copies between two GPUs are not supported");
      use_device(dev_from.device_id);
      check_call(d.copy_dtod(dst, src, size, stream), "a copy on the GPU");
    } else if (from_gpu && dev_to.device_type == kDLCPU) {
      use_device(dev_from.device_id);
      check_call(d.copy_dtoh(dst, src, size, stream), "reading from the GPU");
      check_call(d.stream_sync(stream), "reading from the GPU");
    } else if (dev_from.device_type == kDLCPU && to_gpu) {
      use_device(dev_to.device_id);
      check_call(d.copy_htod(dst, src, size, stream), "copying to the GPU");
      if (d.htod_sync) check_call(d.stream_sync(stream), "copying to the GPU");
    } else {
      LLMCHAT_FAIL("cannot copy between device types " << static_cast<int>(dev_from.device_type) << " and "
                                                        << static_cast<int>(dev_to.device_type));
    }
  }
};

// `device_api.cuda_host` / `device_api.rocm_host`: host memory the GPU copies from and to (TVM's
// paged KV cache keeps its small per-step tables there). TVM's CUDA runtime registers it beside
// `device_api.cuda`; the twin replaces both. Plain aligned host memory; copies that reach the GPU
// go through the GPU device API.
class HostDeviceAPI final : public DeviceAPI {
 public:
  void SetDevice(Device) final {}
  void GetAttr(Device, DeviceAttrKind kind, ffi::Any* rv) final {
    if (kind == tvm::runtime::kExist) *rv = static_cast<int64_t>(1);
  }
  void* AllocDataSpace(Device, size_t nbytes, size_t alignment, DLDataType) final {
    void* p = nullptr;
    size_t align = std::max<size_t>(alignment, 64);
    if (posix_memalign(&p, align, std::max<size_t>(nbytes, 1)) != 0 || p == nullptr) {
      LLMCHAT_FAIL("out of host memory allocating " << nbytes << " bytes");
    }
    return p;
  }
  void FreeDataSpace(Device, void* ptr) final { free(ptr); }
  void StreamSync(Device, TVMStreamHandle) final {}
  void* AllocWorkspace(Device dev, size_t size, DLDataType type) final { return AllocDataSpace(dev, size, 64, type); }
  void FreeWorkspace(Device dev, void* data) final { FreeDataSpace(dev, data); }
  static HostDeviceAPI* Global() {
    static HostDeviceAPI* inst = new HostDeviceAPI();
    return inst;
  }

 protected:
  void CopyDataFromTo(const void* from, size_t from_offset, void* to, size_t to_offset, size_t size,
                      Device dev_from, Device dev_to, DLDataType type, TVMStreamHandle stream) final {
    GpuDeviceAPI::Global()->Copy(from, from_offset, to, to_offset, size, dev_from, dev_to, type, stream);
  }
};

struct ThreadEntry {
  tvm::runtime::WorkspacePool pool{driver_info().device_type, GpuDeviceAPI::Global()};
  static ThreadEntry* Get() {
    static thread_local ThreadEntry entry;
    return &entry;
  }
};

void* GpuDeviceAPI::AllocWorkspace(Device dev, size_t size, DLDataType) {
  return ThreadEntry::Get()->pool.AllocWorkspace(dev, size);
}

void GpuDeviceAPI::FreeWorkspace(Device dev, void* data) { ThreadEntry::Get()->pool.FreeWorkspace(dev, data); }

// ==========================================================================================
// TVM's serialized GPU module (shared): format, function table, code
// ==========================================================================================
//   <fmt: str> <n: u64> n x { <key: str> <name: str> <arg_types: vec<DLDataType (4 bytes)>>
//   <launch_param_tags: vec<str>> <arg_extra_tags: vec<i32>> } <code: str>
// ROCm: kind "hip", fmt "hsaco", code = one AMDGPU code object (ELF).
// CUDA: kind "cuda", fmt "cuda" (source, compiled through tvm_callback_cuda_compile; llmchat's
// libraries carry a prebuilt fatbin there), "fatbin", "cubin" or "ptx".
using llmchat_native::FunctionInfo;
using llmchat_native::Reader;

// -- what an AMDGPU code object holds: its target, its kernels and their wave size ----------
struct CodeObjectInfo {
  bool elf = false;
  std::string target;  // "gfx1100"
  std::unordered_map<std::string, int> wave;  // kernel -> 32 / 64 (from its kernel descriptor)
  int undefined = 0;                          // undefined symbols (must be 0 to load)
  std::string undefined_first;
};

template <typename T>
static bool read_at(const std::string& b, size_t off, T* out) {
  if (off > b.size() || b.size() - off < sizeof(T)) return false;
  memcpy(out, b.data() + off, sizeof(T));
  return true;
}

static CodeObjectInfo inspect_code_object(const std::string& b) {
  CodeObjectInfo info;
  if (b.size() < 64 || memcmp(b.data(), "\x7f" "ELF", 4) != 0 || b[4] != 2) return info;  // ELF64 only
  info.elf = true;
  // the target triple in the metadata: "amdgcn-amd-amdhsa--gfx1100" (TVM: "...-hcc-gfx1100")
  size_t at = b.find("amdgcn-amd-amdhsa-");
  if (at != std::string::npos) at = b.find("gfx", at);
  if (at != std::string::npos && at < b.size()) {
    size_t s = at, e = s;
    while (e < b.size() && (isalnum(static_cast<unsigned char>(b[e])))) ++e;
    info.target = b.substr(s, e - s);
  }
  uint64_t shoff = 0;
  uint16_t shentsize = 0, shnum = 0;
  read_at(b, 0x28, &shoff);
  read_at(b, 0x3a, &shentsize);
  read_at(b, 0x3c, &shnum);
  if (shentsize < 64) return info;
  struct Sec {
    uint32_t type;
    uint64_t addr, offset, size;
    uint32_t link;
    uint64_t entsize;
  };
  std::vector<Sec> secs;
  for (uint16_t i = 0; i < shnum; ++i) {
    size_t o = shoff + static_cast<size_t>(i) * shentsize;
    Sec s{};
    if (!read_at(b, o + 4, &s.type) || !read_at(b, o + 16, &s.addr) || !read_at(b, o + 24, &s.offset) ||
        !read_at(b, o + 32, &s.size) || !read_at(b, o + 40, &s.link) || !read_at(b, o + 56, &s.entsize)) {
      return info;
    }
    secs.push_back(s);
  }
  for (const Sec& s : secs) {
    if ((s.type != 2 && s.type != 11) || s.entsize < 24 || s.link >= secs.size()) continue;  // SYMTAB, DYNSYM
    const Sec& strtab = secs[s.link];
    for (uint64_t k = 1; k < s.size / s.entsize; ++k) {
      size_t o = s.offset + k * s.entsize;
      uint32_t name_off = 0;
      uint16_t shndx = 0;
      uint64_t value = 0;
      uint8_t st_info = 0;
      if (!read_at(b, o, &name_off) || !read_at(b, o + 4, &st_info) || !read_at(b, o + 6, &shndx) ||
          !read_at(b, o + 8, &value)) {
        break;
      }
      if (strtab.offset + name_off >= b.size()) continue;
      std::string name(b.data() + strtab.offset + name_off);
      if (name.empty()) continue;
      if (shndx == 0) {
        if (s.type == 11 && (st_info >> 4) != 2) {  // a weak undefined symbol is allowed
          if (info.undefined++ == 0) info.undefined_first = name;
        }
        continue;
      }
      if (name.size() > 3 && name.compare(name.size() - 3, 3, ".kd") == 0 && shndx < secs.size()) {
        // the kernel descriptor: kernel_code_properties (u16 at byte 56), bit 10 = wave32
        const Sec& in = secs[shndx];
        uint16_t props = 0;
        if (read_at(b, in.offset + (value - in.addr) + 56, &props)) {
          info.wave[name.substr(0, name.size() - 3)] = (props & (1u << 10)) ? 32 : 64;
        }
      }
    }
  }
  return info;
}

// -- argument packing (TVM's contract, pack_args.h) --------------------------------------------
enum ArgCode : uint8_t { kI64, kI32, kU32, kF32, kF64, kHandle };

static ArgCode arg_code(const std::string& fname, size_t i, DLDataType t, int32_t extra) {
  if (extra == 1) LLMCHAT_FAIL("kernel " << fname << " takes a TMA tensor map (argument " << i << "); not supported");
  if (t.lanes != 1) LLMCHAT_FAIL("kernel " << fname << ": vector argument " << i << " is not supported");
  if (t.code == kDLInt && t.bits == 64) return kI64;
  if (t.code == kDLInt && t.bits == 32) return kI32;
  if (t.code == kDLUInt && t.bits == 32) return kU32;
  if (t.code == kDLFloat && t.bits == 32) return kF32;
  if (t.code == kDLFloat && t.bits == 64) return kF64;
  if (t.code == kDLOpaqueHandle) return kHandle;
  LLMCHAT_FAIL("kernel " << fname << ": argument " << i << " has a type a kernel cannot take (code "
                         << int(t.code) << ", " << int(t.bits) << " bits)");
  return kHandle;  // not reached
}

struct Launcher {
  std::string name;
  std::vector<ArgCode> codes;
  std::vector<size_t> offsets;  // of each argument in the packed buffer (natural alignment)
  size_t pack_bytes = 0;
  std::vector<int> dim_of_tag;  // per launch argument: 0..2 grid, 3..5 block, 6..8 cluster
  bool dyn_shared = false;
  bool cluster = false;  // launched in thread-block clusters
  size_t slot = 0;  // its row in the module's function cache
};

constexpr int kMaxDevices = 16;

static Launcher make_launcher(const FunctionInfo& info) {
  Launcher l;
  l.name = info.name;
  size_t off = 0;
  for (size_t i = 0; i < info.arg_types.size(); ++i) {
    int32_t extra = i < info.extra_tags.size() ? info.extra_tags[i] : 0;
    ArgCode c = arg_code(info.name, i, info.arg_types[i], extra);
    size_t size = (c == kI32 || c == kU32 || c == kF32) ? 4 : 8;
    off = (off + size - 1) / size * size;
    l.codes.push_back(c);
    l.offsets.push_back(off);
    off += size;
  }
  l.pack_bytes = off;
  for (size_t i = 0; i < info.launch_tags.size(); ++i) {
    const std::string& tag = info.launch_tags[i];
    if (tag == "tirx.use_dyn_shared_memory") {
      if (i + 1 != info.launch_tags.size()) LLMCHAT_FAIL("kernel " << info.name << ": dynamic shared memory tag not last");
      l.dyn_shared = true;
    } else if (tag == "tirx.use_programtic_dependent_launch" || tag == "tirx.use_required_block_dimension") {
      // a scheduling hint: launching without it is correct
    } else if (tag == "tirx.use_cooperative_launch") {
      LLMCHAT_FAIL("kernel " << info.name << " needs a cooperative launch; not supported");
    } else if (tag.size() == 10 && tag.rfind("blockIdx.", 0) == 0 && tag[9] >= 'x' && tag[9] <= 'z') {
      l.dim_of_tag.push_back(tag[9] - 'x');
    } else if (tag.size() == 11 && tag.rfind("threadIdx.", 0) == 0 && tag[10] >= 'x' && tag[10] <= 'z') {
      l.dim_of_tag.push_back(3 + tag[10] - 'x');
    } else if (tag.size() == 15 && tag.rfind("clusterCtaIdx.", 0) == 0 && tag[14] >= 'x' && tag[14] <= 'z') {
      l.dim_of_tag.push_back(6 + tag[14] - 'x');
      l.cluster = true;
    } else {
      LLMCHAT_FAIL("kernel " << info.name << ": cannot handle the launch parameter " << tag);
    }
  }
  return l;
}

class GpuModule final : public ffi::ModuleObj {
 public:
  GpuModule(std::string fmt, std::unordered_map<std::string, FunctionInfo> fmap, std::string code,
            std::string image)
      : fmt_(std::move(fmt)), fmap_(std::move(fmap)), code_(std::move(code)), image_(std::move(image)) {
    for (const auto& kv : fmap_) {
      Launcher l = make_launcher(kv.second);
      l.slot = launchers_.size();
      launchers_.emplace(kv.first, std::move(l));
    }
    fast_.reset(new std::atomic<void*>[launchers_.size() * kMaxDevices]);
    for (size_t i = 0; i < launchers_.size() * kMaxDevices; ++i) fast_[i].store(nullptr);
    if (fmt_ == "hsaco") coinfo_ = inspect_code_object(image_);
  }

  ~GpuModule() {
    std::lock_guard<std::recursive_mutex> guard(lock());
    if (!state().ready) return;
    for (size_t dev = 0; dev < modules_.size(); ++dev) {
      if (modules_[dev] == nullptr) continue;
      if (driver_info().make_current(static_cast<int>(dev)) == 0) {
        t_bound = static_cast<int>(dev);
        driver_info().module_unload(modules_[dev]);
      }
    }
  }

  const char* kind() const final { return driver_info().module_kind; }
  int GetPropertyMask() const final { return ffi::Module::kBinarySerializable | ffi::Module::kRunnable; }

  ffi::Bytes SaveToBytes() const final {
    std::string out;
    auto put64 = [&](uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); };
    auto puts = [&](const std::string& s) {
      put64(s.size());
      out += s;
    };
    puts(fmt_);
    put64(fmap_.size());
    for (const auto& kv : fmap_) {
      puts(kv.first);
      puts(kv.second.name);
      put64(kv.second.arg_types.size());
      for (DLDataType t : kv.second.arg_types) out.append(reinterpret_cast<const char*>(&t), 4);
      put64(kv.second.launch_tags.size());
      for (const auto& s : kv.second.launch_tags) puts(s);
      put64(kv.second.extra_tags.size());
      for (int32_t v : kv.second.extra_tags) out.append(reinterpret_cast<const char*>(&v), 4);
    }
    puts(code_);
    return ffi::Bytes(out);
  }

  ffi::String InspectSource(const ffi::String& format) const final {
    if (fmt_ == "cuda" || fmt_ == "ptx") return code_;
    return ffi::String("");
  }

  ffi::Optional<ffi::Function> GetFunction(const ffi::String& name) final {
    std::string key(name);
    auto it = launchers_.find(key);
    if (it == launchers_.end()) return std::nullopt;
    ffi::ObjectPtr<ffi::Object> self = ffi::details::ObjectUnsafe::ObjectPtrFromUnowned<ffi::Object>(this);
    const Launcher* l = &it->second;
    return ffi::Function([this, self, l](ffi::PackedArgs args, ffi::Any*) { launch(*l, args); });
  }

  std::string describe() const {
    std::ostringstream os;
    os << "{\"kind\":\"" << driver_info().module_kind << "\",\"format\":\"" << json_escape(fmt_)
       << "\",\"code_bytes\":" << code_.size() << ",\"image_bytes\":" << image_.size();
    if (fmt_ == "hsaco") {
      os << ",\"elf\":" << (coinfo_.elf ? "true" : "false") << ",\"target\":\"" << json_escape(coinfo_.target)
         << "\",\"undefined_symbols\":" << coinfo_.undefined;
    }
    os << ",\"functions\":[";
    bool first = true;
    std::vector<std::string> keys;
    for (const auto& kv : fmap_) keys.push_back(kv.first);
    std::sort(keys.begin(), keys.end());
    for (const std::string& k : keys) {
      const FunctionInfo& f = fmap_.at(k);
      const Launcher& l = launchers_.at(k);
      if (!first) os << ",";
      first = false;
      os << "{\"name\":\"" << json_escape(f.name) << "\",\"args\":[";
      for (size_t i = 0; i < l.codes.size(); ++i) {
        static const char* names[] = {"int64", "int32", "uint32", "float32", "float64", "handle"};
        os << (i ? "," : "") << "\"" << names[l.codes[i]] << "\"";
      }
      os << "],\"arg_bytes\":" << l.pack_bytes << ",\"launch_tags\":[";
      for (size_t i = 0; i < f.launch_tags.size(); ++i) os << (i ? "," : "") << "\"" << json_escape(f.launch_tags[i]) << "\"";
      os << "]";
      if (fmt_ == "hsaco") {
        auto w = coinfo_.wave.find(f.name);
        os << ",\"in_code_object\":" << (w != coinfo_.wave.end() ? "true" : "false")
           << ",\"wave_size\":" << (w != coinfo_.wave.end() ? w->second : 0);
      }
      os << "}";
    }
    os << "]}";
    return os.str();
  }

 private:
  void* function_on(const Launcher& l, int dev) {
    if (dev >= 0 && dev < kMaxDevices) {
      void* fn = fast_[l.slot * kMaxDevices + dev].load(std::memory_order_acquire);
      if (fn != nullptr) return fn;
    }
    std::lock_guard<std::recursive_mutex> guard(lock());
    if (static_cast<size_t>(dev) < functions_.size()) {
      auto f = functions_[dev].find(l.name);
      if (f != functions_[dev].end()) return f->second;
    }
    Driver& d = drv();
    if (static_cast<size_t>(dev) >= modules_.size()) {
      modules_.resize(dev + 1, nullptr);
      functions_.resize(dev + 1);
    }
    if (modules_[dev] == nullptr) {
      if (image_.empty()) LLMCHAT_FAIL("the library's " << fmt_ << " module has no code to load");
      int r = d.module_load(&modules_[dev], image_.c_str());
      if (r != 0) {
        modules_[dev] = nullptr;
        std::string arch = d.arch_name(dev);
        if (fmt_ == "hsaco" && !coinfo_.target.empty() && !arch.empty() && coinfo_.target != arch) {
          LLMCHAT_FAIL("the model library was compiled for " << coinfo_.target << ", and this GPU is " << arch
                                                             << " (" << d.error_text(r) << "); rebuild it for "
                                                             << arch);
        }
        if (coinfo_.undefined) {
          LLMCHAT_FAIL("the library's code object could not be loaded: it refers to " << coinfo_.undefined_first
                                                                                      << ", which is not defined ("
                                                                                      << d.error_text(r) << ")");
        }
        LLMCHAT_FAIL("the library's " << fmt_ << " code object (" << coinfo_.target << ") could not be loaded on "
                                      << (arch.empty() ? "this GPU" : arch) << ": " << d.error_text(r));
      }
    }
    void* fn = nullptr;
    int r = d.module_function(&fn, modules_[dev], l.name.c_str());
    if (r != 0) LLMCHAT_FAIL("kernel " << l.name << " is not in the library's code object: " << d.error_text(r));
    functions_[dev][l.name] = fn;
    if (dev < kMaxDevices) fast_[l.slot * kMaxDevices + dev].store(fn, std::memory_order_release);
    return fn;
  }

  void launch(const Launcher& l, ffi::PackedArgs args) {
    size_t nargs = l.codes.size();
    size_t want = nargs + l.dim_of_tag.size() + (l.dyn_shared ? 1 : 0);
    if (static_cast<size_t>(args.size()) != want) {
      LLMCHAT_FAIL("kernel " << l.name << " got " << args.size() << " arguments, expected " << want);
    }
    int dev = t_device;
    use_device(dev);  // a thread's first launch binds its device (cheap afterwards)
    void* fn = function_on(l, dev);
    const TVMFFIAny* raw = reinterpret_cast<const TVMFFIAny*>(args.data());
    // pack: each argument at its natural alignment; `params` points at each one
    uint64_t storage[64];
    std::vector<uint64_t> heap;
    uint64_t* pack = storage;
    if (l.pack_bytes > sizeof storage) {
      heap.resize((l.pack_bytes + 7) / 8);
      pack = heap.data();
    }
    void* params_storage[64];
    std::vector<void*> params_heap;
    void** params = params_storage;
    if (nargs > 64) {
      params_heap.resize(nargs);
      params = params_heap.data();
    }
    char* base = reinterpret_cast<char*>(pack);
    for (size_t i = 0; i < nargs; ++i) {
      char* at = base + l.offsets[i];
      switch (l.codes[i]) {
        case kI64:
        case kF64:
        case kHandle:
          memcpy(at, &raw[i].v_int64, 8);
          break;
        case kI32: {
          int32_t v = static_cast<int32_t>(raw[i].v_int64);
          memcpy(at, &v, 4);
          break;
        }
        case kU32: {
          uint32_t v = static_cast<uint32_t>(raw[i].v_int64);
          memcpy(at, &v, 4);
          break;
        }
        case kF32: {
          float v = static_cast<float>(raw[i].v_float64);
          memcpy(at, &v, 4);
          break;
        }
      }
      params[i] = at;
    }
    // grid and block as TVM does: an extent of 0 (a dynamic shape) launches 1
    size_t work[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    for (size_t i = 0; i < l.dim_of_tag.size(); ++i) {
      int64_t v = raw[nargs + i].v_int64;
      if (v > 0) work[l.dim_of_tag[i]] = static_cast<size_t>(v);
    }
    unsigned shmem = 0;
    if (l.dyn_shared) shmem = static_cast<unsigned>(raw[nargs + l.dim_of_tag.size()].v_int64);
    unsigned grid[3], block[3];
    for (int i = 0; i < 3; ++i) {
      if (work[i] > 0x7fffffffu || work[3 + i] > 1024) {
        LLMCHAT_FAIL("kernel " << l.name << ": launch extent out of range (grid " << work[0] << "x" << work[1]
                               << "x" << work[2] << ", block " << work[3] << "x" << work[4] << "x" << work[5]
                               << ")");
      }
      grid[i] = static_cast<unsigned>(work[i]);
      block[i] = static_cast<unsigned>(work[3 + i]);
    }
    Driver& d = driver_info();
    if (shmem > 48 * 1024) {
      std::lock_guard<std::recursive_mutex> guard(lock());
      unsigned& allowed = shared_allowed_[fn];
      if (shmem > allowed) {
        check_call(d.allow_shared(fn, shmem), ("allowing kernel " + l.name + " more shared memory").c_str());
        allowed = shmem;
      }
    }
    void* stream = TVMFFIEnvGetStream(d.device_type, dev);
    int r;
    if (l.cluster) {
      if (d.launch_cluster == nullptr) {
        LLMCHAT_FAIL("kernel " << l.name << " is launched in thread-block clusters, which this runtime cannot do "
                               << "(HIP has none; CUDA needs cuLaunchKernelEx, driver 12 or newer)");
      }
      unsigned cluster[3] = {static_cast<unsigned>(work[6]), static_cast<unsigned>(work[7]),
                             static_cast<unsigned>(work[8])};
      if (cluster[0] * cluster[1] * cluster[2] > 8) {  // over the portable size: opt in once per kernel
        std::lock_guard<std::recursive_mutex> guard(lock());
        if (wide_clusters_.insert(fn).second) {
          check_call(d.allow_wide_clusters(fn), ("allowing kernel " + l.name + " clusters over 8 blocks").c_str());
        }
      }
      r = d.launch_cluster(fn, grid, block, cluster, shmem, stream, params);
    } else {
      r = d.launch(fn, grid, block, shmem, stream, params, pack, l.pack_bytes);
    }
    if (r != 0) {
      LLMCHAT_FAIL("launching kernel " << l.name << " (grid " << grid[0] << "x" << grid[1] << "x" << grid[2]
                                       << ", block " << block[0] << "x" << block[1] << "x" << block[2] << ", "
                                       << shmem << " bytes shared) failed: " << d.error_text(r));
    }
  }

  std::string fmt_;
  std::unordered_map<std::string, FunctionInfo> fmap_;
  std::string code_;   // as serialized
  std::string image_;  // what the driver loads (the code object, fatbin, cubin, PTX)
  CodeObjectInfo coinfo_;
  std::unordered_map<std::string, Launcher> launchers_;
  std::vector<void*> modules_;  // per device
  std::vector<std::unordered_map<std::string, void*>> functions_;
  std::unordered_map<void*, unsigned> shared_allowed_;
  std::unordered_set<void*> wide_clusters_;  // kernels allowed clusters over 8 blocks
  std::unique_ptr<std::atomic<void*>[]> fast_;  // [launcher slot][device] -> function, read without the lock
};

// CUDA source in the module: compiled the way TVM's CUDA runtime does, through the Python
// callback `tvm_callback_cuda_compile` (llmchat's decodes the fatbin built ahead of time)
static std::string cuda_image(const std::string& fmt, const std::string& code) {
  if (fmt != "cuda" && fmt != "cu") return code;
  auto compile = ffi::Function::GetGlobal("tvm_callback_cuda_compile");
  if (!compile.has_value()) LLMCHAT_FAIL("the library holds CUDA source and no tvm_callback_cuda_compile is registered");
  ffi::Any out = (*compile)(ffi::String(code));
  if (auto b = out.as<ffi::Bytes>()) return std::string(b->data(), b->size());
  if (auto s = out.as<ffi::String>()) return std::string(s->data(), s->size());
  LLMCHAT_FAIL("tvm_callback_cuda_compile returned neither bytes nor a string");
  return std::string();  // not reached
}

static ffi::Module load_from_bytes(const ffi::Bytes& bytes) {
  Reader r(bytes.data(), bytes.size(), "the library's GPU module");
  std::string fmt = r.str();
  std::unordered_map<std::string, FunctionInfo> fmap = llmchat_native::read_function_table(r);
  std::string code = r.str();
  Driver& d = driver_info();
  std::string image;
  if (d.device_type == kDLROCM) {
    if (fmt != "hsaco") LLMCHAT_FAIL("the library's ROCm module has format " << fmt << "; expected hsaco");
    image = code;
  } else {
    if (fmt != "cuda" && fmt != "cu" && fmt != "fatbin" && fmt != "cubin" && fmt != "ptx") {
      LLMCHAT_FAIL("the library's CUDA module has format " << fmt << ", which this runtime cannot load");
    }
    image = cuda_image(fmt, code);
  }
  auto mod = ffi::make_object<GpuModule>(fmt, std::move(fmap), std::move(code), std::move(image));
  return ffi::Module(mod);
}

// ==========================================================================================
// Graphs for the CUDA twin: TVM's `vm.builtin.cuda_graph.run_or_capture` / `get_cached_alloc`
// ==========================================================================================
// llmchat's CUDA libraries run their decode step as a captured graph (relax.backend.use_cuda_graph);
// TVM serves these builtins from its CUDA runtime library.  The twin serves them the same way:
// the first call runs the function once (warm-up: modules load, workspaces grow), then again
// while the stream is captured, and later calls launch the instantiated graph.
struct GraphKey {
  int64_t index;
  std::vector<int64_t> shape;
  bool operator<(const GraphKey& o) const { return index != o.index ? index < o.index : shape < o.shape; }
};

class GraphExtensionNode : public tvm::runtime::vm::VMExtensionNode {
 public:
  struct Captured {
    ffi::ObjectRef states;
    void* exec = nullptr;
  };
  std::map<GraphKey, Captured> graphs;
  std::unordered_map<int64_t, ffi::ObjectRef> allocs;
  int64_t captures = 0, launches = 0;

  ~GraphExtensionNode() {
    if (!state().ready) return;
    for (auto& kv : graphs) {
      if (kv.second.exec) driver_info().graph_exec_destroy(kv.second.exec);
    }
  }

  static constexpr const bool _type_mutable = true;
  TVM_FFI_DECLARE_OBJECT_INFO_FINAL("llmchat.gpu.GraphExtension", GraphExtensionNode,
                                    tvm::runtime::vm::VMExtensionNode);
};

class GraphExtension : public tvm::runtime::vm::VMExtension {
 public:
  TVM_FFI_DEFINE_OBJECT_REF_METHODS_NULLABLE(GraphExtension, tvm::runtime::vm::VMExtension, GraphExtensionNode);
  static GraphExtension Create() { return GraphExtension(ffi::make_object<GraphExtensionNode>()); }
};

static int64_t g_graph_captures = 0, g_graph_launches = 0;

static void run_or_capture(ffi::PackedArgs args, ffi::Any* rv) {
  if (args.size() != 4 && args.size() != 5) LLMCHAT_FAIL("run_or_capture takes 4 or 5 arguments");
  using tvm::runtime::vm::VirtualMachine;
  VirtualMachine* vm = VirtualMachine::GetContextPtr(args[0]);
  GraphExtensionNode* ext = const_cast<GraphExtensionNode*>(vm->GetOrCreateExtension<GraphExtension>().get());
  ffi::ObjectRef func = args[1].cast<ffi::ObjectRef>();
  GraphKey key{args[3].cast<int64_t>(), {}};
  if (args.size() == 5) {
    for (int64_t v : args[4].cast<ffi::Shape>()) key.shape.push_back(v);
  }
  Driver& d = drv();
  int dev = t_device;
  use_device(dev);
  auto found = ext->graphs.find(key);
  if (found != ext->graphs.end()) {
    check_call(d.graph_launch(found->second.exec, TVMFFIEnvGetStream(kDLCUDA, dev)), "launching a graph");
    ext->launches++;
    g_graph_launches++;
    *rv = found->second.states;
    return;
  }
  ffi::Array<ffi::Any> tuple = args[2].cast<ffi::Array<ffi::Any>>();
  std::vector<ffi::AnyView> packed(tuple.begin(), tuple.end());
  ffi::Any out;
  vm->InvokeClosurePacked(func, ffi::PackedArgs(packed.data(), static_cast<int>(packed.size())), &out);
  void* stream = nullptr;
  check_call(d.stream_create(&stream), "creating a capture stream");
  TVMFFIStreamHandle previous = nullptr;
  TVM_FFI_CHECK_SAFE_CALL(TVMFFIEnvSetStream(kDLCUDA, dev, stream, &previous));
  void* graph = nullptr;
  int began = d.capture_begin(stream);
  try {
    check_call(began, "beginning a stream capture");
    vm->InvokeClosurePacked(func, ffi::PackedArgs(packed.data(), static_cast<int>(packed.size())), &out);
  } catch (...) {
    if (began == 0) d.capture_end(stream, &graph);
    if (graph) d.graph_destroy(graph);
    TVMFFIEnvSetStream(kDLCUDA, dev, previous, nullptr);
    d.stream_destroy(stream);
    throw;
  }
  int ended = d.capture_end(stream, &graph);
  TVM_FFI_CHECK_SAFE_CALL(TVMFFIEnvSetStream(kDLCUDA, dev, previous, nullptr));
  d.stream_destroy(stream);
  check_call(ended, "ending a stream capture");
  GraphExtensionNode::Captured entry;
  entry.states = out.cast<ffi::ObjectRef>();
  int r = d.graph_instantiate(&entry.exec, graph);
  d.graph_destroy(graph);
  check_call(r, "instantiating a graph");
  ext->captures++;
  g_graph_captures++;
  *rv = entry.states;
  ext->graphs.emplace(std::move(key), std::move(entry));
}

static void get_cached_alloc(ffi::PackedArgs args, ffi::Any* rv) {
  if (args.size() != 3) LLMCHAT_FAIL("get_cached_alloc takes 3 arguments");
  using tvm::runtime::vm::VirtualMachine;
  VirtualMachine* vm = VirtualMachine::GetContextPtr(args[0]);
  GraphExtensionNode* ext = const_cast<GraphExtensionNode*>(vm->GetOrCreateExtension<GraphExtension>().get());
  int64_t index = args[2].cast<int64_t>();
  auto found = ext->allocs.find(index);
  if (found != ext->allocs.end()) {
    *rv = found->second;
    return;
  }
  ffi::Any out;
  vm->InvokeClosurePacked(args[1].cast<ffi::ObjectRef>(), ffi::PackedArgs(nullptr, 0), &out);
  ffi::ObjectRef result = out.cast<ffi::ObjectRef>();
  ext->allocs[index] = result;
  *rv = result;
}

static std::string status_json() {
  std::lock_guard<std::recursive_mutex> guard(lock());
  bool ok = open_driver();
  Driver& d = driver_info();
  State& s = state();
  std::ostringstream os;
  os << "{\"version\":" << kVersion << ",\"runtime\":\"" << (twin_mode() ? "cuda-twin" : "hip")
     << "\",\"device_type\":" << static_cast<int>(d.device_type) << ",\"driver_found\":" << (ok ? "true" : "false")
     << ",\"library\":\"" << json_escape(d.library) << "\",\"error\":\"" << json_escape(s.error)
     << "\",\"load_errors\":\"" << json_escape(d.load_error) << "\",\"devices_error\":\""
     << json_escape(s.devices_error) << "\",\"devices\":[";
  if (ok) {
    for (int i = 0; i < s.devices; ++i) {
      size_t total = 0;
      d.total_mem(&total, i);
      os << (i ? "," : "") << "{\"index\":" << i << ",\"name\":\"" << json_escape(device_name(i)) << "\",\"arch\":\""
         << json_escape(d.arch_name(i)) << "\",\"warp_size\":" << attribute(i, kAttrWarpSize)
         << ",\"compute_units\":" << attribute(i, kAttrMultiprocessors) << ",\"memory_bytes\":" << total
         << ",\"max_shared_memory_per_block\":" << attribute(i, kAttrMaxSharedMemoryPerBlock) << "}";
    }
  }
  os << "]}";
  return os.str();
}

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  Driver& d = driver_info();
  // In twin mode TVM's own CUDA runtime may already be registered (it loads with `import tvm`
  // where libcudart resolves): these names replace it in this process.
  std::string kind = d.module_kind;
  std::string api = d.device_type == kDLROCM ? "rocm" : "cuda";
  ffi::Function::SetGlobal("ffi.Module.load_from_bytes." + kind, ffi::Function::FromTyped(load_from_bytes), true);
  ffi::Function::SetGlobal("device_api." + api, ffi::Function::FromPacked([](ffi::PackedArgs, ffi::Any* rv) {
                             *rv = static_cast<void*>(GpuDeviceAPI::Global());
                           }),
                           true);
  ffi::Function::SetGlobal("device_api." + api + "_host",
                           ffi::Function::FromPacked([](ffi::PackedArgs, ffi::Any* rv) {
                             *rv = static_cast<void*>(HostDeviceAPI::Global());
                           }),
                           true);
  if (d.device_type == kDLCUDA) {
    ffi::Function::SetGlobal("vm.builtin.cuda_graph.run_or_capture", ffi::Function::FromPacked(run_or_capture),
                             true);
    ffi::Function::SetGlobal("vm.builtin.cuda_graph.get_cached_alloc", ffi::Function::FromPacked(get_cached_alloc),
                             true);
  }
  refl::GlobalDef()
      .def("llmchat.gpu.graphs",
           []() -> ffi::String {
             return ffi::String("{\"captures\":" + std::to_string(g_graph_captures) +
                                ",\"launches\":" + std::to_string(g_graph_launches) + "}");
           })
      .def("llmchat.gpu.version", []() -> int64_t { return kVersion; })
      .def("llmchat.gpu.runtime", []() -> ffi::String { return ffi::String(twin_mode() ? "cuda-twin" : "hip"); })
      .def("llmchat.gpu.status", []() -> ffi::String { return ffi::String(status_json()); })
      .def("llmchat.gpu.describe",
           [](ffi::Module mod) -> ffi::String {
             const GpuModule* m = dynamic_cast<const GpuModule*>(mod.operator->());
             if (m == nullptr) LLMCHAT_FAIL("not a module loaded by llmchat's GPU runtime (kind " << mod->kind() << ")");
             return ffi::String(m->describe());
           })
      .def("llmchat.gpu.allocated", []() -> int64_t { return GpuDeviceAPI::Global()->allocated_; });
}

}  // namespace llmchat_gpu
