// Guarded cuBLASLt GEMM plans for the FC2 path (and any other row-major y = x . w^T).
//
// Pure host C++: it calls cuBLASLt and the CUDA runtime API and never launches a kernel of its own,
// so it compiles with g++ against torch's headers plus the CUDA 13 headers (no nvcc), and it imports
// on a machine without a GPU (build_info() then reports the device error).
//
// Row-major mapping, y[M,N] = x[M,K] . w[N,K]^T (kernels-facts.md 1.2):
//   cuBLAS A = w, stored K x N (ld K), TRANSA = T    -> A_SCALE gets w's scales (tiles over N)
//   cuBLAS B = x, stored K x M (ld K), TRANSB = N    -> B_SCALE gets x's scales (tiles over M)
//   cuBLAS D = y, stored N x M (ld N)                -> cuBLAS m = N, n = M, k = K
// M here is always the descriptor (padded) row count; the caller slices the logical rows.
//
// Kinds:
//   nvfp4     A/B CUDA_R_4F_E2M1 with VEC16_UE4M3 block scales (swizzled 128x4 layout), D bf16
//   fp8_e4m3  A/B CUDA_R_8F_E4M3 with fp32 scales: "tensor" (SCALAR_32F) or "outer" (OUTER_VEC_32F)
//   bf16      A/B CUDA_R_16BF, no scales
// All accumulate in fp32 (CUBLAS_COMPUTE_32F, scale type CUDA_R_32F), no bias, no epilogue.
//
// A pinned plan = AlgoInit + every config attribute set + AlgoCheck for the exact shape and workspace
// limit + a read-back of every attribute. Split-K must be 1 and the reduction scheme NONE, both set and
// read back, because any other value changes the fp32 reduction order (bitwise stability).
// Plans must be built before CUDA-graph capture: AlgoCheck and the heuristic query may allocate.

// Only the tensor type and torch's pybind11 casters: <torch/extension.h> pulls in the whole C++
// frontend and quadruples the compile time (about 20 s instead of 80 s on two cores).
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

const char* status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}

std::string status_str(cublasStatus_t s) {
  return std::string(status_name(s)) + " (" + std::to_string(static_cast<int>(s)) + ")";
}

std::string cuda_err_str(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + std::to_string(static_cast<int>(e)) + "): " +
         cudaGetErrorString(e);
}

enum class Kind { kNvfp4, kFp8E4m3, kBf16 };
enum class PointerMode { kHost, kDevice };
enum class ScaleMode { kNone, kVec16Ue4m3, kTensor, kOuter };

Kind parse_kind(const std::string& s) {
  if (s == "nvfp4") return Kind::kNvfp4;
  if (s == "fp8_e4m3") return Kind::kFp8E4m3;
  if (s == "bf16") return Kind::kBf16;
  throw py::value_error("kind=" + s + ": expected nvfp4, fp8_e4m3 or bf16");
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kNvfp4: return "nvfp4";
    case Kind::kFp8E4m3: return "fp8_e4m3";
    default: return "bf16";
  }
}

PointerMode parse_pointer_mode(const std::string& s) {
  if (s == "host") return PointerMode::kHost;
  if (s == "device") return PointerMode::kDevice;
  throw py::value_error("pointer_mode=" + s + ": expected host or device");
}

ScaleMode parse_scale_mode(Kind kind, const std::string& s) {
  switch (kind) {
    case Kind::kNvfp4:
      if (s == "vec16_ue4m3" || s.empty()) return ScaleMode::kVec16Ue4m3;
      break;
    case Kind::kFp8E4m3:
      if (s == "tensor" || s.empty()) return ScaleMode::kTensor;
      if (s == "outer") return ScaleMode::kOuter;
      break;
    case Kind::kBf16:
      if (s == "none" || s.empty()) return ScaleMode::kNone;
      break;
  }
  throw py::value_error(std::string("scale_mode=") + s + " is not valid for kind " + kind_name(kind) +
                        " (nvfp4: vec16_ue4m3; fp8_e4m3: tensor | outer; bf16: none)");
}

const char* scale_mode_name(ScaleMode m) {
  switch (m) {
    case ScaleMode::kVec16Ue4m3: return "vec16_ue4m3";
    case ScaleMode::kTensor: return "tensor";
    case ScaleMode::kOuter: return "outer";
    default: return "none";
  }
}

struct TypeSet {
  cudaDataType_t a, b, c, d;
};

TypeSet types_for(Kind k) {
  switch (k) {
    case Kind::kNvfp4: return {CUDA_R_4F_E2M1, CUDA_R_4F_E2M1, CUDA_R_16BF, CUDA_R_16BF};
    case Kind::kFp8E4m3: return {CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF, CUDA_R_16BF};
    default: return {CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF};
  }
}

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Every algorithm configuration attribute, with the C type the header gives it.
struct AlgoConfig {
  int32_t id = -1;
  uint32_t tile = 0;
  uint32_t stages = 0;
  int32_t splitk = 1;
  uint32_t reduction = 0;
  uint32_t swizzle = 0;
  uint32_t custom = 0;
  uint16_t cluster = 0;
  uint16_t inner = 0;

  bool operator==(const AlgoConfig& o) const {
    return id == o.id && tile == o.tile && stages == o.stages && splitk == o.splitk &&
           reduction == o.reduction && swizzle == o.swizzle && custom == o.custom &&
           cluster == o.cluster && inner == o.inner;
  }
};

