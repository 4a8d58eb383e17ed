// llmchat's WebGPU device API for TVM's runtime, driving wgpu-native (Vulkan, Metal, DX12).
//
// TVM's `webgpu` code generator turns every kernel into a WGSL shader: storage buffers bound
// 0..n-1 (read-only or read-write as the `paramWriteAccess:[...]` launch tag says), then one
// uniform buffer with the scalar arguments followed by `packGridDimX`.  This library gives
// TVM's runtime what it needs to run such a library outside the browser:
//
//   * `device_api.webgpu`: memory (one wgpu buffer per allocation; TVM passes views as element
//     offsets, never as moved pointers), copies host<->device and device<->device of any size
//     and offset, the workspace pool, synchronisation;
//   * `ffi.Module.load_from_bytes.webgpu`: the loader for the module TVM exports (function
//     table + WGSL per kernel), whose functions launch with TVM's grid rules (blockIdx.z is
//     reserved: grids over 65,535 fold into z, and `packGridDimX` tells the shader which
//     workgroups are past the end);
//   * `llmchat.webgpu.*`: the adapters wgpu sees, counters, and errors as messages.
//
// The launch path is native: pipelines are made once per kernel, bind groups are cached per
// (kernel, buffers), scalars go into one uniform ring bound with a dynamic offset, and every
// dispatch, host->device copy and device->device copy of a step lands in one command encoder
// that is submitted when the host needs a result (a read back, a sync, a free).
//
// The contract was learnt from TVM's browser runtime (web/emcc/webgpu_runtime.cc and
// web/src/webgpu.ts in the apache-tvm wheel); this is llmchat's own implementation.

#include <dlfcn.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/device_api.h>
#include <webgpu.h>
#include <wgpu.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "../../native/tvm_function_table.h"
#include "workspace_pool.h"

