// XLA FFI custom calls that launch compiled kernels (cubins that Triton built from Pallas
// kernels' IR, pallas_kernels/pdl_launch.py) on XLA's stream with the programmatic stream
// serialization attribute (PDL) on or off: one kernel (Launch), several in order
// (Sequence), or several recorded once into a CUDA graph of our own and replayed
// (SequenceGraph), where a PDL launch becomes a programmatic edge; and one kernel on a
// stream of our own, beside XLA's (SideLaunch).
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
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Driver {
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*module_load_data)(CUmodule*, const void*) = nullptr;
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*module_unload)(CUmodule) = nullptr;
  CUresult (*func_set_attribute)(CUfunction, CUfunction_attribute, int) = nullptr;
  CUresult (*launch_kernel_ex)(const CUlaunchConfig*, CUfunction, void**, void**) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  // stream capture into a CUDA graph (SequenceGraph); optional: checked where used
  CUresult (*stream_create)(CUstream*, unsigned int) = nullptr;
  CUresult (*begin_capture)(CUstream, CUstreamCaptureMode) = nullptr;
  CUresult (*end_capture)(CUstream, CUgraph*) = nullptr;
  CUresult (*graph_instantiate)(CUgraphExec*, CUgraph, unsigned long long) = nullptr;
  CUresult (*graph_launch)(CUgraphExec, CUstream) = nullptr;
  CUresult (*graph_destroy)(CUgraph) = nullptr;
  CUresult (*graph_exec_destroy)(CUgraphExec) = nullptr;
  // a launch on a stream of our own (SideLaunch); optional: checked where used
  CUresult (*event_create)(CUevent*, unsigned int) = nullptr;
  CUresult (*event_destroy)(CUevent) = nullptr;
  CUresult (*event_record)(CUevent, CUstream) = nullptr;
  CUresult (*stream_wait_event)(CUstream, CUevent, unsigned int) = nullptr;
  CUresult (*stream_synchronize)(CUstream) = nullptr;
  CUresult (*is_capturing)(CUstream, CUstreamCaptureStatus*) = nullptr;
  CUresult (*mem_alloc)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*mem_free)(CUdeviceptr) = nullptr;
  CUresult (*copy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*memset_async)(CUdeviceptr, unsigned char, size_t, CUstream) = nullptr;
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
    // each entry point by name, cast to its member's type (null if the driver lacks it)
    auto bind = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    };
    bind(d.ctx_get_current, "cuCtxGetCurrent");
    bind(d.module_load_data, "cuModuleLoadData");
    bind(d.module_get_function, "cuModuleGetFunction");
    bind(d.module_unload, "cuModuleUnload");
    bind(d.func_set_attribute, "cuFuncSetAttribute");
    bind(d.launch_kernel_ex, "cuLaunchKernelEx");
    bind(d.get_error_string, "cuGetErrorString");
    bind(d.stream_create, "cuStreamCreate");
    bind(d.begin_capture, "cuStreamBeginCapture_v2");
    bind(d.end_capture, "cuStreamEndCapture");
    bind(d.graph_instantiate, "cuGraphInstantiateWithFlags");
    bind(d.graph_launch, "cuGraphLaunch");
    bind(d.graph_destroy, "cuGraphDestroy");
    bind(d.graph_exec_destroy, "cuGraphExecDestroy");
    bind(d.event_create, "cuEventCreate");
    bind(d.event_destroy, "cuEventDestroy_v2");
    bind(d.event_record, "cuEventRecord");
    bind(d.stream_wait_event, "cuStreamWaitEvent");
    bind(d.stream_synchronize, "cuStreamSynchronize");
    bind(d.is_capturing, "cuStreamIsCapturing");
    bind(d.mem_alloc, "cuMemAlloc_v2");
    bind(d.mem_free, "cuMemFree_v2");
    bind(d.copy_async, "cuMemcpyDtoDAsync_v2");
    bind(d.memset_async, "cuMemsetD8Async");
    if (!d.ctx_get_current || !d.module_load_data || !d.module_get_function || !d.module_unload ||
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
struct Loaded {
  CUfunction fn;
  int64_t n_params;  // the kernel's parameter count, as registered
};
std::map<std::pair<CUcontext, int64_t>, Loaded> cache;
// Kernel images by id, registered from Python (OuroPdlRegister) before any program that
// launches them runs: the FFI call then carries only small attributes (XLA copies a call's
// attributes into its call frame on every launch).
struct Image {
  std::string bytes;
  std::string name;
  int64_t n_params;
};
std::map<int64_t, Image> images;
// (A context destroyed and another created at the same address would find a stale entry;
// XLA keeps its contexts for the process's life.)
thread_local std::map<std::pair<CUcontext, int64_t>, Loaded> local_cache;
constexpr size_t kMaxParams = 64;    // one kernel's parameters
constexpr size_t kMaxBuffers = 2048;  // one sequence call's operands and results
constexpr int64_t kMaxKernels = 1024;  // one sequence call's kernels

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

// The loaded function of a registered kernel in the current context, and its parameter
// count.
ffi::Error lookup(int64_t kernel_id, int64_t shared, Loaded* out) {
  const Driver& d = driver();
  if (!d.error.empty()) return ffi::Error(ffi::ErrorCode::kInternal, d.error);
  CUcontext ctx = nullptr;
  if (CUresult r = d.ctx_get_current(&ctx); r != CUDA_SUCCESS) return cuda_error("context", r);
  if (auto hit = local_cache.find({ctx, kernel_id}); hit != local_cache.end()) {
    *out = hit->second;
    return ffi::Error::Success();
  }
  std::lock_guard<std::mutex> lock(cache_mu);
  auto it = cache.find({ctx, kernel_id});
  if (it == cache.end()) {
    auto img = images.find(kernel_id);
    if (img == images.end())
      return ffi::Error(ffi::ErrorCode::kNotFound,
                        "ouro_pdl_launch: kernel " + std::to_string(kernel_id) +
                            " was never registered (pdl_launch.call registers it)");
    CUmodule mod = nullptr;
    if (CUresult r = d.module_load_data(&mod, img->second.bytes.data()); r != CUDA_SUCCESS)
      return cuda_error("cuModuleLoadData", r);
    CUfunction fn = nullptr;
    CUresult r = d.module_get_function(&fn, mod, img->second.name.c_str());
    if (r == CUDA_SUCCESS && shared > 48 * 1024)
      r = d.func_set_attribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                               static_cast<int>(shared));
    if (r != CUDA_SUCCESS) {
      d.module_unload(mod);
      return cuda_error("loading the kernel", r);
    }
    it = cache.emplace(std::make_pair(ctx, kernel_id), Loaded{fn, img->second.n_params}).first;
  }
  local_cache[{ctx, kernel_id}] = it->second;
  *out = it->second;
  return ffi::Error::Success();
}