py::dict config_to_dict(const AlgoConfig& c) {
  py::dict d;
  d["id"] = c.id;
  d["tile"] = c.tile;
  d["stages"] = c.stages;
  d["splitk"] = c.splitk;
  d["reduction"] = c.reduction;
  d["swizzle"] = c.swizzle;
  d["custom"] = c.custom;
  d["cluster"] = c.cluster;
  d["inner_shape"] = c.inner;
  return d;
}

template <typename T>
T dict_get(const py::dict& d, const char* key, T dflt) {
  if (!d.contains(key)) return dflt;
  py::object v = d[key];
  if (v.is_none()) return dflt;
  return v.cast<T>();
}

AlgoConfig config_from_dict(const py::dict& d) {
  if (!d.contains("id")) throw py::value_error("algo config needs an 'id'");
  AlgoConfig c;
  c.id = dict_get<int32_t>(d, "id", -1);
  c.tile = dict_get<uint32_t>(d, "tile", 0);
  c.stages = dict_get<uint32_t>(d, "stages", 0);
  c.splitk = dict_get<int32_t>(d, "splitk", 1);
  c.reduction = dict_get<uint32_t>(d, "reduction", 0);
  c.swizzle = dict_get<uint32_t>(d, "swizzle", 0);
  c.custom = dict_get<uint32_t>(d, "custom", 0);
  c.cluster = dict_get<uint16_t>(d, "cluster", 0);
  c.inner = dict_get<uint16_t>(d, "inner_shape", 0);
  return c;
}

template <typename T>
cublasStatus_t get_cfg(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t a, T* out) {
  size_t written = 0;
  cublasStatus_t s = cublasLtMatmulAlgoConfigGetAttribute(&algo, a, out, sizeof(T), &written);
  if (s == CUBLAS_STATUS_SUCCESS && written != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
  return s;
}

template <typename T>
cublasStatus_t set_cfg(cublasLtMatmulAlgo_t* algo, cublasLtMatmulAlgoConfigAttributes_t a, T v) {
  return cublasLtMatmulAlgoConfigSetAttribute(algo, a, &v, sizeof(T));
}

// Reads every attribute back; on failure names the attribute.
bool read_config(const cublasLtMatmulAlgo_t& algo, AlgoConfig* c, std::string* err) {
  struct Item {
    const char* name;
    cublasStatus_t s;
  };
  Item items[] = {
      {"ID", get_cfg(algo, CUBLASLT_ALGO_CONFIG_ID, &c->id)},
      {"TILE_ID", get_cfg(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &c->tile)},
      {"STAGES_ID", get_cfg(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &c->stages)},
      {"SPLITK_NUM", get_cfg(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &c->splitk)},
      {"REDUCTION_SCHEME", get_cfg(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &c->reduction)},
      {"CTA_SWIZZLING", get_cfg(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &c->swizzle)},
      {"CUSTOM_OPTION", get_cfg(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &c->custom)},
      {"CLUSTER_SHAPE_ID", get_cfg(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &c->cluster)},
      {"INNER_SHAPE_ID", get_cfg(algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &c->inner)},
  };
  for (const Item& it : items) {
    if (it.s != CUBLAS_STATUS_SUCCESS) {
      *err = std::string("cublasLtMatmulAlgoConfigGetAttribute(") + it.name + ") returned " + status_str(it.s);
      return false;
    }
  }
  return true;
}

template <typename T>
bool get_cap(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t a, T* out) {
  size_t written = 0;
  return cublasLtMatmulAlgoCapGetAttribute(&algo, a, out, sizeof(T), &written) == CUBLAS_STATUS_SUCCESS &&
         written == sizeof(T);
}

std::vector<uint32_t> get_cap_array(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t a) {
  size_t bytes = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, a, nullptr, 0, &bytes) != CUBLAS_STATUS_SUCCESS || bytes == 0)
    return {};
  std::vector<uint32_t> v(bytes / sizeof(uint32_t));
  size_t written = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, a, v.data(), v.size() * sizeof(uint32_t), &written) !=
      CUBLAS_STATUS_SUCCESS)
    return {};
  v.resize(written / sizeof(uint32_t));
  return v;
}

// H3_FC2_LT_TRACE=1 prints the cublasLtMatmul arguments of the first 64 run() calls to stderr (flushed)
// before the call, so a crash inside cuBLASLt leaves the last arguments in the log.
bool trace_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("H3_FC2_LT_TRACE");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }();
  return on;
}

// "host", "device", "managed" or "unregistered" (trace only).
const char* pointer_kind(const void* ptr) {
  cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
    cudaGetLastError();
    return "unknown";
  }
  switch (a.type) {
    case cudaMemoryTypeDevice: return "device";
    case cudaMemoryTypeManaged: return "managed";
    case cudaMemoryTypeHost: return "host";
    default: return "unregistered-host";
  }
}

std::string library_path(const void* symbol) {
  Dl_info info;
  if (dladdr(symbol, &info) != 0 && info.dli_fname != nullptr) return info.dli_fname;
  return "";
}

