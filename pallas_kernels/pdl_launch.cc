// An XLA FFI custom call that launches one compiled kernel (a cubin that Triton built from a
// Pallas kernel's IR, pallas_kernels/pdl_launch.py) on XLA's stream with the programmatic
// stream serialization attribute (PDL) on or off.
//
// Why: XLA launches the kernels it compiles with PDL and puts `griddepcontrol.wait` at every
// kernel's start, so a Pallas kernel cannot request its weights before the kernel ahead of it
// ends. Launched from here, the kernel places its own wait (after its first weight loads) and
// its own trigger. The CUDA driver is opened with dlopen, so building this needs only cuda.h
// and jaxlib's FFI headers, and loading it needs only the driver.
#include <dlfcn.h>

#include <atomic>
#include <chrono>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include <cuda.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Driver {
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*module_load_data)(CUmodule*, const void*) = nullptr;
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*func_set_attribute)(CUfunction, CUfunction_attribute, int) = nullptr;
  CUresult (*launch_kernel_ex)(const CUlaunchConfig*, CUfunction, void**, void**) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  std::string error;
};

const Driver& driver() {
  static Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d.error = std::string("dlopen(libcuda.so.1) failed: ") + dlerror();
      return d;
    }
    auto sym = [&](const char* name) { return dlsym(lib, name); };
    d.ctx_get_current = reinterpret_cast<decltype(d.ctx_get_current)>(sym("cuCtxGetCurrent"));
    d.module_load_data = reinterpret_cast<decltype(d.module_load_data)>(sym("cuModuleLoadData"));
    d.module_get_function =
        reinterpret_cast<decltype(d.module_get_function)>(sym("cuModuleGetFunction"));
    d.func_set_attribute =
        reinterpret_cast<decltype(d.func_set_attribute)>(sym("cuFuncSetAttribute"));
    d.launch_kernel_ex = reinterpret_cast<decltype(d.launch_kernel_ex)>(sym("cuLaunchKernelEx"));
    d.get_error_string = reinterpret_cast<decltype(d.get_error_string)>(sym("cuGetErrorString"));
    if (!d.ctx_get_current || !d.module_load_data || !d.module_get_function ||
        !d.func_set_attribute || !d.launch_kernel_ex || !d.get_error_string) {
      d.error = "libcuda.so.1 lacks a driver entry point this launcher needs";
    }
    return d;
  }();
  return d;
}

ffi::Error cuda_error(const char* what, CUresult r) {
  const char* msg = "unknown";
  driver().get_error_string(r, &msg);
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("ouro_pdl_launch: ") + what + ": " + msg);
}

// One loaded function per (context, kernel id): the module is loaded on first use in each
// context and kept for the process's life, like XLA's own kernels. Each launching thread
// keeps its own lookup table (no lock on the launch path); the shared one, under a lock, is
// only read when a thread first meets a kernel.
std::mutex cache_mu;
std::map<std::pair<CUcontext, int64_t>, CUfunction> cache;
// Kernel images by id, registered from Python (OuroPdlRegister) before any program that
// launches them runs: the FFI call then carries only small attributes (XLA copies a call's
// attributes into its call frame on every launch).
struct Image {
  std::string bytes;
  std::string name;
};
std::map<int64_t, Image> images;
thread_local std::map<std::pair<CUcontext, int64_t>, CUfunction> local_cache;
constexpr size_t kMaxParams = 64;

// Host-side timing of the handlers (OuroPdlStats): calls, nanoseconds inside them, inside
// cuLaunchKernelEx, and from one call's entry to the next's (the host's cadence).
std::atomic<int64_t> stat_calls{0}, stat_ns_handler{0}, stat_ns_launch{0}, stat_ns_between{0},
    stat_last_entry{0};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Timed {  // counts a handler call and its time
  int64_t start = now_ns();
  Timed() {
    int64_t last = stat_last_entry.exchange(start);
    if (last) stat_ns_between += start - last;
    ++stat_calls;
  }
  ~Timed() { stat_ns_handler += now_ns() - start; }
};