ffi::Error launch(CUstream stream, CUfunction fn, const int64_t grid[3], int64_t threads,
                  int64_t shared, bool pdl, void** params) {
  CUlaunchAttribute attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.gridDimX = static_cast<unsigned>(grid[0]);
  cfg.gridDimY = static_cast<unsigned>(grid[1]);
  cfg.gridDimZ = static_cast<unsigned>(grid[2]);
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
                   size_t* n, size_t capacity = kMaxParams) {
  size_t at = 0;
  if (args.size() + rets.size() > capacity)
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
  Loaded k;
  if (ffi::Error e = lookup(kernel_id, shared, &k); e.failure()) return e;
  // The kernel's parameters: every operand's and result's device pointer in order, then
  // `extra_params` null pointers (the scratch pointers Triton appends to its kernels).
  void* ptrs[kMaxParams];
  void* params[kMaxParams];
  size_t n = 0;
  if (ffi::Error e = buffers(args, rets, ptrs, &n); e.failure()) return e;
  if (extra_params < 0 || n + static_cast<size_t>(extra_params) > kMaxParams)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "ouro_pdl_launch: too many kernel parameters");
  if (static_cast<int64_t>(n) + extra_params != k.n_params)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "ouro_pdl_launch: " + std::to_string(n) + " buffers and " +
                          std::to_string(extra_params) + " extra parameters for a kernel of " +
                          std::to_string(k.n_params) + " parameters");
  while (extra_params-- > 0) ptrs[n++] = nullptr;
  for (size_t i = 0; i < n; ++i) params[i] = &ptrs[i];
  const int64_t grid3[3] = {grid, 1, 1};
  return launch(stream, k.fn, grid3, threads, shared, pdl, params);
}

#include "pdl_launch_side.inc"  // SideLaunch