// The shared descriptors of one GEMM problem: handle, operation descriptor, four layouts, and a small
// device scratch (alpha = 1, beta = 0, a zeroed dummy for scale pointers at plan time).
class Problem {
 public:
  Problem(const std::string& kind, int64_t m, int64_t n, int64_t k, const std::string& pointer_mode,
          const std::string& scale_mode)
      : kind_(parse_kind(kind)),
        m_(m),
        n_(n),
        k_(k),
        pmode_(parse_pointer_mode(pointer_mode)),
        smode_(parse_scale_mode(kind_, scale_mode)),
        types_(types_for(kind_)) {
    if (m <= 0 || n <= 0 || k <= 0)
      throw py::value_error("GEMM dims must be positive, got m=" + std::to_string(m) + " n=" + std::to_string(n) +
                            " k=" + std::to_string(k));
    if (kind_ == Kind::kNvfp4 && k % 32 != 0)
      throw py::value_error("nvfp4 needs K % 32 == 0 (16-byte rows of packed E2M1), got K=" + std::to_string(k));
    cudaError_t ce = cudaGetDevice(&device_);
    if (ce != cudaSuccess) throw std::runtime_error("cudaGetDevice: " + cuda_err_str(ce));
    ce = cudaMalloc(&scratch_, 512);
    if (ce != cudaSuccess) throw std::runtime_error("cudaMalloc(512) for the plan scratch: " + cuda_err_str(ce));
    float ab[2] = {1.0f, 0.0f};
    ce = cudaMemset(scratch_, 0, 512);
    if (ce == cudaSuccess) ce = cudaMemcpy(scratch_, ab, sizeof(ab), cudaMemcpyHostToDevice);
    if (ce != cudaSuccess) throw std::runtime_error("initialising the plan scratch: " + cuda_err_str(ce));

    expect(cublasLtCreate(&handle_), "cublasLtCreate");
    expect(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    set_desc(CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta), "TRANSA");
    set_desc(CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb), "TRANSB");
    cublasLtPointerMode_t pm =
        pmode_ == PointerMode::kDevice ? CUBLASLT_POINTER_MODE_DEVICE : CUBLASLT_POINTER_MODE_HOST;
    set_desc(CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof(pm), "POINTER_MODE");
    if (smode_ != ScaleMode::kNone) {
      cublasLtMatmulMatrixScale_t sm = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
      if (smode_ == ScaleMode::kVec16Ue4m3) sm = CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
      if (smode_ == ScaleMode::kOuter) sm = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      set_desc(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &sm, sizeof(sm), "A_SCALE_MODE");
      set_desc(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &sm, sizeof(sm), "B_SCALE_MODE");
      // The heuristic and AlgoCheck refuse a block-scaled problem until scale pointers are set; they do
      // not read them. run() replaces these with the real pointers on every call.
      set_scale_pointers(dummy_scale(), dummy_scale());
    }
    expect(cublasLtMatrixLayoutCreate(&a_, types_.a, k_, n_, k_), "cublasLtMatrixLayoutCreate(A)");
    expect(cublasLtMatrixLayoutCreate(&b_, types_.b, k_, m_, k_), "cublasLtMatrixLayoutCreate(B)");
    expect(cublasLtMatrixLayoutCreate(&c_, types_.c, n_, m_, n_), "cublasLtMatrixLayoutCreate(C)");
    expect(cublasLtMatrixLayoutCreate(&d_, types_.d, n_, m_, n_), "cublasLtMatrixLayoutCreate(D)");
  }

  ~Problem() {
    if (d_) cublasLtMatrixLayoutDestroy(d_);
    if (c_) cublasLtMatrixLayoutDestroy(c_);
    if (b_) cublasLtMatrixLayoutDestroy(b_);
    if (a_) cublasLtMatrixLayoutDestroy(a_);
    if (desc_) cublasLtMatmulDescDestroy(desc_);
    if (handle_) cublasLtDestroy(handle_);
    // At interpreter exit the context may already be gone; the error is irrelevant then.
    if (scratch_) {
      cudaFree(scratch_);
      cudaGetLastError();
    }
  }

  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  cublasStatus_t check(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulHeuristicResult_t* r) const {
    std::memset(r, 0, sizeof(*r));
    return cublasLtMatmulAlgoCheck(handle_, desc_, a_, b_, c_, d_, &algo, r);
  }

  cublasStatus_t heuristic(int count, uint64_t ws_limit, bool reduction_none,
                           std::vector<cublasLtMatmulHeuristicResult_t>* out) const {
    cublasLtMatmulPreference_t pref = nullptr;
    cublasStatus_t s = cublasLtMatmulPreferenceCreate(&pref);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_limit,
                                             sizeof(ws_limit));
    if (s == CUBLAS_STATUS_SUCCESS && reduction_none) {
      uint32_t mask = CUBLASLT_REDUCTION_SCHEME_NONE;
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask,
                                               sizeof(mask));
    }
    out->assign(static_cast<size_t>(count), cublasLtMatmulHeuristicResult_t{});
    int returned = 0;
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulAlgoGetHeuristic(handle_, desc_, a_, b_, c_, d_, pref, count, out->data(), &returned);
    cublasLtMatmulPreferenceDestroy(pref);
    out->resize(s == CUBLAS_STATUS_SUCCESS ? static_cast<size_t>(returned) : 0);
    return s;
  }

  std::vector<int> algo_ids(int max_ids) const {
    std::vector<int> ids(static_cast<size_t>(max_ids));
    int returned = 0;
    cublasStatus_t s = cublasLtMatmulAlgoGetIds(handle_, CUBLAS_COMPUTE_32F, CUDA_R_32F, types_.a, types_.b,
                                                types_.c, types_.d, max_ids, ids.data(), &returned);
    if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasLtMatmulAlgoGetIds returned " + status_str(s));
    ids.resize(static_cast<size_t>(returned));
    return ids;
  }

  cublasStatus_t init(int id, cublasLtMatmulAlgo_t* algo) const {
    return cublasLtMatmulAlgoInit(handle_, CUBLAS_COMPUTE_32F, CUDA_R_32F, types_.a, types_.b, types_.c,
                                  types_.d, id, algo);
  }

  void set_scale_pointers(const void* a_scale, const void* b_scale) {
    set_desc(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale), "A_SCALE_POINTER");
    set_desc(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale), "B_SCALE_POINTER");
  }

  py::dict key() const {
    py::dict d;
    d["kind"] = kind_name(kind_);
    d["m"] = m_;
    d["n"] = n_;
    d["k"] = k_;
    d["pointer_mode"] = pmode_ == PointerMode::kDevice ? "device" : "host";
    d["scale_mode"] = scale_mode_name(smode_);
    d["device"] = device_;
    return d;
  }

  const void* alpha_one() const { return scratch_; }
  const void* beta_zero() const { return static_cast<const char*>(scratch_) + 4; }
  const void* dummy_scale() const { return static_cast<const char*>(scratch_) + 256; }

  Kind kind_;
  int64_t m_, n_, k_;
  PointerMode pmode_;
  ScaleMode smode_;
  TypeSet types_;
  int device_ = -1;
  void* scratch_ = nullptr;
  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, c_ = nullptr, d_ = nullptr;

 private:
  static void expect(cublasStatus_t s, const char* what) {
    if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(what) + " returned " + status_str(s));
  }
  void set_desc(cublasLtMatmulDescAttributes_t attr, const void* v, size_t size, const char* name) {
    cublasStatus_t s = cublasLtMatmulDescSetAttribute(desc_, attr, v, size);
    if (s != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error(std::string("cublasLtMatmulDescSetAttribute(") + name + ") returned " + status_str(s));
  }
};