// The loaded function of a registered kernel in the current context.
ffi::Error lookup(int64_t kernel_id, int64_t shared, CUfunction* out) {
  const Driver& d = driver();
  if (!d.error.empty()) return ffi::Error(ffi::ErrorCode::kInternal, d.error);
  CUcontext ctx = nullptr;
  if (CUresult r = d.ctx_get_current(&ctx); r != CUDA_SUCCESS) return cuda_error("context", r);
  CUfunction fn = nullptr;
  if (auto hit = local_cache.find({ctx, kernel_id}); hit != local_cache.end()) {
    fn = hit->second;
  } else {
    std::lock_guard<std::mutex> lock(cache_mu);
    auto it = cache.find({ctx, kernel_id});
    if (it != cache.end()) {
      fn = it->second;
    } else {
      auto img = images.find(kernel_id);
      if (img == images.end())
        return ffi::Error(ffi::ErrorCode::kNotFound,
                          "ouro_pdl_launch: kernel " + std::to_string(kernel_id) +
                              " was never registered (pdl_launch.call registers it)");
      CUmodule mod = nullptr;
      if (CUresult r = d.module_load_data(&mod, img->second.bytes.data()); r != CUDA_SUCCESS)
        return cuda_error("cuModuleLoadData", r);
      if (CUresult r = d.module_get_function(&fn, mod, img->second.name.c_str());
          r != CUDA_SUCCESS)
        return cuda_error("cuModuleGetFunction", r);
      if (shared > 48 * 1024) {
        CUresult r = d.func_set_attribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                          static_cast<int>(shared));
        if (r != CUDA_SUCCESS) return cuda_error("shared memory size", r);
      }
      cache[{ctx, kernel_id}] = fn;
    }
    local_cache[{ctx, kernel_id}] = fn;
  }
  *out = fn;
  return ffi::Error::Success();
}

ffi::Error launch(CUstream stream, CUfunction fn, int64_t grid, int64_t threads,
                  int64_t shared, bool pdl, void** params) {
  CUlaunchAttribute attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.gridDimX = static_cast<unsigned>(grid);
  cfg.gridDimY = 1;
  cfg.gridDimZ = 1;
  cfg.blockDimX = static_cast<unsigned>(threads);
  cfg.blockDimY = 1;
  cfg.blockDimZ = 1;
  cfg.sharedMemBytes = static_cast<unsigned>(shared);
  cfg.hStream = stream;
  cfg.attrs = pdl ? &attr : nullptr;
  cfg.numAttrs = pdl ? 1 : 0;
  int64_t t0 = now_ns();
  CUresult r = driver().launch_kernel_ex(&cfg, fn, params, nullptr);
  stat_ns_launch += now_ns() - t0;
  if (r != CUDA_SUCCESS) return cuda_error("cuLaunchKernelEx", r);
  return ffi::Error::Success();
}

// Every operand's then every result's device pointer, in order (n of them at most kMax).
ffi::Error buffers(ffi::RemainingArgs& args, ffi::RemainingRets& rets, void** ptrs,
                   size_t* n) {
  size_t at = 0;
  if (args.size() + rets.size() > kMaxParams)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "ouro_pdl_launch: too many buffers");
  for (size_t i = 0; i < args.size(); ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i);
    if (!buf.has_value()) return buf.error();
    ptrs[at++] = buf->untyped_data();
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buf = rets.get<ffi::AnyBuffer>(i);
    if (!buf.has_value()) return buf.error();
    ptrs[at++] = (*buf)->untyped_data();
  }
  *n = at;
  return ffi::Error::Success();
}

ffi::Error Launch(CUstream stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  int64_t kernel_id, int64_t grid, int64_t threads, int64_t shared,
                  int64_t extra_params, bool pdl) {
  Timed timed;
  CUfunction fn = nullptr;
  if (ffi::Error e = lookup(kernel_id, shared, &fn); e.failure()) return e;
  // The kernel's parameters: every operand's and result's device pointer in order, then
  // `extra_params` null pointers (the scratch pointers Triton appends to its kernels).
  void* ptrs[kMaxParams];
  void* params[kMaxParams];
  size_t n = 0;
  if (ffi::Error e = buffers(args, rets, ptrs, &n); e.failure()) return e;
  if (extra_params < 0 || n + static_cast<size_t>(extra_params) > kMaxParams)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "ouro_pdl_launch: too many kernel parameters");
  while (n < kMaxParams && extra_params-- > 0) ptrs[n++] = nullptr;
  for (size_t i = 0; i < n; ++i) params[i] = &ptrs[i];
  return launch(stream, fn, grid, threads, shared, pdl, params);
}