// A plan for Sequence: [count, then per kernel: id, grid x, grid y, grid z, threads, shared,
// pdl, n_params, then n_params buffer indices (operands first, then results; -1: a null
// pointer)], with nbuf buffers. Returns an empty string if well formed, else what is wrong.
constexpr size_t kHeader = 8;
std::string check_plan(const int64_t* plan, size_t size, int64_t nbuf) {
  if (size < 1 || plan[0] < 0) return "no kernel count";
  size_t at = 1;
  for (int64_t k = 0; k < plan[0]; ++k) {
    if (at + kHeader > size) return "kernel " + std::to_string(k) + ": plan ends in its header";
    int64_t gx = plan[at + 1], gy = plan[at + 2], gz = plan[at + 3];
    int64_t threads = plan[at + 4], shared = plan[at + 5], np = plan[at + 7];
    if (gx < 1 || gy < 1 || gz < 1 || gx > 2147483647 || gy > 65535 || gz > 65535 ||
        threads < 1 || threads > 1024 || shared < 0)
      return "kernel " + std::to_string(k) + ": bad launch shape";
    if (np < 0 || np > static_cast<int64_t>(kMaxParams) || at + kHeader + np > size)
      return "kernel " + std::to_string(k) + ": bad parameter count";
    at += kHeader;
    for (int64_t i = 0; i < np; ++i)
      if (plan[at + i] < -1 || plan[at + i] >= nbuf)
        return "kernel " + std::to_string(k) + ": buffer index out of range";
    at += np;
  }
  if (at != size) return "trailing elements after the last kernel";
  return "";
}

// One kernel launch of a sequence: its function, shape, PDL flag and parameters.
struct Step {
  CUfunction fn;
  int64_t grid[3], threads, shared;
  bool pdl;
  std::vector<void*> ptrs;
};

// The plan checked (check_plan's layout), every kernel found and its parameter count checked
// against its registered one, and each kernel's parameters picked from the call's buffers;
// nothing is launched if anything is wrong.
ffi::Error prepare(const char* who, ffi::Span<const int64_t> plan, void* const* bufs,
                   size_t nbuf, std::vector<Step>* steps) {
  if (std::string why = check_plan(plan.begin(), plan.size(), static_cast<int64_t>(nbuf));
      !why.empty())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(who) + ": " + why);
  if (plan[0] > kMaxKernels)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(who) + ": too many kernels");
  steps->clear();
  steps->reserve(plan[0]);
  size_t at = 1;
  for (int64_t k = 0; k < plan[0]; ++k) {
    Loaded loaded;
    if (ffi::Error e = lookup(plan[at], plan[at + 5], &loaded); e.failure()) return e;
    int64_t np = plan[at + 7];
    if (loaded.n_params != np)
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        std::string(who) + ": kernel " + std::to_string(k) + " takes " +
                            std::to_string(loaded.n_params) + " parameters, the plan gives " +
                            std::to_string(np));
    Step st{loaded.fn, {plan[at + 1], plan[at + 2], plan[at + 3]}, plan[at + 4], plan[at + 5],
            plan[at + 6] != 0, {}};
    at += kHeader;
    for (int64_t i = 0; i < np; ++i)
      st.ptrs.push_back(plan[at + i] < 0 ? nullptr : bufs[plan[at + i]]);
    at += np;
    steps->push_back(std::move(st));
  }
  return ffi::Error::Success();
}

// A sequence call's operand and result pointers (up to kMaxBuffers of them).
ffi::Error sequence_buffers(ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                            std::vector<void*>* bufs) {
  bufs->resize(kMaxBuffers);
  size_t n = 0;
  if (ffi::Error e = buffers(args, rets, bufs->data(), &n, kMaxBuffers); e.failure()) return e;
  bufs->resize(n);
  return ffi::Error::Success();
}

ffi::Error launch_steps(CUstream stream, std::vector<Step>& steps) {
  for (Step& st : steps) {
    void* params[kMaxParams];
    for (size_t i = 0; i < st.ptrs.size(); ++i) params[i] = &st.ptrs[i];
    if (ffi::Error e = launch(stream, st.fn, st.grid, st.threads, st.shared, st.pdl, params);
        e.failure())
      return e;
  }
  return ffi::Error::Success();
}

// Several kernels in one custom call, in order, each with its own parameters picked from the
// call's buffers (check_plan's layout). The whole plan, and every kernel's parameter count
// against its registered one, is checked before the first launch. One call per layer instead
// of one per kernel keeps the host's calls few.
ffi::Error Sequence(CUstream stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                    ffi::Span<const int64_t> plan) {
  Timed timed;
  std::vector<void*> bufs;
  if (ffi::Error e = sequence_buffers(args, rets, &bufs); e.failure()) return e;
  std::vector<Step> steps;
  if (ffi::Error e = prepare("ouro_pdl_sequence", plan, bufs.data(), bufs.size(), &steps);
      e.failure())
    return e;
  return launch_steps(stream, steps);
}