// One algorithm bound to one Problem. Never throws for a cuBLASLt refusal: ok/stage/status/message say
// what happened, so the Python guard can record the reason and fall back.
class Plan {
 public:
  std::shared_ptr<Problem> prob;
  cublasLtMatmulAlgo_t algo{};
  AlgoConfig requested, actual;
  bool ok = false;
  bool pinned = false;
  std::string stage = "new";
  int status = 0;
  std::string message;
  uint64_t workspace_limit = 0;
  uint64_t workspace_required = 0;
  float waves = 0.0f;
  uint32_t align[4] = {16, 16, 16, 16};  // A (w), B (x), C, D in bytes, from the algo capabilities

  void fail(const std::string& st, cublasStatus_t s, const std::string& msg) {
    ok = false;
    stage = st;
    status = static_cast<int>(s);
    message = msg;
  }

  void read_alignment() {
    const cublasLtMatmulAlgoCapAttributes_t caps[4] = {
        CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i) {
      uint32_t v = 0;
      if (get_cap(algo, caps[i], &v) && v > align[i]) align[i] = v;
    }
  }

  // AlgoCheck for this exact shape and the workspace limit, then fill workspace / waves.
  bool check_and_measure() {
    cublasLtMatmulHeuristicResult_t r;
    cublasStatus_t s = prob->check(algo, &r);
    if (s != CUBLAS_STATUS_SUCCESS) {
      fail("check", s, "cublasLtMatmulAlgoCheck returned " + status_str(s));
      return false;
    }
    workspace_required = r.workspaceSize;
    waves = r.wavesCount;
    if (workspace_required > workspace_limit) {
      fail("workspace", CUBLAS_STATUS_SUCCESS,
           "algo needs " + std::to_string(workspace_required) + " bytes of workspace, limit is " +
               std::to_string(workspace_limit));
      return false;
    }
    return true;
  }