namespace llmchat_webgpu {

using tvm::Device;
using tvm::runtime::DeviceAPI;
using tvm::runtime::DeviceAttrKind;
namespace ffi = tvm::ffi;

constexpr int kVersion = 2;
// timestamps per submission when profiling (LLMCHAT_WEBGPU_PROFILE=1)
constexpr uint32_t kProfileQueries = 4096;
constexpr DLDeviceType kDeviceType = static_cast<DLDeviceType>(kDLWebGPU);
constexpr size_t kUniformRingBytes = 1 << 20;  // scalar arguments of up to 4,096 dispatches
constexpr size_t kUploadRingBytes = 8 << 20;   // host->device copies recorded into one encoder
constexpr uint32_t kMaxGridDim = 65535;

// Built by zig's clang (libc++), an exception thrown inside a device-API call cannot unwind through
// TVM's libstdc++ frames: the message is printed first, so it is seen even then.
#ifdef LLMCHAT_PRINT_ERRORS
#define LLMCHAT_REPORT(text) fprintf(stderr, "llmchat: WebGPU: %s\n", (text).c_str())
#else
#define LLMCHAT_REPORT(text) (void)0
#endif
#define LLMCHAT_FAIL(msg)                                   \
  do {                                                      \
    std::ostringstream os_;                                 \
    os_ << msg;                                             \
    LLMCHAT_REPORT(os_.str());                              \
    TVM_FFI_THROW(RuntimeError) << "WebGPU: " << os_.str(); \
  } while (0)

static std::string sv(WGPUStringView s) {
  if (s.data == nullptr) return std::string();
  if (s.length == WGPU_STRLEN) return std::string(s.data);
  return std::string(s.data, s.length);
}

static WGPUStringView view(const std::string& s) { return WGPUStringView{s.data(), s.size()}; }

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// ------------------------------------------------------------------------------------------
// Instance and adapters
// ------------------------------------------------------------------------------------------
struct Adapter {
  WGPUAdapter handle = nullptr;
  WGPUAdapterInfo info = WGPU_ADAPTER_INFO_INIT;
  WGPULimits limits = WGPU_LIMITS_INIT;
  bool f16 = false;
  bool subgroups = false;
  WGPUFeatureName subgroup_feature = WGPUFeatureName_Subgroups;  // the name this wgpu offers it by
  bool timestamps = false;  // timestamp queries between the dispatches of a compute pass
};

static std::recursive_mutex& lock() {
  static std::recursive_mutex mu;
  return mu;
}

static WGPUInstance instance() {
  static WGPUInstance inst = [] {
    WGPUInstanceExtras extras = {};
    extras.chain.sType = static_cast<WGPUSType>(WGPUSType_InstanceExtras);
    const char* env = getenv("LLMCHAT_WGPU_BACKENDS");  // "vulkan" (default), "primary", "all"
    std::string which = env ? env : "vulkan";
    extras.backends = which == "all"       ? WGPUInstanceBackend_All
                      : which == "primary" ? WGPUInstanceBackend_Primary
                                           : WGPUInstanceBackend_Vulkan;
    WGPUInstanceDescriptor desc = {};
    desc.nextInChain = &extras.chain;
    return wgpuCreateInstance(&desc);
  }();
  return inst;
}

static int adapter_rank(const Adapter& a) {
  switch (a.info.adapterType) {
    case WGPUAdapterType_DiscreteGPU: return 0;
    case WGPUAdapterType_IntegratedGPU: return 1;
    case WGPUAdapterType_CPU: return 3;
    default: return 2;
  }
}

// Every adapter wgpu finds, GPUs first (discrete, integrated, other, then CPU devices such as
// Mesa's lavapipe); `vulkan:N` is the N-th of this list.
static std::vector<Adapter>& adapters() {
  static std::vector<Adapter> list = [] {
    std::vector<Adapter> out;
    WGPUInstance inst = instance();
    if (inst == nullptr) return out;
    WGPUInstanceEnumerateAdapterOptions opts = {};
    const char* env = getenv("LLMCHAT_WGPU_BACKENDS");
    std::string which = env ? env : "vulkan";
    opts.backends = which == "all"       ? WGPUInstanceBackend_All
                    : which == "primary" ? WGPUInstanceBackend_Primary
                                         : WGPUInstanceBackend_Vulkan;
    size_t n = wgpuInstanceEnumerateAdapters(inst, &opts, nullptr);
    std::vector<WGPUAdapter> handles(n);
    if (n) wgpuInstanceEnumerateAdapters(inst, &opts, handles.data());
    for (WGPUAdapter h : handles) {
      Adapter a;
      a.handle = h;
      wgpuAdapterGetInfo(h, &a.info);
      wgpuAdapterGetLimits(h, &a.limits);
      // LLMCHAT_WEBGPU_F16=0 treats the adapter as one without shader-f16 (a driver whose f16 is
      // broken, and the tests of the float32 fallback)
      const char* f16_env = getenv("LLMCHAT_WEBGPU_F16");
      a.f16 = wgpuAdapterHasFeature(h, WGPUFeatureName_ShaderF16) && !(f16_env && std::string(f16_env) == "0");
      // wgpu-native 29 offers subgroups as its native feature "subgroup"; WebGPU's standard
      // "subgroups" where a later version maps it
      const auto native_subgroup = static_cast<WGPUFeatureName>(WGPUNativeFeature_Subgroup);
      if (wgpuAdapterHasFeature(h, WGPUFeatureName_Subgroups)) {
        a.subgroups = true;
        a.subgroup_feature = WGPUFeatureName_Subgroups;
      } else if (wgpuAdapterHasFeature(h, native_subgroup)) {
        a.subgroups = true;
        a.subgroup_feature = native_subgroup;
      }
      a.timestamps = wgpuAdapterHasFeature(h, WGPUFeatureName_TimestampQuery) &&
                     wgpuAdapterHasFeature(h, static_cast<WGPUFeatureName>(WGPUNativeFeature_TimestampQueryInsidePasses));
      out.push_back(a);
    }
    std::stable_sort(out.begin(), out.end(),
                     [](const Adapter& x, const Adapter& y) { return adapter_rank(x) < adapter_rank(y); });
    return out;
  }();
  return list;
}

static const char* adapter_type_name(WGPUAdapterType t) {
  switch (t) {
    case WGPUAdapterType_DiscreteGPU: return "DiscreteGPU";
    case WGPUAdapterType_IntegratedGPU: return "IntegratedGPU";
    case WGPUAdapterType_CPU: return "CPU";
    default: return "Unknown";
  }
}

static const char* backend_name(WGPUBackendType t) {
  switch (t) {
    case WGPUBackendType_Vulkan: return "Vulkan";
    case WGPUBackendType_Metal: return "Metal";
    case WGPUBackendType_D3D12: return "D3D12";
    case WGPUBackendType_OpenGL: return "OpenGL";
    case WGPUBackendType_OpenGLES: return "OpenGLES";
    default: return "other";
  }
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

static std::string adapters_json() {
  std::ostringstream os;
  os << "[";
  bool first = true;
  for (const Adapter& a : adapters()) {
    if (!first) os << ",";
    first = false;
    const WGPULimits& l = a.limits;
    os << "{\"name\":\"" << json_escape(sv(a.info.device)) << "\",\"vendor\":\""
       << json_escape(sv(a.info.vendor)) << "\",\"architecture\":\"" << json_escape(sv(a.info.architecture))
       << "\",\"driver\":\"" << json_escape(sv(a.info.description)) << "\",\"vendor_id\":"
       << a.info.vendorID << ",\"device_id\":" << a.info.deviceID << ",\"device_type\":\""
       << adapter_type_name(a.info.adapterType) << "\",\"backend\":\"" << backend_name(a.info.backendType)
       << "\",\"shader_f16\":" << (a.f16 ? "true" : "false")
       << ",\"subgroups\":" << (a.subgroups ? "true" : "false")
       << ",\"subgroup_min_size\":" << a.info.subgroupMinSize
       << ",\"subgroup_max_size\":" << a.info.subgroupMaxSize << ",\"limits\":{"
       << "\"max_buffer_size\":" << l.maxBufferSize
       << ",\"max_storage_buffer_binding_size\":" << l.maxStorageBufferBindingSize
       << ",\"max_storage_buffers_per_shader_stage\":" << l.maxStorageBuffersPerShaderStage
       << ",\"max_compute_workgroup_storage_size\":" << l.maxComputeWorkgroupStorageSize
       << ",\"max_compute_invocations_per_workgroup\":" << l.maxComputeInvocationsPerWorkgroup
       << ",\"max_compute_workgroup_size_x\":" << l.maxComputeWorkgroupSizeX
       << ",\"max_compute_workgroups_per_dimension\":" << l.maxComputeWorkgroupsPerDimension
       << ",\"min_uniform_buffer_offset_alignment\":" << l.minUniformBufferOffsetAlignment << "}}";
  }
  os << "]";
  return os.str();
}

// ------------------------------------------------------------------------------------------
// One device per adapter, with its pending command encoder
// ------------------------------------------------------------------------------------------
struct Context {
  int index = 0;
  const Adapter* adapter = nullptr;
  WGPUDevice device = nullptr;
  WGPUQueue queue = nullptr;
  WGPULimits limits = WGPU_LIMITS_INIT;
  bool f16 = false;
  std::string errors;  // validation / out-of-memory messages not yet reported
  bool lost = false;
  std::string lost_message;

  WGPUCommandEncoder encoder = nullptr;
  WGPUComputePassEncoder pass = nullptr;

  WGPUBuffer uniform = nullptr;  // scalar arguments, one slot per dispatch
  std::vector<uint8_t> uniform_host;
  size_t uniform_used = 0;
  // where the slots not yet written to the GPU begin: a submission writes only its own slots, so
  // the work submitted before it keeps reading the slots it was recorded with
  size_t uniform_start = 0;
  uint32_t uniform_align = 256;

  // LLMCHAT_WEBGPU_SUBMIT_EVERY=N: submit the pending encoder after every N dispatches, so the GPU
  // runs the first kernels of a step while the host records the rest (0, the default: only when
  // the host needs a result). Slower at every N tried on the H200 with NVIDIA's driver (Llama-2-7B
  // decode 244.8 tok/s at 0, 238.8 at 96, 226.4 at 32, 185.9 at 8: benchmarks/results/
  // h200-2026-12-03-s13/sweep); kept for drivers where recording a step costs more than a submit
  int64_t submit_every = 0, since_submit = 0;

  // LLMCHAT_WEBGPU_REPEAT=NAME: every launch of a kernel whose name contains NAME is dispatched a
  // second time, right after the first, with the same arguments (every kernel of a decode step
  // writes what it wrote again). A benchmark's measure of what one more such dispatch costs the
  // real step (benchmarks/vulkan_profile.py --repeat), where the GPU profiler's timestamps
  // overstate small kernels; never for use
  std::string repeat;
  // LLMCHAT_WEBGPU_SKIP=NAME: a launch of a kernel whose name contains NAME dispatches nothing (its
  // outputs keep what they held). A benchmark's measure of what that kernel costs the real step
  // where it runs (benchmarks/vulkan_profile.py --skip): unlike a repeat, the kernels around it
  // meet the caches as they would; the tokens it decodes are wrong, so never for use
  std::string skip;

  WGPUBuffer upload = nullptr;  // host->device copies inside the pending encoder
  size_t upload_used = 0;

  WGPUBuffer staging = nullptr;  // device->host reads
  size_t staging_size = 0;

  // bind groups by (pipeline, buffers)
  std::unordered_map<std::string, WGPUBindGroup> bind_groups;

  // llmchat.webgpu.record_qkv / substitute_next: a decoded token's RoPE and KV append inside the
  // decode attention (app/inference/pipelines/wgsl_rope_append.py). The q/k/v projection's host
  // code records its output buffer; the attention's host code then asks for its next launch's
  // buffer argument ``substitute`` to be that buffer (it reads q, k and v of the token there)
  WGPUBuffer recorded = nullptr;
  int substitute = -1;

  // asynchronous read-backs (llmchat.webgpu.readback_*): a copy queued behind the work recorded so
  // far, waited for by its own submission, not by the work queued after it
  struct Readback {
    WGPUBuffer staging = nullptr;
    size_t size = 0, nbytes = 0;
    WGPUSubmissionIndex submission = 0;
    bool pending = false, mapped = false, failed = false;
  };
  std::vector<Readback> readbacks_async;
  WGPUSubmissionIndex last_submission = 0;

  // counters (llmchat.webgpu.stats)
  int64_t dispatches = 0, submits = 0, syncs = 0, readbacks = 0, allocated = 0, peak = 0,
          bind_group_misses = 0;
  // host time (ns): recording launches, finishing + submitting encoders, waiting for the GPU
  int64_t record_ns = 0, submit_ns = 0, wait_ns = 0;

  // LLMCHAT_WEBGPU_PROFILE=1: a GPU timestamp after every dispatch (and one where a compute pass
  // begins); each submission waits for its work and charges the time between a dispatch's
  // timestamp and the one before it to that kernel (llmchat.webgpu.profile). For finding where a
  // step's GPU time goes, not for speed: it serialises the host and the GPU.
  bool profiling = false;
  std::string profile_error;  // why profiling was asked for and is off
  WGPUQuerySet queries = nullptr;
  WGPUBuffer query_resolve = nullptr, query_read = nullptr;
  std::vector<std::string> query_names;  // per timestamp: the kernel it ends ("" marks a pass start)
  struct KernelTime {
    int64_t count = 0;
    double ns = 0;
  };
  std::map<std::string, KernelTime> profile;
  double profile_total_ns = 0;
};

static int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

static std::vector<std::unique_ptr<Context>>& contexts() {
  static std::vector<std::unique_ptr<Context>> all;
  return all;
}

static void on_uncaptured_error(WGPUDevice const*, WGPUErrorType type, WGPUStringView message, void* ud1,
                                void*) {
  Context* ctx = static_cast<Context*>(ud1);
  const char* kind = type == WGPUErrorType_OutOfMemory ? "out of memory"
                     : type == WGPUErrorType_Validation ? "validation error"
                                                         : "error";
  if (ctx->errors.size() < 8192) ctx->errors += std::string(kind) + ": " + sv(message) + "\n";
}

static void on_device_lost(WGPUDevice const*, WGPUDeviceLostReason reason, WGPUStringView message, void* ud1,
                           void*) {
  Context* ctx = static_cast<Context*>(ud1);
  if (reason == WGPUDeviceLostReason_Destroyed || reason == WGPUDeviceLostReason_CallbackCancelled) return;
  ctx->lost = true;
  ctx->lost_message = sv(message);
}

struct DeviceRequest {
  WGPUDevice device = nullptr;
  bool done = false;
  std::string message;
};

static void on_device(WGPURequestDeviceStatus status, WGPUDevice device, WGPUStringView message, void* ud1,
                      void*) {
  DeviceRequest* req = static_cast<DeviceRequest*>(ud1);
  req->done = true;
  if (status == WGPURequestDeviceStatus_Success) {
    req->device = device;
  } else {
    req->message = sv(message);
  }
}

static void check(Context* ctx, const char* what) {
  if (ctx->lost) {
    LLMCHAT_FAIL("the GPU device was lost during " << what << " (" << ctx->lost_message
                                                   << "); restart llmchat");
  }
  if (!ctx->errors.empty()) {
    std::string msg = ctx->errors;
    ctx->errors.clear();
    while (!msg.empty() && msg.back() == '\n') msg.pop_back();
    LLMCHAT_FAIL(what << " failed: " << msg);
  }
}

static Context* get_context(int index) {
  std::lock_guard<std::recursive_mutex> guard(lock());
  auto& all = contexts();
  if (index < 0) LLMCHAT_FAIL("negative device index " << index);
  if (static_cast<size_t>(index) < all.size() && all[index]) return all[index].get();
  const auto& list = adapters();
  if (static_cast<size_t>(index) >= list.size()) {
    LLMCHAT_FAIL("no adapter " << index << " (wgpu found " << list.size() << " Vulkan adapter"
                               << (list.size() == 1 ? "" : "s") << ")");
  }
  auto ctx = std::make_unique<Context>();
  ctx->index = index;
  ctx->adapter = &list[index];
  const Adapter& a = list[index];

  // Ask for what the adapter has: TVM's attention kernels bind up to ~10 storage buffers
  // (WebGPU's default is 8), prefill kernels use more workgroup memory than the default
  // 16 KiB, and weights want the largest buffers the driver allows.
  WGPULimits want = a.limits;
  want.nextInChain = nullptr;
  std::vector<WGPUFeatureName> features;
  if (a.f16) features.push_back(WGPUFeatureName_ShaderF16);
  // WGSL with `enable subgroups;` (a library built for a -sgN profile) needs the feature on the
  // device; code built without subgroups runs the same with it
  if (a.subgroups) features.push_back(a.subgroup_feature);
  const char* every_env = getenv("LLMCHAT_WEBGPU_SUBMIT_EVERY");
  const int64_t submit_every = every_env != nullptr ? std::max<int64_t>(0, strtoll(every_env, nullptr, 10)) : 0;
  const char* profile_env = getenv("LLMCHAT_WEBGPU_PROFILE");
  const bool want_profile = profile_env != nullptr && std::string(profile_env) == "1";
  if (want_profile && a.timestamps) {
    features.push_back(WGPUFeatureName_TimestampQuery);
    features.push_back(static_cast<WGPUFeatureName>(WGPUNativeFeature_TimestampQueryInsideEncoders));
    features.push_back(static_cast<WGPUFeatureName>(WGPUNativeFeature_TimestampQueryInsidePasses));
  }

  WGPUDeviceDescriptor desc = {};
  std::string label = "llmchat";
  desc.label = view(label);
  desc.requiredFeatureCount = features.size();
  desc.requiredFeatures = features.data();
  desc.requiredLimits = &want;
  desc.deviceLostCallbackInfo.mode = WGPUCallbackMode_AllowSpontaneous;
  desc.deviceLostCallbackInfo.callback = on_device_lost;
  desc.deviceLostCallbackInfo.userdata1 = ctx.get();
  desc.uncapturedErrorCallbackInfo.callback = on_uncaptured_error;
  desc.uncapturedErrorCallbackInfo.userdata1 = ctx.get();

  DeviceRequest req;
  WGPURequestDeviceCallbackInfo cb = {};
  cb.mode = WGPUCallbackMode_AllowProcessEvents;
  cb.callback = on_device;
  cb.userdata1 = &req;
  wgpuAdapterRequestDevice(a.handle, &desc, cb);
  for (int i = 0; i < 100000 && !req.done; ++i) wgpuInstanceProcessEvents(instance());
  if (req.device == nullptr) {
    LLMCHAT_FAIL("could not open adapter " << index << " (" << sv(a.info.device)
                                           << "): " << (req.done ? req.message : "no answer"));
  }
  ctx->device = req.device;
  ctx->queue = wgpuDeviceGetQueue(ctx->device);
  wgpuDeviceGetLimits(ctx->device, &ctx->limits);
  ctx->limits.nextInChain = nullptr;
  ctx->f16 = a.f16;
  ctx->uniform_align = std::max<uint32_t>(ctx->limits.minUniformBufferOffsetAlignment, 16);

  WGPUBufferDescriptor bd = {};
  bd.size = kUniformRingBytes;
  bd.usage = WGPUBufferUsage_Uniform | WGPUBufferUsage_CopyDst;
  ctx->uniform = wgpuDeviceCreateBuffer(ctx->device, &bd);
  ctx->uniform_host.assign(kUniformRingBytes, 0);
  bd.size = kUploadRingBytes;
  bd.usage = WGPUBufferUsage_CopySrc | WGPUBufferUsage_CopyDst;
  ctx->upload = wgpuDeviceCreateBuffer(ctx->device, &bd);
  check(ctx.get(), "creating the device's buffers");
  if (want_profile && !a.timestamps) {
    ctx->profile_error = "this adapter has no timestamp queries inside compute passes";
  } else if (want_profile) {
    WGPUQuerySetDescriptor qd = WGPU_QUERY_SET_DESCRIPTOR_INIT;
    qd.type = WGPUQueryType_Timestamp;
    qd.count = kProfileQueries;
    ctx->queries = wgpuDeviceCreateQuerySet(ctx->device, &qd);
    bd.size = uint64_t(kProfileQueries) * 8;
    bd.usage = WGPUBufferUsage_QueryResolve | WGPUBufferUsage_CopySrc;
    ctx->query_resolve = wgpuDeviceCreateBuffer(ctx->device, &bd);
    bd.usage = WGPUBufferUsage_MapRead | WGPUBufferUsage_CopyDst;
    ctx->query_read = wgpuDeviceCreateBuffer(ctx->device, &bd);
    check(ctx.get(), "creating the profiler's timestamp queries");
    ctx->profiling = true;
  }
  ctx->submit_every = submit_every;
  const char* repeat_env = getenv("LLMCHAT_WEBGPU_REPEAT");
  ctx->repeat = repeat_env != nullptr ? repeat_env : "";
  const char* skip_env = getenv("LLMCHAT_WEBGPU_SKIP");
  ctx->skip = skip_env != nullptr ? skip_env : "";

  if (all.size() <= static_cast<size_t>(index)) all.resize(index + 1);
  all[index] = std::move(ctx);
  return all[index].get();
}

// -- the pending encoder -------------------------------------------------------------------
static WGPUCommandEncoder encoder(Context* ctx) {
  if (ctx->encoder == nullptr) ctx->encoder = wgpuDeviceCreateCommandEncoder(ctx->device, nullptr);
  return ctx->encoder;
}

static void end_pass(Context* ctx) {
  if (ctx->pass != nullptr) {
    wgpuComputePassEncoderEnd(ctx->pass);
    wgpuComputePassEncoderRelease(ctx->pass);
    ctx->pass = nullptr;
  }
}

static WGPUComputePassEncoder pass(Context* ctx) {
  if (ctx->pass == nullptr) {
    ctx->pass = wgpuCommandEncoderBeginComputePass(encoder(ctx), nullptr);
    if (ctx->profiling) {  // the baseline of the pass's first dispatch
      wgpuComputePassEncoderWriteTimestamp(ctx->pass, ctx->queries, static_cast<uint32_t>(ctx->query_names.size()));
      ctx->query_names.emplace_back();
    }
  }
  return ctx->pass;
}

static void wait_map(Context* ctx, WGPUBuffer buf, size_t span, const char* what);

// The timestamps of the submission just made, once it has run: each dispatch's time is its
// timestamp minus the one before it.
static void charge_profile(Context* ctx) {
  size_t n = ctx->query_names.size();
  wgpuDevicePoll(ctx->device, true, nullptr);
  wait_map(ctx, ctx->query_read, n * 8, "reading the GPU's timestamps");
  const uint64_t* t = static_cast<const uint64_t*>(wgpuBufferGetConstMappedRange(ctx->query_read, 0, n * 8));
  const double period = wgpuQueueGetTimestampPeriod(ctx->queue);
  for (size_t i = 1; i < n; ++i) {
    const std::string& name = ctx->query_names[i];
    if (name.empty() || t[i] < t[i - 1]) continue;
    double ns = static_cast<double>(t[i] - t[i - 1]) * period;
    Context::KernelTime& kt = ctx->profile[name];
    kt.count++;
    kt.ns += ns;
    ctx->profile_total_ns += ns;
  }
  wgpuBufferUnmap(ctx->query_read);
  ctx->query_names.clear();
}

// Submit what was recorded: the scalar arguments go up first (queue writes land before the
// command buffers submitted after them), then the encoder.
static void flush(Context* ctx) {
  if (ctx->encoder == nullptr) return;
  int64_t t0 = now_ns();
  end_pass(ctx);
  const bool stamped = ctx->profiling && !ctx->query_names.empty();
  if (stamped) {
    uint32_t n = static_cast<uint32_t>(ctx->query_names.size());
    wgpuCommandEncoderResolveQuerySet(ctx->encoder, ctx->queries, 0, n, ctx->query_resolve, 0);
    wgpuCommandEncoderCopyBufferToBuffer(ctx->encoder, ctx->query_resolve, 0, ctx->query_read, 0, uint64_t(n) * 8);
  }
  WGPUCommandBuffer cmd = wgpuCommandEncoderFinish(ctx->encoder, nullptr);
  wgpuCommandEncoderRelease(ctx->encoder);
  ctx->encoder = nullptr;
  if (ctx->uniform_used > ctx->uniform_start) {
    wgpuQueueWriteBuffer(ctx->queue, ctx->uniform, ctx->uniform_start, ctx->uniform_host.data() + ctx->uniform_start,
                         ctx->uniform_used - ctx->uniform_start);
  }
  ctx->last_submission = wgpuQueueSubmitForIndex(ctx->queue, 1, &cmd);
  wgpuCommandBufferRelease(cmd);
  ctx->uniform_start = ctx->uniform_used;
  ctx->since_submit = 0;
  ctx->upload_used = 0;
  ctx->submits++;
  ctx->submit_ns += now_ns() - t0;
  check(ctx, "submitting GPU work");
  if (stamped) charge_profile(ctx);
}

static void wait_idle(Context* ctx) {
  flush(ctx);
  int64_t t0 = now_ns();
  wgpuDevicePoll(ctx->device, true, nullptr);
  ctx->wait_ns += now_ns() - t0;
  ctx->syncs++;
  check(ctx, "waiting for the GPU");
}

// -- buffers ---------------------------------------------------------------------------------
static WGPUBuffer as_buffer(const void* p) { return static_cast<WGPUBuffer>(const_cast<void*>(p)); }

static void drop_bind_groups(Context* ctx, WGPUBuffer buf) {
  for (auto it = ctx->bind_groups.begin(); it != ctx->bind_groups.end();) {
    const std::string& key = it->first;
    bool uses = false;
    for (size_t off = sizeof(void*); off + sizeof(void*) <= key.size(); off += sizeof(void*)) {
      void* p;
      memcpy(&p, key.data() + off, sizeof p);
      if (p == static_cast<void*>(buf)) {
        uses = true;
        break;
      }
    }
    if (uses) {
      wgpuBindGroupRelease(it->second);
      it = ctx->bind_groups.erase(it);
    } else {
      ++it;
    }
  }
}

static void wait_map(Context* ctx, WGPUBuffer buf, size_t span, const char* what) {
  struct MapState {
    bool done = false;
    WGPUMapAsyncStatus status = WGPUMapAsyncStatus_Error;
    std::string message;
  } state;
  WGPUBufferMapCallbackInfo cb = {};
  cb.mode = WGPUCallbackMode_AllowProcessEvents;
  cb.callback = [](WGPUMapAsyncStatus status, WGPUStringView message, void* ud1, void*) {
    MapState* st = static_cast<MapState*>(ud1);
    st->done = true;
    st->status = status;
    st->message = sv(message);
  };
  cb.userdata1 = &state;
  wgpuBufferMapAsync(buf, WGPUMapMode_Read, 0, span, cb);
  while (!state.done) {
    wgpuDevicePoll(ctx->device, true, nullptr);
    wgpuInstanceProcessEvents(instance());
    if (ctx->lost) break;
  }
  check(ctx, what);
  if (state.status != WGPUMapAsyncStatus_Success) LLMCHAT_FAIL(what << " failed: " << state.message);
}

static void read_back(Context* ctx, WGPUBuffer src, size_t offset, void* dst, size_t nbytes) {
  if (nbytes == 0) return;
  size_t begin = offset / 4 * 4;
  size_t end = round_up(offset + nbytes, 4);
  size_t span = end - begin;
  if (ctx->staging_size < span) {
    if (ctx->staging) wgpuBufferRelease(ctx->staging);
    size_t size = std::max<size_t>(round_up(span, 1 << 16), 1 << 16);
    WGPUBufferDescriptor bd = {};
    bd.size = size;
    bd.usage = WGPUBufferUsage_MapRead | WGPUBufferUsage_CopyDst;
    ctx->staging = wgpuDeviceCreateBuffer(ctx->device, &bd);
    ctx->staging_size = size;
    check(ctx, "allocating a read-back buffer");
  }
  end_pass(ctx);
  wgpuCommandEncoderCopyBufferToBuffer(encoder(ctx), src, begin, ctx->staging, 0, span);
  flush(ctx);
  int64_t t0 = now_ns();
  ctx->readbacks++;
  wait_map(ctx, ctx->staging, span, "reading a result back from the GPU");
  ctx->wait_ns += now_ns() - t0;
  const uint8_t* mapped = static_cast<const uint8_t*>(wgpuBufferGetConstMappedRange(ctx->staging, 0, span));
  memcpy(dst, mapped + (offset - begin), nbytes);
  wgpuBufferUnmap(ctx->staging);
}

// Host -> device.  Aligned copies go through the upload ring inside the pending encoder (in
// order with the kernels recorded before them, no submit); an unaligned edge is patched with a
// read of the surrounding 4-byte words.
static void write_to(Context* ctx, WGPUBuffer dst, size_t offset, const void* src, size_t nbytes) {
  if (nbytes == 0) return;
  if (offset % 4 != 0 || nbytes % 4 != 0) {
    size_t begin = offset / 4 * 4;
    size_t end = round_up(offset + nbytes, 4);
    std::vector<uint8_t> words(end - begin);
    read_back(ctx, dst, begin, words.data(), words.size());
    memcpy(words.data() + (offset - begin), src, nbytes);
    write_to(ctx, dst, begin, words.data(), words.size());
    return;
  }
  if (nbytes > kUploadRingBytes / 2) {  // large (weights): straight onto the queue, after the pending work
    flush(ctx);
    wgpuQueueWriteBuffer(ctx->queue, dst, offset, src, nbytes);
    check(ctx, "copying to the GPU");
    return;
  }
  if (ctx->upload_used + nbytes > kUploadRingBytes) flush(ctx);
  size_t at = ctx->upload_used;
  wgpuQueueWriteBuffer(ctx->queue, ctx->upload, at, src, nbytes);
  end_pass(ctx);
  wgpuCommandEncoderCopyBufferToBuffer(encoder(ctx), ctx->upload, at, dst, offset, nbytes);
  ctx->upload_used = round_up(at + nbytes, 256);
}

static void copy_within(Context* ctx, WGPUBuffer src, size_t src_off, WGPUBuffer dst, size_t dst_off,
                        size_t nbytes) {
  if (nbytes == 0) return;
  if (src != dst && src_off % 4 == 0 && dst_off % 4 == 0 && nbytes % 4 == 0) {
    end_pass(ctx);
    wgpuCommandEncoderCopyBufferToBuffer(encoder(ctx), src, src_off, dst, dst_off, nbytes);
    return;
  }
  std::vector<uint8_t> tmp(nbytes);
  read_back(ctx, src, src_off, tmp.data(), nbytes);
  write_to(ctx, dst, dst_off, tmp.data(), nbytes);
}

// Queue the copy of ``nbytes`` from ``src`` (offset 0) into read-back slot ``slot`` behind the
// recorded work, submit, and map it asynchronously; :func:`readback_wait` returns the bytes.
static void readback_start(Context* ctx, int slot, WGPUBuffer src, size_t nbytes) {
  if (slot < 0 || slot > 15) LLMCHAT_FAIL("read-back slot " << slot << " out of range");
  if (static_cast<size_t>(slot) >= ctx->readbacks_async.size()) ctx->readbacks_async.resize(slot + 1);
  Context::Readback& rb = ctx->readbacks_async[slot];
  if (rb.pending) LLMCHAT_FAIL("read-back slot " << slot << " is still in use");
  size_t span = round_up(std::max<size_t>(nbytes, 4), 4);
  if (rb.size < span) {
    if (rb.staging) wgpuBufferRelease(rb.staging);
    WGPUBufferDescriptor bd = {};
    bd.size = round_up(span, 256);
    bd.usage = WGPUBufferUsage_MapRead | WGPUBufferUsage_CopyDst;
    rb.staging = wgpuDeviceCreateBuffer(ctx->device, &bd);
    rb.size = bd.size;
    check(ctx, "allocating a read-back buffer");
  }
  end_pass(ctx);
  wgpuCommandEncoderCopyBufferToBuffer(encoder(ctx), src, 0, rb.staging, 0, span);
  flush(ctx);
  rb.submission = ctx->last_submission;
  rb.nbytes = nbytes;
  rb.pending = true;
  rb.mapped = rb.failed = false;
  WGPUBufferMapCallbackInfo cb = {};
  cb.mode = WGPUCallbackMode_AllowProcessEvents;
  cb.callback = [](WGPUMapAsyncStatus status, WGPUStringView, void* ud1, void*) {
    Context::Readback* r = static_cast<Context::Readback*>(ud1);
    r->mapped = status == WGPUMapAsyncStatus_Success;
    r->failed = !r->mapped;
  };
  cb.userdata1 = &rb;
  wgpuBufferMapAsync(rb.staging, WGPUMapMode_Read, 0, span, cb);
}

static std::string readback_wait(Context* ctx, int slot) {
  if (slot < 0 || static_cast<size_t>(slot) >= ctx->readbacks_async.size() || !ctx->readbacks_async[slot].pending) {
    LLMCHAT_FAIL("read-back slot " << slot << " has nothing queued");
  }
  Context::Readback& rb = ctx->readbacks_async[slot];
  int64_t t0 = now_ns();
  while (!rb.mapped && !rb.failed && !ctx->lost) {
    wgpuDevicePoll(ctx->device, true, &rb.submission);  // that submission only
    wgpuInstanceProcessEvents(instance());
  }
  ctx->wait_ns += now_ns() - t0;
  rb.pending = false;
  ctx->readbacks++;
  check(ctx, "reading token ids back from the GPU");
  if (!rb.mapped) LLMCHAT_FAIL("reading token ids back from the GPU failed");
  const char* data = static_cast<const char*>(wgpuBufferGetConstMappedRange(rb.staging, 0, round_up(std::max<size_t>(rb.nbytes, 4), 4)));
  std::string out(data, rb.nbytes);
  wgpuBufferUnmap(rb.staging);
  rb.mapped = false;
  return out;
}

// ------------------------------------------------------------------------------------------
// The device API
// ------------------------------------------------------------------------------------------
class WebGPUDeviceAPI final : public DeviceAPI {
 public:
  void SetDevice(Device dev) final;

  void GetAttr(Device dev, DeviceAttrKind kind, ffi::Any* rv) final {
    std::lock_guard<std::recursive_mutex> guard(lock());
    const auto& list = adapters();
    bool exists = dev.device_id >= 0 && static_cast<size_t>(dev.device_id) < list.size();
    if (kind == tvm::runtime::kExist) {
      *rv = static_cast<int64_t>(exists);
      return;
    }
    if (!exists) return;
    const Adapter& a = list[dev.device_id];
    switch (kind) {
      case tvm::runtime::kMaxThreadsPerBlock:
        *rv = static_cast<int64_t>(a.limits.maxComputeInvocationsPerWorkgroup);
        break;
      case tvm::runtime::kWarpSize:
        // the subgroup size compiled code may assume: one fixed size (min == max), else 1
        *rv = static_cast<int64_t>(a.subgroups && a.info.subgroupMinSize == a.info.subgroupMaxSize &&
                                           a.info.subgroupMinSize > 0
                                       ? a.info.subgroupMinSize
                                       : 1);
        break;
      case tvm::runtime::kMaxSharedMemoryPerBlock:
        *rv = static_cast<int64_t>(a.limits.maxComputeWorkgroupStorageSize);
        break;
      case tvm::runtime::kDeviceName:
        *rv = ffi::String(sv(a.info.device));
        break;
      case tvm::runtime::kDriverVersion:
        *rv = ffi::String(sv(a.info.description));
        break;
      case tvm::runtime::kMaxThreadDimensions: {
        std::ostringstream os;
        os << "[" << a.limits.maxComputeWorkgroupSizeX << ", " << a.limits.maxComputeWorkgroupSizeY << ", "
           << a.limits.maxComputeWorkgroupSizeZ << "]";
        *rv = ffi::String(os.str());
        break;
      }
      case tvm::runtime::kComputeVersion:
        *rv = ffi::String("1.0");
        break;
      default:
        break;
    }
  }

  void* AllocDataSpace(Device dev, size_t nbytes, size_t, DLDataType) final {
    std::lock_guard<std::recursive_mutex> guard(lock());
    Context* ctx = get_context(dev.device_id);
    size_t size = std::max<size_t>(4, round_up(nbytes, 4));
    if (size > ctx->limits.maxBufferSize) {
      LLMCHAT_FAIL("a buffer of " << nbytes << " bytes is larger than this adapter allows ("
                                  << ctx->limits.maxBufferSize << " bytes)");
    }
    check(ctx, "earlier GPU work");
    WGPUBufferDescriptor bd = {};
    bd.size = size;
    bd.usage = WGPUBufferUsage_Storage | WGPUBufferUsage_CopySrc | WGPUBufferUsage_CopyDst;
    WGPUBuffer buf = wgpuDeviceCreateBuffer(ctx->device, &bd);
    if (buf == nullptr || !ctx->errors.empty()) {
      if (buf) wgpuBufferRelease(buf);
      std::string msg = ctx->errors;
      ctx->errors.clear();
      LLMCHAT_FAIL("out of GPU memory allocating " << nbytes << " bytes (" << msg << ")");
    }
    ctx->allocated += static_cast<int64_t>(size);
    ctx->peak = std::max(ctx->peak, ctx->allocated);
    return buf;
  }

  void FreeDataSpace(Device dev, void* ptr) final {
    std::lock_guard<std::recursive_mutex> guard(lock());
    if (ptr == nullptr) return;
    Context* ctx = get_context(dev.device_id);
    WGPUBuffer buf = as_buffer(ptr);
    flush(ctx);  // recorded work may still read it
    drop_bind_groups(ctx, buf);
    if (ctx->recorded == buf) ctx->recorded = nullptr;
    ctx->allocated -= static_cast<int64_t>(wgpuBufferGetSize(buf));
    wgpuBufferRelease(buf);
  }

  void StreamSync(Device dev, TVMStreamHandle) final {
    std::lock_guard<std::recursive_mutex> guard(lock());
    wait_idle(get_context(dev.device_id));
  }

  TVMStreamHandle CreateStream(Device) final { return nullptr; }
  void FreeStream(Device, TVMStreamHandle) final {}
  void SetStream(Device, TVMStreamHandle) final {}
  TVMStreamHandle GetCurrentStream(Device) final { return nullptr; }
  void SyncStreamFromTo(Device, TVMStreamHandle, TVMStreamHandle) final {}

  void* AllocWorkspace(Device dev, size_t size, DLDataType) final;
  void FreeWorkspace(Device dev, void* data) final;

  static WebGPUDeviceAPI* Global() {
    static WebGPUDeviceAPI* inst = new WebGPUDeviceAPI();
    return inst;
  }

 protected:
  void CopyDataFromTo(const void* from, size_t from_offset, void* to, size_t to_offset, size_t size,
                      Device dev_from, Device dev_to, DLDataType, TVMStreamHandle) final {
    std::lock_guard<std::recursive_mutex> guard(lock());
    int from_type = static_cast<int>(dev_from.device_type);
    int to_type = static_cast<int>(dev_to.device_type);
    if (from_type == kDLWebGPU && to_type == kDLWebGPU) {
      if (dev_from.device_id != dev_to.device_id) {
        LLMCHAT_FAIL("copies between two adapters are not supported");
      }
      copy_within(get_context(dev_from.device_id), as_buffer(from), from_offset, as_buffer(to), to_offset, size);
    } else if (from_type == kDLWebGPU && to_type == kDLCPU) {
      read_back(get_context(dev_from.device_id), as_buffer(from), from_offset,
                static_cast<uint8_t*>(to) + to_offset, size);
    } else if (from_type == kDLCPU && to_type == kDLWebGPU) {
      write_to(get_context(dev_to.device_id), as_buffer(to), to_offset,
               static_cast<const uint8_t*>(from) + from_offset, size);
    } else {
      LLMCHAT_FAIL("cannot copy between device types " << from_type << " and " << to_type);
    }
  }
};

struct ThreadEntry {
  tvm::runtime::WorkspacePool pool{kDeviceType, WebGPUDeviceAPI::Global()};
  static ThreadEntry* Get() {
    static thread_local ThreadEntry entry;
    return &entry;
  }
};

void* WebGPUDeviceAPI::AllocWorkspace(Device dev, size_t size, DLDataType) {
  return ThreadEntry::Get()->pool.AllocWorkspace(dev, size);
}

void WebGPUDeviceAPI::FreeWorkspace(Device dev, void* data) { ThreadEntry::Get()->pool.FreeWorkspace(dev, data); }

// ------------------------------------------------------------------------------------------
// The module: TVM's exported WebGPU module (function table + WGSL), loaded and launched
// ------------------------------------------------------------------------------------------
using llmchat_native::FunctionInfo;
using llmchat_native::Reader;

struct Kernel {
  std::string name;
  WGPUComputePipeline pipeline = nullptr;
  WGPUBindGroupLayout layout = nullptr;
  std::vector<int> buffer_args;  // argument positions of the storage buffers
  std::vector<int> pod_args;     // argument positions of the scalars
  std::vector<char> pod_kind;    // 'i', 'u', 'f'
  std::vector<int> dim_of_tag;   // per launch argument: 0..2 blockIdx, 3..5 threadIdx
  size_t pod_bytes = 0;
  bool inclusive_guard = true;  // the shader returns when index > packGridDimX
  Context* ctx = nullptr;
};

class WebGPUModule final : public ffi::ModuleObj {
 public:
  WebGPUModule(std::unordered_map<std::string, FunctionInfo> fmap,
               std::unordered_map<std::string, std::string> smap)
      : fmap_(std::move(fmap)), smap_(std::move(smap)) {}

  ~WebGPUModule() {
    for (auto& kv : kernels_) {
      if (kv.second->pipeline) wgpuComputePipelineRelease(kv.second->pipeline);
      if (kv.second->layout) wgpuBindGroupLayoutRelease(kv.second->layout);
    }
  }

  const char* kind() const final { return "webgpu"; }
  int GetPropertyMask() const final { return ffi::Module::kBinarySerializable; }

  ffi::Bytes SaveToBytes() const final {
    std::string out;
    auto put64 = [&](uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); };
    auto puts = [&](const std::string& s) {
      put64(s.size());
      out += s;
    };
    put64(fmap_.size());
    for (const auto& kv : fmap_) {
      puts(kv.first);
      puts(kv.second.name);
      put64(kv.second.arg_types.size());
      for (DLDataType t : kv.second.arg_types) out.append(reinterpret_cast<const char*>(&t), 4);
      put64(kv.second.launch_tags.size());
      for (const auto& s : kv.second.launch_tags) puts(s);
      put64(0);
    }
    put64(smap_.size());
    for (const auto& kv : smap_) {
      puts(kv.first);
      puts(kv.second);
    }
    return ffi::Bytes(out);
  }

  ffi::String InspectSource(const ffi::String&) const final {
    std::string all;
    for (const auto& kv : smap_) all += kv.second;
    return all;
  }

  ffi::Optional<ffi::Function> GetFunction(const ffi::String& name) final {
    std::string key(name);
    auto it = fmap_.find(key);
    if (it == fmap_.end()) return std::nullopt;
    auto src = smap_.find(key);
    if (src == smap_.end()) return std::nullopt;
    // one pipeline per kernel and device, made on first use and kept
    ffi::ObjectPtr<ffi::Object> self = ffi::details::ObjectUnsafe::ObjectPtrFromUnowned<ffi::Object>(this);
    std::string fname = key;
    return ffi::Function([this, self, fname](ffi::PackedArgs args, ffi::Any* rv) {
      std::lock_guard<std::recursive_mutex> guard(lock());
      int dev_id = current_device();
      Kernel* k = kernel(fname, dev_id);
      launch(k, args);
    });
  }

 private:
  static int current_device() {
    // TVM sets the device through __tvm_set_device before launches; one adapter is in use at a
    // time in llmchat, so the last one opened is the one the host code runs on.
    return current_device_;
  }

 public:
  static int current_device_;

 private:
  Kernel* kernel(const std::string& fname, int dev_id) {
    std::string key = fname + "#" + std::to_string(dev_id);
    auto found = kernels_.find(key);
    if (found != kernels_.end()) return found->second.get();
    Context* ctx = get_context(dev_id);
    const FunctionInfo& info = fmap_.at(fname);
    const std::string& code = smap_.at(fname);
    auto k = std::make_unique<Kernel>();
    k->name = fname;
    k->ctx = ctx;
    std::vector<int> write_access;
    for (const std::string& tag : info.launch_tags) {
      if (tag.rfind("blockIdx.", 0) == 0 && tag.size() == 10) {
        k->dim_of_tag.push_back(tag[9] - 'x');
      } else if (tag.rfind("threadIdx.", 0) == 0 && tag.size() == 11) {
        k->dim_of_tag.push_back(3 + tag[10] - 'x');
      } else if (tag.rfind("paramWriteAccess:", 0) == 0) {
        std::string list = tag.substr(17);
        for (char& c : list) {
          if (c == '[' || c == ']' || c == ',') c = ' ';
        }
        std::istringstream is(list);
        int v;
        while (is >> v) write_access.push_back(v);
      } else {
        LLMCHAT_FAIL("kernel " << fname << ": cannot handle the launch parameter " << tag);
      }
    }
    for (size_t i = 0; i < info.arg_types.size(); ++i) {
      DLDataType t = info.arg_types[i];
      if (t.code == kDLOpaqueHandle) {
        k->buffer_args.push_back(static_cast<int>(i));
      } else if ((t.code == kDLInt || t.code == kDLUInt || t.code == kDLFloat) && t.bits == 32 && t.lanes == 1) {
        k->pod_args.push_back(static_cast<int>(i));
        k->pod_kind.push_back(t.code == kDLInt ? 'i' : t.code == kDLUInt ? 'u' : 'f');
      } else {
        LLMCHAT_FAIL("kernel " << fname << ": argument " << i << " has a type WGSL cannot take (code "
                               << int(t.code) << ", " << int(t.bits) << " bits)");
      }
    }
    if (write_access.size() != k->buffer_args.size()) {
      LLMCHAT_FAIL("kernel " << fname << ": paramWriteAccess lists " << write_access.size()
                             << " buffers, the function has " << k->buffer_args.size());
    }
    if (k->buffer_args.size() > ctx->limits.maxStorageBuffersPerShaderStage) {
      LLMCHAT_FAIL("kernel " << fname << " binds " << k->buffer_args.size() << " storage buffers; this adapter allows "
                             << ctx->limits.maxStorageBuffersPerShaderStage);
    }
    k->pod_bytes = (k->pod_args.size() + 1) * 4;
    k->inclusive_guard = code.find(">= podArgs.packGridDimX") == std::string::npos;

    std::vector<WGPUBindGroupLayoutEntry> entries;
    for (size_t i = 0; i < k->buffer_args.size(); ++i) {
      WGPUBindGroupLayoutEntry e = WGPU_BIND_GROUP_LAYOUT_ENTRY_INIT;
      e.binding = static_cast<uint32_t>(i);
      e.visibility = WGPUShaderStage_Compute;
      e.buffer.type = write_access[i] ? WGPUBufferBindingType_Storage : WGPUBufferBindingType_ReadOnlyStorage;
      entries.push_back(e);
    }
    WGPUBindGroupLayoutEntry u = WGPU_BIND_GROUP_LAYOUT_ENTRY_INIT;
    u.binding = static_cast<uint32_t>(k->buffer_args.size());
    u.visibility = WGPUShaderStage_Compute;
    u.buffer.type = WGPUBufferBindingType_Uniform;
    u.buffer.hasDynamicOffset = true;
    entries.push_back(u);
    WGPUBindGroupLayoutDescriptor ld = {};
    ld.entryCount = entries.size();
    ld.entries = entries.data();
    k->layout = wgpuDeviceCreateBindGroupLayout(ctx->device, &ld);
    WGPUPipelineLayoutDescriptor pld = {};
    pld.bindGroupLayoutCount = 1;
    pld.bindGroupLayouts = &k->layout;
    WGPUPipelineLayout playout = wgpuDeviceCreatePipelineLayout(ctx->device, &pld);

    // TVM writes `enable subgroups;` before subgroup operations; wgpu-native 29's WGSL parser
    // (naga) rejects that directive ("not yet supported") but takes the operations themselves on
    // a device with its native "subgroup" feature: the directive goes, the operations stay
    std::string source = code;
    const std::string directive = "enable subgroups;";
    for (size_t at = source.find(directive); at != std::string::npos; at = source.find(directive)) {
      if (!ctx->adapter->subgroups) {
        LLMCHAT_FAIL("kernel " << fname << " uses subgroup operations; this adapter offers none "
                               << "(rebuild the model library for this adapter)");
      }
      source.erase(at, directive.size());
    }
    WGPUShaderSourceWGSL wgsl = {};
    wgsl.chain.sType = WGPUSType_ShaderSourceWGSL;
    wgsl.code = view(source);
    WGPUShaderModuleDescriptor smd = {};
    smd.nextInChain = &wgsl.chain;
    WGPUShaderModule sm = wgpuDeviceCreateShaderModule(ctx->device, &smd);
    WGPUComputePipelineDescriptor cpd = {};
    cpd.layout = playout;
    cpd.compute.module = sm;
    cpd.compute.entryPoint = view(info.name);
    k->pipeline = wgpuDeviceCreateComputePipeline(ctx->device, &cpd);
    wgpuShaderModuleRelease(sm);
    wgpuPipelineLayoutRelease(playout);
    if (!ctx->errors.empty()) {
      std::string msg = ctx->errors;
      ctx->errors.clear();
      LLMCHAT_FAIL("the adapter rejected kernel " << fname << ": " << msg);
    }
    Kernel* raw = k.get();
    kernels_[key] = std::move(k);
    return raw;
  }

  static void launch(Kernel* k, ffi::PackedArgs args) {
    Context* ctx = k->ctx;
    int64_t t0 = now_ns();
    int substitute = ctx->substitute;  // for this launch only, whether it dispatches or not
    ctx->substitute = -1;
    if (ctx->lost) check(ctx, ("running kernel " + k->name).c_str());
    size_t nargs = k->buffer_args.size() + k->pod_args.size();
    if (static_cast<size_t>(args.size()) != nargs + k->dim_of_tag.size()) {
      LLMCHAT_FAIL("kernel " << k->name << " got " << args.size() << " arguments, expected "
                             << nargs + k->dim_of_tag.size());
    }
    uint64_t work[6] = {1, 1, 1, 1, 1, 1};
    for (size_t i = 0; i < k->dim_of_tag.size(); ++i) {
      int64_t v = args[nargs + i].cast<int64_t>();
      if (v < 0) LLMCHAT_FAIL("kernel " << k->name << ": negative launch extent " << v);
      work[k->dim_of_tag[i]] = static_cast<uint64_t>(v);
    }
    if (work[0] == 0 || work[1] == 0 || work[2] == 0) return;  // nothing to run
    if (!ctx->skip.empty() && k->name.find(ctx->skip) != std::string::npos) return;  // LLMCHAT_WEBGPU_SKIP
    if (work[2] != 1) LLMCHAT_FAIL("kernel " << k->name << ": blockIdx.z is reserved for large grids");
    uint64_t pack_x = work[0];
    uint64_t gx = work[0], gz = 1;
    uint32_t max_dim = std::min<uint32_t>(ctx->limits.maxComputeWorkgroupsPerDimension, kMaxGridDim);
    while (gx > max_dim) {
      gx = (gx + 1) / 2;
      gz *= 2;
    }
    if (gz > max_dim || work[1] > max_dim) {
      LLMCHAT_FAIL("kernel " << k->name << ": grid " << work[0] << " x " << work[1] << " is too large");
    }

    // the profiler's timestamps of this dispatch (and of a new pass) must fit its query set
    if (ctx->profiling && ctx->query_names.size() + 2 > kProfileQueries) flush(ctx);
    // scalars into the uniform ring
    size_t slot = round_up(k->pod_bytes, ctx->uniform_align);
    if (ctx->uniform_used + slot > ctx->uniform_host.size()) {  // the ring is full: start it again
      flush(ctx);
      ctx->uniform_used = ctx->uniform_start = 0;
    }
    uint32_t offset = static_cast<uint32_t>(ctx->uniform_used);
    uint8_t* pod = ctx->uniform_host.data() + offset;
    for (size_t i = 0; i < k->pod_args.size(); ++i) {
      ffi::AnyView a = args[k->pod_args[i]];
      char kind = k->pod_kind[i];
      if (kind == 'f') {
        float f = static_cast<float>(a.cast<double>());
        memcpy(pod + 4 * i, &f, 4);
      } else if (kind == 'i') {
        int32_t v = static_cast<int32_t>(a.cast<int64_t>());
        memcpy(pod + 4 * i, &v, 4);
      } else {
        uint32_t v = static_cast<uint32_t>(a.cast<int64_t>());
        memcpy(pod + 4 * i, &v, 4);
      }
    }
    // the shader skips a workgroup whose linear index is past packGridDimX
    uint32_t last = static_cast<uint32_t>(k->inclusive_guard ? pack_x - 1 : pack_x);
    memcpy(pod + 4 * k->pod_args.size(), &last, 4);
    ctx->uniform_used += slot;

    // the bind group of these buffers (cached)
    std::string key(sizeof(void*) * (1 + k->buffer_args.size()), '\0');
    WGPUComputePipeline pipe = k->pipeline;
    memcpy(&key[0], &pipe, sizeof(void*));
    std::vector<WGPUBuffer> bufs(k->buffer_args.size());
    if (substitute >= static_cast<int>(k->buffer_args.size())) {
      LLMCHAT_FAIL("kernel " << k->name << ": no buffer argument " << substitute << " to substitute");
    }
    for (size_t i = 0; i < k->buffer_args.size(); ++i) {
      void* p = args[k->buffer_args[i]].cast<void*>();
      if (static_cast<int>(i) == substitute) {
        if (ctx->recorded == nullptr) {
          LLMCHAT_FAIL("kernel " << k->name << ": no q/k/v projection was recorded for it to read");
        }
        p = static_cast<void*>(ctx->recorded);
      }
      if (p == nullptr) LLMCHAT_FAIL("kernel " << k->name << ": buffer argument " << i << " is NULL");
      bufs[i] = as_buffer(p);
      memcpy(&key[sizeof(void*) * (1 + i)], &p, sizeof(void*));
    }
    WGPUBindGroup group;
    auto found = ctx->bind_groups.find(key);
    if (found != ctx->bind_groups.end()) {
      group = found->second;
    } else {
      std::vector<WGPUBindGroupEntry> entries(bufs.size() + 1);
      for (size_t i = 0; i < bufs.size(); ++i) {
        entries[i] = WGPU_BIND_GROUP_ENTRY_INIT;
        entries[i].binding = static_cast<uint32_t>(i);
        entries[i].buffer = bufs[i];
        entries[i].offset = 0;
        uint64_t size = wgpuBufferGetSize(bufs[i]);
        if (size > ctx->limits.maxStorageBufferBindingSize) {
          LLMCHAT_FAIL("kernel " << k->name << ": a buffer of " << size
                                 << " bytes is larger than this adapter can bind ("
                                 << ctx->limits.maxStorageBufferBindingSize << " bytes)");
        }
        entries[i].size = size;
      }
      WGPUBindGroupEntry& ue = entries[bufs.size()];
      ue = WGPU_BIND_GROUP_ENTRY_INIT;
      ue.binding = static_cast<uint32_t>(bufs.size());
      ue.buffer = ctx->uniform;
      ue.offset = 0;
      ue.size = round_up(k->pod_bytes, 16);
      WGPUBindGroupDescriptor bgd = {};
      bgd.layout = k->layout;
      bgd.entryCount = entries.size();
      bgd.entries = entries.data();
      group = wgpuDeviceCreateBindGroup(ctx->device, &bgd);
      if (!ctx->errors.empty()) check(ctx, ("binding the buffers of kernel " + k->name).c_str());
      ctx->bind_groups.emplace(key, group);
      ctx->bind_group_misses++;
    }
    WGPUComputePassEncoder p = pass(ctx);
    wgpuComputePassEncoderSetPipeline(p, k->pipeline);
    wgpuComputePassEncoderSetBindGroup(p, 0, group, 1, &offset);
    wgpuComputePassEncoderDispatchWorkgroups(p, static_cast<uint32_t>(gx), static_cast<uint32_t>(work[1]),
                                             static_cast<uint32_t>(gz));
    if (ctx->profiling) {
      wgpuComputePassEncoderWriteTimestamp(p, ctx->queries, static_cast<uint32_t>(ctx->query_names.size()));
      ctx->query_names.push_back(k->name);
    }
    ctx->dispatches++;
    if (!ctx->repeat.empty() && !ctx->profiling && k->name.find(ctx->repeat) != std::string::npos) {
      wgpuComputePassEncoderDispatchWorkgroups(p, static_cast<uint32_t>(gx), static_cast<uint32_t>(work[1]),
                                               static_cast<uint32_t>(gz));
      ctx->dispatches++;
    }
    ctx->record_ns += now_ns() - t0;
    if (ctx->submit_every > 0 && ++ctx->since_submit >= ctx->submit_every) flush(ctx);
  }

  std::unordered_map<std::string, FunctionInfo> fmap_;
  std::unordered_map<std::string, std::string> smap_;
  std::unordered_map<std::string, std::unique_ptr<Kernel>> kernels_;
};

int WebGPUModule::current_device_ = 0;

// TVM's host code calls __tvm_set_device before its launches: the kernels run on that adapter.
void WebGPUDeviceAPI::SetDevice(Device dev) { WebGPUModule::current_device_ = dev.device_id; }

static ffi::Module load_from_bytes(const ffi::Bytes& bytes) {
  Reader r(bytes.data(), bytes.size(), "WebGPU: the library's WebGPU module");
  std::unordered_map<std::string, FunctionInfo> fmap = llmchat_native::read_function_table(r);
  std::unordered_map<std::string, std::string> smap;
  uint64_t ns = r.count(16);
  for (uint64_t i = 0; i < ns; ++i) {
    std::string key = r.str();
    smap.emplace(key, r.str());
  }
  return ffi::Module(ffi::make_object<WebGPUModule>(std::move(fmap), std::move(smap)));
}

static std::string stats_json(int index) {
  std::lock_guard<std::recursive_mutex> guard(lock());
  Context* ctx = get_context(index);
  std::ostringstream os;
  os << "{\"dispatches\":" << ctx->dispatches << ",\"submits\":" << ctx->submits << ",\"syncs\":" << ctx->syncs
     << ",\"readbacks\":" << ctx->readbacks << ",\"allocated_bytes\":" << ctx->allocated
     << ",\"peak_bytes\":" << ctx->peak << ",\"bind_groups\":" << ctx->bind_groups.size()
     << ",\"bind_group_misses\":" << ctx->bind_group_misses << ",\"record_ns\":" << ctx->record_ns
     << ",\"submit_ns\":" << ctx->submit_ns << ",\"wait_ns\":" << ctx->wait_ns << ",\"f16\":" << (ctx->f16 ? "true" : "false")
     << ",\"max_storage_buffer_binding_size\":" << ctx->limits.maxStorageBufferBindingSize
     << ",\"max_buffer_size\":" << ctx->limits.maxBufferSize
     << ",\"max_compute_workgroup_storage_size\":" << ctx->limits.maxComputeWorkgroupStorageSize
     << ",\"max_storage_buffers_per_shader_stage\":" << ctx->limits.maxStorageBuffersPerShaderStage << "}";
  return os.str();
}

static std::string profile_json(int index) {
  std::lock_guard<std::recursive_mutex> guard(lock());
  Context* ctx = get_context(index);
  std::vector<std::pair<std::string, Context::KernelTime>> rows(ctx->profile.begin(), ctx->profile.end());
  std::stable_sort(rows.begin(), rows.end(), [](const auto& x, const auto& y) { return x.second.ns > y.second.ns; });
  std::ostringstream os;
  os << "{\"enabled\":" << (ctx->profiling ? "true" : "false") << ",\"error\":\"" << json_escape(ctx->profile_error)
     << "\",\"total_ns\":" << static_cast<int64_t>(ctx->profile_total_ns) << ",\"kernels\":[";
  for (size_t i = 0; i < rows.size(); ++i) {
    os << (i ? "," : "") << "{\"name\":\"" << json_escape(rows[i].first) << "\",\"count\":" << rows[i].second.count
       << ",\"ns\":" << static_cast<int64_t>(rows[i].second.ns) << "}";
  }
  os << "]}";
  return os.str();
}

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("ffi.Module.load_from_bytes.webgpu", load_from_bytes)
      .def_packed("device_api.webgpu",
                  [](ffi::PackedArgs, ffi::Any* rv) { *rv = static_cast<void*>(WebGPUDeviceAPI::Global()); })
      .def("llmchat.webgpu.version", []() -> int64_t { return kVersion; })
      .def("llmchat.webgpu.adapters", []() -> ffi::String {
        std::lock_guard<std::recursive_mutex> guard(lock());
        return ffi::String(adapters_json());
      })
      .def("llmchat.webgpu.stats", [](int64_t index) -> ffi::String { return ffi::String(stats_json(index)); })
      .def("llmchat.webgpu.profile", [](int64_t index) -> ffi::String { return ffi::String(profile_json(index)); })
      .def("llmchat.webgpu.profile_reset",
           [](int64_t index) {
             std::lock_guard<std::recursive_mutex> guard(lock());
             Context* ctx = get_context(static_cast<int>(index));
             wait_idle(ctx);
             ctx->profile.clear();
             ctx->profile_total_ns = 0;
           })
      .def("llmchat.webgpu.set_device", [](int64_t index) {
        std::lock_guard<std::recursive_mutex> guard(lock());
        get_context(static_cast<int>(index));
        WebGPUModule::current_device_ = static_cast<int>(index);
      })
      .def("llmchat.webgpu.readback_start",
           [](int64_t index, int64_t slot, int64_t buffer, int64_t nbytes) {
             std::lock_guard<std::recursive_mutex> guard(lock());
             readback_start(get_context(static_cast<int>(index)), static_cast<int>(slot),
                            as_buffer(reinterpret_cast<void*>(static_cast<intptr_t>(buffer))),
                            static_cast<size_t>(nbytes));
           })
      .def("llmchat.webgpu.readback_wait",
           [](int64_t index, int64_t slot) -> ffi::Bytes {
             std::lock_guard<std::recursive_mutex> guard(lock());
             return ffi::Bytes(readback_wait(get_context(static_cast<int>(index)), static_cast<int>(slot)));
           })
      .def("llmchat.webgpu.record_qkv",
           [](ffi::TensorView t) -> int64_t {
             std::lock_guard<std::recursive_mutex> guard(lock());
             get_context(t.device().device_id)->recorded = as_buffer(t.data_ptr());
             return 0;
           })
      .def("llmchat.webgpu.substitute_next",
           [](ffi::TensorView t, int64_t arg) -> int64_t {
             std::lock_guard<std::recursive_mutex> guard(lock());
             get_context(t.device().device_id)->substitute = static_cast<int>(arg);
             return 0;
           })
      .def("llmchat.webgpu.sync", [](int64_t index) {
        std::lock_guard<std::recursive_mutex> guard(lock());
        wait_idle(get_context(static_cast<int>(index)));
      });
}

}  // namespace llmchat_webgpu