#include "pdl_launch_graph.inc"  // SequenceGraph

}  // namespace

namespace {
// Copies the counters into out in order, and with reset != 0 sets them to zero.
void read_counters(std::initializer_list<std::atomic<int64_t>*> counters, int64_t* out,
                   int reset) {
  for (std::atomic<int64_t>* c : counters) {
    *out++ = *c;
    if (reset) *c = 0;
  }
}
}  // namespace

// Stores a kernel image (cubin), its entry name and parameter count under `kernel_id`; 0 on
// success, 1 if the id already holds another kernel, 2 for a bad parameter count.
extern "C" int OuroPdlRegister(int64_t kernel_id, const char* image, int64_t size,
                               const char* name, int64_t n_params) {
  if (n_params < 0 || n_params > static_cast<int64_t>(kMaxParams)) return 2;
  std::lock_guard<std::mutex> lock(cache_mu);
  std::string bytes(image, static_cast<size_t>(size));
  auto it = images.find(kernel_id);
  if (it != images.end())
    return it->second.bytes == bytes && it->second.name == name &&
                   it->second.n_params == n_params
               ? 0
               : 1;
  images[kernel_id] = Image{std::move(bytes), name, n_params};
  return 0;
}

// Graphs recorded and replayed by SequenceGraph, and how often the full cache was dropped
// (out[0..2]); reset != 0 clears them.
extern "C" void OuroPdlGraphStats(int64_t* out, int reset) {
  read_counters({&stat_graph_recorded, &stat_graph_replayed, &stat_graph_dropped}, out, reset);
}

// check_plan for tests: 0 if the plan is well formed for nbuf buffers, else 1.
extern "C" int OuroPdlCheckPlan(const int64_t* plan, int64_t size, int64_t nbuf) {
  return check_plan(plan, static_cast<size_t>(size), nbuf).empty() ? 0 : 1;
}

// Reads (and with reset != 0 clears) the host-side timing: out[0..3] = calls, ns in the
// handlers, ns in cuLaunchKernelEx, ns from one call's entry to the next's.
extern "C" void OuroPdlStats(int64_t* out, int reset) {
  read_counters({&stat_calls, &stat_ns_handler, &stat_ns_launch, &stat_ns_between}, out, reset);
  if (reset) stat_last_entry = 0;
}

namespace {
// One kernel's binding: XLA's stream, the buffers, and the kernel's launch shape.
auto KernelBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<CUstream>>()
      .RemainingArgs()
      .RemainingRets()
      .Attr<int64_t>("kernel_id")
      .Attr<int64_t>("grid")
      .Attr<int64_t>("threads")
      .Attr<int64_t>("shared")
      .Attr<int64_t>("extra_params");
}
// Launch's: the same and the PDL switch.
auto LaunchBinding() { return KernelBinding().Attr<bool>("pdl"); }
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OuroPdlLaunch, Launch, LaunchBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OuroSideLaunch, SideLaunch,
                              KernelBinding().Attr<int64_t>("static_args"));

// Waits until every side stream has run what was launched on it (between benchmark arms:
// a lagging side kernel must not run into the next arm's timing); 0 on success.
extern "C" int OuroSideSync() {
  const Driver& d = driver();
  if (!d.error.empty() || !d.stream_synchronize) return 1;
  std::lock_guard<std::mutex> lock(side_mu);
  for (auto& s : side_streams)
    if (s.second.first && d.stream_synchronize(s.second.first) != CUDA_SUCCESS) return 1;
  return 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OuroPdlSequence, Sequence,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("plan"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OuroPdlSequenceGraph, SequenceGraph,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("plan"));

// The same handler, marked safe for XLA to record into a command buffer (a CUDA graph, by
// stream capture): XLA then replays the launches with the graph instead of calling us each
// time. Whether the PDL attribute survives as a programmatic edge there is what
// benchmarks.pdl_jax_chain measures.
XLA_FFI_DEFINE_HANDLER_SYMBOL(OuroPdlLaunchGraph, Launch, LaunchBinding(),
                              {ffi::Traits::kCmdBufferCompatible});