  int run(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out, const std::optional<at::Tensor>& x_scale,
          const std::optional<at::Tensor>& w_scale, const std::optional<at::Tensor>& alpha, double alpha_host,
          const std::optional<at::Tensor>& workspace, int64_t stream) {
    if (!ok) throw py::value_error("run() on a plan that did not pass (" + stage + ": " + message + ")");
    if (!prob) throw py::value_error("run() on a plan without a problem");
    Problem& p = *prob;
    const int64_t m = p.m_, n = p.n_, k = p.k_;
    const int64_t kb = p.kind_ == Kind::kNvfp4 ? k / 2 : k;  // row length in elements of x/w tensors
    // Messages are built with std::string only: std::ostream formatting inside this extension crashed on the
    // H200 (SIGSEGV in basic_ostream::_M_insert<long>, seen with cuda-gdb), so no iostreams in the hot path.
    auto where = [](const char* name, const at::Tensor& t) {
      std::string s = std::string(name) + " [";
      for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
      s += std::string("] ") + c10::toString(t.scalar_type());
      s += t.is_cuda() ? " on cuda:" + std::to_string(t.get_device()) : std::string(" on cpu");
      return s;
    };
    auto need = [&](bool cond, const std::string& msg) {
      if (!cond) throw py::value_error(msg);
    };
    auto on_device = [&](const char* name, const at::Tensor& t) {
      need(t.is_cuda() && t.get_device() == p.device_,
           where(name, t) + ": expected a tensor on cuda:" + std::to_string(p.device_) + " (the plan's device)");
      need(t.is_contiguous(), where(name, t) + ": expected a contiguous tensor");
    };
    auto aligned = [&](const char* name, const void* ptr, uint32_t bytes) {
      need(reinterpret_cast<uintptr_t>(ptr) % bytes == 0,
           std::string(name) + " data pointer is not " + std::to_string(bytes) + "-byte aligned (algo requirement)");
    };
    auto is_byte_type = [](const at::Tensor& t) {
      const std::string n = c10::toString(t.scalar_type());
      return t.element_size() == 1 && (n == "Byte" || n == "Float4_e2m1fn_x2" || n == "Float8_e4m3fn");
    };

    on_device("x", x);
    on_device("w", w);
    on_device("out", out);
    need(x.dim() == 2 && x.size(0) == m && x.size(1) == kb,
         where("x", x) + ": expected [" + std::to_string(m) + ", " + std::to_string(kb) + "]");
    need(w.dim() == 2 && w.size(0) == n && w.size(1) == kb,
         where("w", w) + ": expected [" + std::to_string(n) + ", " + std::to_string(kb) + "]");
    need(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.scalar_type() == at::kBFloat16,
         where("out", out) + ": expected bf16 [" + std::to_string(m) + ", " + std::to_string(n) + "]");

    const void* x_scale_ptr = nullptr;
    const void* w_scale_ptr = nullptr;
    switch (p.kind_) {
      case Kind::kNvfp4: {
        const std::string xn = c10::toString(x.scalar_type()), wn = c10::toString(w.scalar_type());
        need(xn == "Byte" || xn == "Float4_e2m1fn_x2",
             where("x", x) + ": expected packed E2M1 (uint8 or float4_e2m1fn_x2)");
        need(wn == "Byte" || wn == "Float4_e2m1fn_x2",
             where("w", w) + ": expected packed E2M1 (uint8 or float4_e2m1fn_x2)");
        need(x_scale.has_value() && w_scale.has_value(),
             "nvfp4 needs x_scale and w_scale (swizzled UE4M3 block scales)");
        const int64_t sc = round_up(k / 16, 4);
        const at::Tensor& xs = *x_scale;
        const at::Tensor& ws = *w_scale;
        on_device("x_scale", xs);
        on_device("w_scale", ws);
        need(is_byte_type(xs) && xs.numel() >= round_up(m, 128) * sc,
             where("x_scale", xs) + ": expected >= " + std::to_string(round_up(m, 128) * sc) +
                 " UE4M3 bytes (128x4 swizzled, zero padded)");
        need(is_byte_type(ws) && ws.numel() >= round_up(n, 128) * sc,
             where("w_scale", ws) + ": expected >= " + std::to_string(round_up(n, 128) * sc) +
                 " UE4M3 bytes (128x4 swizzled, zero padded)");
        x_scale_ptr = xs.data_ptr();
        w_scale_ptr = ws.data_ptr();
        break;
      }
      case Kind::kFp8E4m3: {
        need(x.scalar_type() == at::kFloat8_e4m3fn, where("x", x) + ": expected float8_e4m3fn");
        need(w.scalar_type() == at::kFloat8_e4m3fn, where("w", w) + ": expected float8_e4m3fn");
        need(x_scale.has_value() && w_scale.has_value(), "fp8_e4m3 needs fp32 x_scale and w_scale");
        const at::Tensor& xs = *x_scale;
        const at::Tensor& ws = *w_scale;
        on_device("x_scale", xs);
        on_device("w_scale", ws);
        const int64_t xe = p.smode_ == ScaleMode::kOuter ? m : 1, we = p.smode_ == ScaleMode::kOuter ? n : 1;
        need(xs.scalar_type() == at::kFloat && xs.numel() == xe,
             where("x_scale", xs) + ": expected " + std::to_string(xe) + " fp32 values");
        need(ws.scalar_type() == at::kFloat && ws.numel() == we,
             where("w_scale", ws) + ": expected " + std::to_string(we) + " fp32 values");
        x_scale_ptr = xs.data_ptr();
        w_scale_ptr = ws.data_ptr();
        break;
      }
      case Kind::kBf16:
        need(x.scalar_type() == at::kBFloat16, where("x", x) + ": expected bfloat16");
        need(w.scalar_type() == at::kBFloat16, where("w", w) + ": expected bfloat16");
        need(!x_scale.has_value() && !w_scale.has_value(), "bf16 takes no scales");
        break;
    }
    if (x_scale_ptr != nullptr) {
      aligned("x_scale", x_scale_ptr, 16);
      aligned("w_scale", w_scale_ptr, 16);
    }
    aligned("w (cuBLAS A)", w.data_ptr(), align[0]);
    aligned("x (cuBLAS B)", x.data_ptr(), align[1]);
    aligned("out (cuBLAS C/D)", out.data_ptr(), std::max(align[2], align[3]));

    void* ws_ptr = nullptr;
    uint64_t ws_bytes = 0;
    if (workspace.has_value()) {
      const at::Tensor& wsp = *workspace;
      on_device("workspace", wsp);
      ws_ptr = wsp.data_ptr();
      ws_bytes = static_cast<uint64_t>(wsp.numel()) * wsp.element_size();
      aligned("workspace", ws_ptr, 256);
    }
    need(ws_bytes >= workspace_required, "plan needs " + std::to_string(workspace_required) +
                                             " bytes of workspace, got " + std::to_string(ws_bytes));

    int cur = -1;
    cudaError_t ce = cudaGetDevice(&cur);
    need(ce == cudaSuccess && cur == p.device_,
         "current CUDA device is " + std::to_string(cur) + ", the plan was built on " + std::to_string(p.device_));

    float alpha_h = static_cast<float>(alpha_host), beta_h = 0.0f;
    const void* alpha_ptr = &alpha_h;
    const void* beta_ptr = &beta_h;
    if (p.pmode_ == PointerMode::kDevice) {
      alpha_ptr = p.alpha_one();
      if (alpha.has_value()) {
        const at::Tensor& al = *alpha;
        on_device("alpha", al);
        need(al.scalar_type() == at::kFloat && al.numel() == 1, where("alpha", al) + ": expected one fp32 value");
        alpha_ptr = al.data_ptr();
      }
      beta_ptr = p.beta_zero();
    } else {
      need(!alpha.has_value(), "pointer_mode=host takes alpha as a Python float, not a tensor");
    }

    static int traced = 0;
    const bool trace = trace_enabled() && traced++ < 64;
    if (trace) {
      std::fprintf(stderr,
                   "[h3_fc2_lt] run kind=%s pmode=%s m=%lld n=%lld k=%lld handle=%p desc=%p alpha=%p(%s) "
                   "beta=%p A(w)=%p B(x)=%p D(out)=%p a_scale(w)=%p b_scale(x)=%p algo=%p pinned=%d "
                   "ws=%p ws_bytes=%llu ws_required=%llu stream=0x%llx device=%d\n",
                   kind_name(p.kind_), p.pmode_ == PointerMode::kDevice ? "device" : "host",
                   static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
                   static_cast<void*>(p.handle_), static_cast<void*>(p.desc_), alpha_ptr,
                   pointer_kind(alpha_ptr), beta_ptr, w.data_ptr(), x.data_ptr(), out.data_ptr(), w_scale_ptr,
                   x_scale_ptr, static_cast<const void*>(&algo), pinned ? 1 : 0, ws_ptr,
                   static_cast<unsigned long long>(ws_bytes), static_cast<unsigned long long>(workspace_required),
                   static_cast<unsigned long long>(stream), p.device_);
      std::fflush(stderr);
    }
    // The scale pointers live in the shared descriptor: reset them on every call.
    if (x_scale_ptr != nullptr) p.set_scale_pointers(w_scale_ptr, x_scale_ptr);
    cublasStatus_t s = cublasLtMatmul(p.handle_, p.desc_, alpha_ptr, w.data_ptr(), p.a_, x.data_ptr(), p.b_, beta_ptr,
                                      out.data_ptr(), p.c_, out.data_ptr(), p.d_, &algo, ws_ptr, ws_bytes,
                                      reinterpret_cast<cudaStream_t>(stream));
    if (x_scale_ptr != nullptr) p.set_scale_pointers(p.dummy_scale(), p.dummy_scale());
    if (trace) {
      std::fprintf(stderr, "[h3_fc2_lt] run returned %s\n", status_str(s).c_str());
      std::fflush(stderr);
    }
    return static_cast<int>(s);
  }