// Several kernels in one custom call, in order, each with its own parameters picked from the
// call's buffers: plan = [count, then per kernel: id, grid, threads, shared, pdl, n_params,
// then n_params buffer indices (operands first, then results; -1: a null pointer)]. One
// call per layer instead of one per kernel keeps the host ahead of the GPU.
ffi::Error Sequence(CUstream stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                    ffi::Span<const int64_t> plan) {
  Timed timed;
  void* bufs[kMaxParams];
  size_t nbuf = 0;
  if (ffi::Error e = buffers(args, rets, bufs, &nbuf); e.failure()) return e;
  auto bad = [] {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "ouro_pdl_sequence: malformed plan");
  };
  if (plan.size() < 1) return bad();
  size_t at = 1;
  for (int64_t k = 0; k < plan[0]; ++k) {
    if (at + 6 > plan.size()) return bad();
    int64_t id = plan[at], grid = plan[at + 1], threads = plan[at + 2], shared = plan[at + 3];
    bool pdl = plan[at + 4] != 0;
    int64_t np = plan[at + 5];
    at += 6;
    if (np < 0 || np > static_cast<int64_t>(kMaxParams) || at + np > plan.size()) return bad();
    void* ptrs[kMaxParams];
    void* params[kMaxParams];
    for (int64_t i = 0; i < np; ++i) {
      int64_t b = plan[at + i];
      if (b >= static_cast<int64_t>(nbuf) || b < -1) return bad();
      ptrs[i] = b < 0 ? nullptr : bufs[b];
      params[i] = &ptrs[i];
    }
    at += np;
    CUfunction fn = nullptr;
    if (ffi::Error e = lookup(id, shared, &fn); e.failure()) return e;
    if (ffi::Error e = launch(stream, fn, grid, threads, shared, pdl, params); e.failure())
      return e;
  }
  return ffi::Error::Success();
}

}  // namespace

// Stores a kernel image (cubin) and its entry name under `kernel_id`; 0 on success, 1 if the
// id already holds another image.
extern "C" int OuroPdlRegister(int64_t kernel_id, const char* image, int64_t size,
                               const char* name) {
  std::lock_guard<std::mutex> lock(cache_mu);
  std::string bytes(image, static_cast<size_t>(size));
  auto it = images.find(kernel_id);
  if (it != images.end()) return it->second.bytes == bytes && it->second.name == name ? 0 : 1;
  images[kernel_id] = Image{std::move(bytes), name};
  return 0;
}

// Reads (and with reset != 0 clears) the host-side timing: out[0..3] = calls, ns in the
// handlers, ns in cuLaunchKernelEx, ns from one call's entry to the next's.
extern "C" void OuroPdlStats(int64_t* out, int reset) {
  out[0] = stat_calls;
  out[1] = stat_ns_handler;
  out[2] = stat_ns_launch;
  out[3] = stat_ns_between;
  if (reset) {
    stat_calls = 0;
    stat_ns_handler = 0;
    stat_ns_launch = 0;
    stat_ns_between = 0;
    stat_last_entry = 0;
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OuroPdlLaunch, Launch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("kernel_id")
                                  .Attr<int64_t>("grid")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("shared")
                                  .Attr<int64_t>("extra_params")
                                  .Attr<bool>("pdl"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OuroPdlSequence, Sequence,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("plan"));

// The same handler, marked safe for XLA to record into a command buffer (a CUDA graph, by
// stream capture): XLA then replays the launches with the graph instead of calling us each
// time. Whether the PDL attribute survives as a programmatic edge there is what
// benchmarks.pdl_jax_chain measures.
XLA_FFI_DEFINE_HANDLER_SYMBOL(OuroPdlLaunchGraph, Launch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("kernel_id")
                                  .Attr<int64_t>("grid")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("shared")
                                  .Attr<int64_t>("extra_params")
                                  .Attr<bool>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});