  py::dict info() const {
    py::dict d;
    d["ok"] = ok;
    d["pinned"] = pinned;
    d["stage"] = stage;
    d["status"] = status;
    d["status_name"] = status_name(static_cast<cublasStatus_t>(status));
    d["message"] = message;
    d["requested"] = config_to_dict(requested);
    d["config"] = ok || stage == "readback" ? py::object(config_to_dict(actual)) : py::object(py::none());
    d["workspace_limit"] = workspace_limit;
    d["workspace_required"] = workspace_required;
    d["waves"] = waves;
    py::list al;
    for (uint32_t a : align) al.append(a);
    d["min_alignment_bytes"] = al;
    d["problem"] = prob->key();
    return d;
  }
};

std::shared_ptr<Plan> make_pinned_plan(std::shared_ptr<Problem> prob, const py::dict& cfg, uint64_t ws_limit) {
  auto plan = std::make_shared<Plan>();
  plan->prob = prob;
  plan->pinned = true;
  plan->workspace_limit = ws_limit;
  plan->requested = config_from_dict(cfg);
  const AlgoConfig& rq = plan->requested;
  if (rq.splitk != 1 || rq.reduction != CUBLASLT_REDUCTION_SCHEME_NONE) {
    plan->fail("policy", CUBLAS_STATUS_SUCCESS,
               "pinned plans need split-K 1 and reduction scheme NONE (0) for a fixed fp32 reduction order, got "
               "split-K " + std::to_string(rq.splitk) + " reduction " + std::to_string(rq.reduction));
    return plan;
  }
  cublasStatus_t s = prob->init(rq.id, &plan->algo);
  if (s != CUBLAS_STATUS_SUCCESS) {
    plan->fail("init", s, "cublasLtMatmulAlgoInit(id=" + std::to_string(rq.id) + ") returned " + status_str(s));
    return plan;
  }
  struct Item {
    const char* name;
    cublasStatus_t s;
  };
  Item items[] = {
      {"TILE_ID", set_cfg(&plan->algo, CUBLASLT_ALGO_CONFIG_TILE_ID, rq.tile)},
      {"STAGES_ID", set_cfg(&plan->algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, rq.stages)},
      {"SPLITK_NUM", set_cfg(&plan->algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, rq.splitk)},
      {"REDUCTION_SCHEME", set_cfg(&plan->algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, rq.reduction)},
      {"CTA_SWIZZLING", set_cfg(&plan->algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, rq.swizzle)},
      {"CUSTOM_OPTION", set_cfg(&plan->algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, rq.custom)},
      {"CLUSTER_SHAPE_ID", set_cfg(&plan->algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, rq.cluster)},
      {"INNER_SHAPE_ID", set_cfg(&plan->algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, rq.inner)},
  };
  for (const Item& it : items) {
    if (it.s != CUBLAS_STATUS_SUCCESS) {
      plan->fail("config", it.s,
                 std::string("cublasLtMatmulAlgoConfigSetAttribute(") + it.name + ") returned " + status_str(it.s));
      return plan;
    }
  }
  if (!plan->check_and_measure()) return plan;
  std::string err;
  if (!read_config(plan->algo, &plan->actual, &err)) {
    plan->fail("readback", CUBLAS_STATUS_INVALID_VALUE, err);
    return plan;
  }
  if (!(plan->actual == rq)) {
    auto cfg = [](const char* what, const auto& c) {
      return std::string(what) + " id " + std::to_string(c.id) + " tile " + std::to_string(c.tile) + " stages " +
             std::to_string(c.stages) + " split-K " + std::to_string(c.splitk) + " reduction " +
             std::to_string(c.reduction) + " swizzle " + std::to_string(c.swizzle) + " custom " +
             std::to_string(c.custom) + " cluster " + std::to_string(c.cluster) + " inner " + std::to_string(c.inner);
    };
    plan->fail("readback", CUBLAS_STATUS_SUCCESS,
               "read-back config differs from the requested one: " + cfg("requested", rq) + "; " +
                   cfg("read", plan->actual));
    return plan;
  }
  plan->read_alignment();
  plan->ok = true;
  plan->stage = "ready";
  return plan;
}

// The heuristic's choice (index-th result), for timing baselines and to seed the tuner. Not pinned:
// whatever split-K / reduction the library picked is recorded, not enforced.
std::shared_ptr<Plan> make_heuristic_plan(std::shared_ptr<Problem> prob, int index, uint64_t ws_limit,
                                          bool reduction_none) {
  auto plan = std::make_shared<Plan>();
  plan->prob = prob;
  plan->pinned = false;
  plan->workspace_limit = ws_limit;
  std::vector<cublasLtMatmulHeuristicResult_t> res;
  cublasStatus_t s = prob->heuristic(index + 1, ws_limit, reduction_none, &res);
  if (s != CUBLAS_STATUS_SUCCESS) {
    plan->fail("heuristic", s, "cublasLtMatmulAlgoGetHeuristic returned " + status_str(s));
    return plan;
  }
  if (static_cast<int>(res.size()) <= index || res[static_cast<size_t>(index)].state != CUBLAS_STATUS_SUCCESS) {
    plan->fail("heuristic", CUBLAS_STATUS_NOT_SUPPORTED,
               "cublasLtMatmulAlgoGetHeuristic returned " + std::to_string(res.size()) + " results, none at index " +
                   std::to_string(index));
    return plan;
  }
  plan->algo = res[static_cast<size_t>(index)].algo;
  const uint64_t heur_ws = static_cast<uint64_t>(res[static_cast<size_t>(index)].workspaceSize);
  if (!plan->check_and_measure()) return plan;
  // AlgoCheck and the heuristic may disagree on the workspace of an unpinned (split-K / stream-K) algo;
  // run() must never hand cuBLASLt less than either asked for.
  if (heur_ws > plan->workspace_required) {
    plan->workspace_required = heur_ws;
    if (heur_ws > ws_limit) {
      plan->fail("workspace", CUBLAS_STATUS_SUCCESS,
                 "heuristic algo needs " + std::to_string(heur_ws) + " bytes of workspace, limit is " +
                     std::to_string(ws_limit));
      return plan;
    }
  }
  std::string err;
  if (!read_config(plan->algo, &plan->actual, &err)) {
    plan->fail("readback", CUBLAS_STATUS_INVALID_VALUE, err);
    return plan;
  }
  plan->requested = plan->actual;
  plan->read_alignment();
  plan->ok = true;
  plan->stage = "ready";
  return plan;
}

py::list heuristic_list(const Problem& prob, int count, uint64_t ws_limit, bool reduction_none) {
  std::vector<cublasLtMatmulHeuristicResult_t> res;
  cublasStatus_t s = prob.heuristic(count, ws_limit, reduction_none, &res);
  if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasLtMatmulAlgoGetHeuristic returned " + status_str(s));
  py::list out;
  for (const auto& r : res) {
    py::dict d;
    d["state"] = static_cast<int>(r.state);
    d["workspace"] = static_cast<uint64_t>(r.workspaceSize);
    d["waves"] = r.wavesCount;
    AlgoConfig c;
    std::string err;
    if (r.state == CUBLAS_STATUS_SUCCESS && read_config(r.algo, &c, &err)) {
      d["config"] = config_to_dict(c);
    } else {
      d["config"] = py::none();
      d["error"] = err;
    }
    out.append(d);
  }
  return out;
}

py::dict algo_caps(const Problem& prob, int id) {
  cublasLtMatmulAlgo_t algo;
  cublasStatus_t s = prob.init(id, &algo);
  py::dict d;
  d["id"] = id;
  d["init_status"] = static_cast<int>(s);
  if (s != CUBLAS_STATUS_SUCCESS) {
    d["init_error"] = "cublasLtMatmulAlgoInit returned " + status_str(s);
    return d;
  }
  int32_t i32 = 0;
  uint32_t u32 = 0;
  uint64_t u64 = 0;
  if (get_cap(algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &i32)) d["splitk_support"] = i32;
  if (get_cap(algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &u32)) d["reduction_mask"] = u32;
  if (get_cap(algo, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, &u32)) d["swizzle_support"] = u32;
  if (get_cap(algo, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &i32)) d["custom_option_max"] = i32;
  if (get_cap(algo, CUBLASLT_ALGO_CAP_POINTER_MODE_MASK, &u32)) d["pointer_mode_mask"] = u32;
  if (get_cap(algo, CUBLASLT_ALGO_CAP_EPILOGUE_MASK, &u32)) d["epilogue_mask"] = u32;
  if (get_cap(algo, CUBLASLT_ALGO_CAP_NUMERICAL_IMPL_FLAGS, &u64)) d["numerical_impl_flags"] = u64;
  py::list al;
  const cublasLtMatmulAlgoCapAttributes_t caps[4] = {
      CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES};
  for (auto c : caps) {
    if (get_cap(algo, c, &u32)) al.append(u32); else al.append(py::none());
  }
  d["min_alignment_bytes"] = al;
  d["tiles"] = get_cap_array(algo, CUBLASLT_ALGO_CAP_TILE_IDS);
  d["stages"] = get_cap_array(algo, CUBLASLT_ALGO_CAP_STAGES_IDS);
  return d;
}

py::dict build_info() {
  py::dict d;
  d["cuda_header"] = CUDART_VERSION;
  d["cublas_header"] = CUBLAS_VERSION;
  d["cublas_header_build"] = CUBLAS_VER_BUILD;
  int v = 0;
  cudaError_t ce = cudaRuntimeGetVersion(&v);
  d["cuda_runtime"] = ce == cudaSuccess ? py::object(py::int_(v)) : py::object(py::none());
  v = 0;
  ce = cudaDriverGetVersion(&v);
  d["cuda_driver"] = ce == cudaSuccess && v > 0 ? py::object(py::int_(v)) : py::object(py::none());
  d["cublaslt_runtime"] = static_cast<uint64_t>(cublasLtGetVersion());
  d["cublaslt_cudart"] = static_cast<uint64_t>(cublasLtGetCudartVersion());
  d["cublaslt_path"] = library_path(reinterpret_cast<const void*>(&cublasLtGetVersion));
  d["cudart_path"] = library_path(reinterpret_cast<const void*>(&cudaRuntimeGetVersion));

  int count = 0;
  ce = cudaGetDeviceCount(&count);
  d["device_count"] = ce == cudaSuccess ? count : 0;
  int dev = -1;
  if (ce == cudaSuccess && count > 0) ce = cudaGetDevice(&dev);
  if (ce == cudaSuccess && count > 0) {
    cudaDeviceProp prop;
    ce = cudaGetDeviceProperties(&prop, dev);
    if (ce == cudaSuccess) {
      py::dict dv;
      dv["index"] = dev;
      dv["name"] = std::string(prop.name);
      dv["cc"] = py::make_tuple(prop.major, prop.minor);
      dv["sm_count"] = prop.multiProcessorCount;
      char uuid[64];
      const unsigned char* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
      std::snprintf(uuid, sizeof(uuid),
                    "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2],
                    u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
      dv["uuid"] = std::string(uuid);
      dv["total_memory"] = static_cast<uint64_t>(prop.totalGlobalMem);
      d["device"] = dv;
      d["device_error"] = py::none();
      return d;
    }
  }
  if (ce == cudaSuccess) ce = cudaErrorNoDevice;
  cudaGetLastError();  // clear the sticky-free error so later runtime calls start clean
  d["device"] = py::none();
  d["device_error"] = cuda_err_str(ce);
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "h3-blackwell: pinned cuBLASLt GEMM plans for the guarded FC2 path";
  m.def("build_info", &build_info,
        "Compile-time CUDA/cuBLAS header versions, runtime CUDA and cuBLASLt versions, loaded library paths, "
        "and the current device (compute capability, SM count) or the error that prevented reading it.");
  m.def("status_name", [](int s) { return std::string(status_name(static_cast<cublasStatus_t>(s))); });

  py::class_<Problem, std::shared_ptr<Problem>>(m, "Problem")
      .def(py::init<const std::string&, int64_t, int64_t, int64_t, const std::string&, const std::string&>(),
           py::arg("kind"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("pointer_mode") = "host",
           py::arg("scale_mode") = "",
           "Descriptors for y[m,n] = x[m,k] . w[n,k]^T on the current device (m = descriptor/padded rows).")
      .def_property_readonly("key", &Problem::key)
      .def("algo_ids",
           [](const Problem& p, int max_ids) { return p.algo_ids(max_ids); }, py::arg("max_ids") = 1024,
           "cublasLtMatmulAlgoGetIds for this problem's types. Does NOT filter by device.")
      .def("algo_caps", [](const Problem& p, int id) { return algo_caps(p, id); }, py::arg("algo_id"),
           "Capabilities of one algorithm id: tiles, stages, split-K support, reduction mask, swizzle, "
           "custom-option range, pointer modes, minimum alignments.")
      .def("heuristic",
           [](const Problem& p, int count, uint64_t ws, bool red_none) {
             return heuristic_list(p, count, ws, red_none);
           },
           py::arg("count") = 8, py::arg("workspace_limit") = 0, py::arg("reduction_none") = false)
      .def("pinned_plan",
           [](std::shared_ptr<Problem> p, const py::dict& cfg, uint64_t ws) { return make_pinned_plan(p, cfg, ws); },
           py::arg("config"), py::arg("workspace_limit") = 0,
           "AlgoInit + every config attribute + AlgoCheck + read-back. Never raises for a cuBLASLt refusal; "
           "inspect .ok / .info().")
      .def("heuristic_plan",
           [](std::shared_ptr<Problem> p, int index, uint64_t ws, bool red_none) {
             return make_heuristic_plan(p, index, ws, red_none);
           },
           py::arg("index") = 0, py::arg("workspace_limit") = 0, py::arg("reduction_none") = false);

  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def_property_readonly("ok", [](const Plan& p) { return p.ok; })
      .def_property_readonly("workspace_required", [](const Plan& p) { return p.workspace_required; })
      .def("info", &Plan::info)
      .def("run", &Plan::run, py::arg("x"), py::arg("w"), py::arg("out"), py::arg("x_scale") = py::none(),
           py::arg("w_scale") = py::none(), py::arg("alpha") = py::none(), py::arg("alpha_host") = 1.0,
           py::arg("workspace") = py::none(), py::arg("stream") = 0,
           "Enqueue y = x . w^T on `stream` (a cudaStream_t as int). Returns the cublasStatus_t (0 = success); "
           "raises ValueError when a tensor breaks the plan's contract.");
}
