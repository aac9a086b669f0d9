#pragma once
// Stands in for cuDNN's cudnn.h in the emulated test targets: the part of the graph (backend)
// API that runtime/cuda/convolution.hpp calls, with the three convolution operations computed
// by host loops from the tensors' dims and strides as the descriptors state them (so a layout
// described wrongly computes wrongly here, as on a device).
//
// It checks what cuDNN documents and a caller could get wrong: attributes of the right type and
// count, every descriptor finalized before another refers to it or it runs, descriptors alive
// when they are used (a plan whose operation graph was destroyed fails), output dims equal to
// those the convolution gives, a workspace when the engine needs one, and each pointer aligned
// as its tensor promised. Three emulated engines, in the heuristic's order: 0 runs on "tensor
// cores" (numerical note TENSOR_CORE: its inputs are rounded to TF32 here, so taking it on an
// fp32 run shows as a 1e-3 error), 1 is "non-deterministic" (note NONDETERMINISTIC), 2 has no
// notes and takes a workspace. `cudnn_emulation::settings` makes engines refuse a filter that is
// not packed KRSC (as engines without strided filters do), or offers none at all.
#include "../cuda_emulation.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <vector>

enum cudnnStatus_t {
  CUDNN_STATUS_SUCCESS = 0,
  CUDNN_STATUS_NOT_INITIALIZED = 1001,
  CUDNN_STATUS_BAD_PARAM = 2000,
  CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED = 2004,
  CUDNN_STATUS_NOT_SUPPORTED = 3000,
  CUDNN_STATUS_EXECUTION_FAILED = 5000,
};
struct cudnnContext {
  cudaStream_t stream = nullptr;
};
typedef cudnnContext* cudnnHandle_t;
typedef void* cudnnBackendDescriptor_t;
enum cudnnDataType_t { CUDNN_DATA_FLOAT = 0 };
enum cudnnConvolutionMode_t { CUDNN_CONVOLUTION = 0, CUDNN_CROSS_CORRELATION = 1 };
enum cudnnBackendHeurMode_t { CUDNN_HEUR_MODE_INSTANT = 0, CUDNN_HEUR_MODE_B = 1, CUDNN_HEUR_MODE_FALLBACK = 2, CUDNN_HEUR_MODE_A = 3 };
enum cudnnBackendNumericalNote_t {
  CUDNN_NUMERICAL_NOTE_TENSOR_CORE = 0,
  CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS = 1,
  CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC = 4,
  CUDNN_NUMERICAL_NOTE_TYPE_COUNT = 10,
};
enum cudnnBackendAttributeType_t {
  CUDNN_TYPE_HANDLE = 0,
  CUDNN_TYPE_DATA_TYPE = 1,
  CUDNN_TYPE_INT64 = 3,
  CUDNN_TYPE_FLOAT = 4,
  CUDNN_TYPE_VOID_PTR = 6,
  CUDNN_TYPE_CONVOLUTION_MODE = 7,
  CUDNN_TYPE_HEUR_MODE = 8,
  CUDNN_TYPE_NUMERICAL_NOTE = 11,
  CUDNN_TYPE_BACKEND_DESCRIPTOR = 15,
};
enum cudnnBackendDescriptorType_t {
  CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR = 1,
  CUDNN_BACKEND_ENGINE_DESCRIPTOR = 2,
  CUDNN_BACKEND_ENGINECFG_DESCRIPTOR = 3,
  CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR = 4,
  CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR = 5,
  CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR = 10,
  CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR = 11,
  CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR = 12,
  CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR = 15,
  CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR = 16,
  CUDNN_BACKEND_TENSOR_DESCRIPTOR = 17,
};
enum cudnnBackendAttributeName_t {
  CUDNN_ATTR_CONVOLUTION_COMP_TYPE = 100,
  CUDNN_ATTR_CONVOLUTION_CONV_MODE = 101,
  CUDNN_ATTR_CONVOLUTION_DILATIONS = 102,
  CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES = 103,
  CUDNN_ATTR_CONVOLUTION_POST_PADDINGS = 104,
  CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS = 105,
  CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS = 106,
  CUDNN_ATTR_ENGINEHEUR_MODE = 200,
  CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH = 201,
  CUDNN_ATTR_ENGINEHEUR_RESULTS = 202,
  CUDNN_ATTR_ENGINECFG_ENGINE = 300,
  CUDNN_ATTR_EXECUTION_PLAN_HANDLE = 400,
  CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG = 401,
  CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE = 402,
  CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA = 700,
  CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA = 701,
  CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC = 702,
  CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W = 703,
  CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X = 704,
  CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y = 705,
  CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA = 706,
  CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA = 707,
  CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC = 708,
  CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W = 709,
  CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX = 710,
  CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY = 711,
  CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA = 712,
  CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA = 713,
  CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC = 714,
  CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW = 715,
  CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X = 716,
  CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY = 717,
  CUDNN_ATTR_OPERATIONGRAPH_HANDLE = 800,
  CUDNN_ATTR_OPERATIONGRAPH_OPS = 801,
  CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT = 900,
  CUDNN_ATTR_TENSOR_DATA_TYPE = 901,
  CUDNN_ATTR_TENSOR_DIMENSIONS = 902,
  CUDNN_ATTR_TENSOR_STRIDES = 903,
  CUDNN_ATTR_TENSOR_UNIQUE_ID = 906,
  CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS = 1000,
  CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS = 1001,
  CUDNN_ATTR_VARIANT_PACK_WORKSPACE = 1003,
  CUDNN_ATTR_ENGINE_NUMERICAL_NOTE = 1303,
};

namespace cudnn_emulation {

/// What the tests set: engines that refuse a strided (non-KRSC) filter, or no engine at all.
struct settings_t {
  bool packed_filters_only = false;
  bool no_engines = false;
  long long executions = 0; ///< cudnnBackendExecute calls (a test checks cuDNN really ran)
};
inline settings_t settings;

inline constexpr int engine_count = 3;
inline constexpr std::int64_t engine_workspace[engine_count] = {0, 0, 4096};

struct attribute {
  cudnnBackendAttributeType_t type;
  std::vector<unsigned char> bytes;
  std::int64_t count = 0;
};
struct descriptor {
  cudnnBackendDescriptorType_t type;
  std::map<int, attribute> attrs;
  bool finalized = false;
  int engine = -1;                 // engine, engine config, plan: which emulated engine
  descriptor* graph = nullptr;     // engine config, plan: the operation graph it runs
};
inline std::set<const descriptor*>& live() {
  static std::set<const descriptor*> d;
  return d;
}
inline descriptor* get(cudnnBackendDescriptor_t d) {
  auto* p = static_cast<descriptor*>(d);
  return p != nullptr && live().count(p) != 0 ? p : nullptr;
}
inline std::size_t element_bytes(cudnnBackendAttributeType_t t) {
  switch (t) {
  case CUDNN_TYPE_INT64: return 8;
  case CUDNN_TYPE_FLOAT: return 4;
  case CUDNN_TYPE_VOID_PTR:
  case CUDNN_TYPE_HANDLE:
  case CUDNN_TYPE_BACKEND_DESCRIPTOR: return sizeof(void*);
  default: return 4; // the enums
  }
}
template <class T>
std::vector<T> values(const descriptor& d, int name, cudnnBackendAttributeType_t type) {
  const auto it = d.attrs.find(name);
  if (it == d.attrs.end() || it->second.type != type) return {};
  std::vector<T> v(static_cast<std::size_t>(it->second.count));
  std::memcpy(v.data(), it->second.bytes.data(), v.size() * sizeof(T));
  return v;
}
// A finalized, live descriptor another one names, or null.
inline descriptor* named(const descriptor& d, int name) {
  const auto v = values<void*>(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR);
  if (v.size() != 1) return nullptr;
  auto* p = get(v[0]);
  return p != nullptr && p->finalized ? p : nullptr;
}

struct tensor {
  std::array<std::int64_t, 4> dims{}, strides{};
  std::int64_t uid = 0, align = 0;
};
inline bool read_tensor(const descriptor* d, tensor& t) {
  if (d == nullptr || d->type != CUDNN_BACKEND_TENSOR_DESCRIPTOR) return false;
  const auto dims = values<std::int64_t>(*d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64);
  const auto strides = values<std::int64_t>(*d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64);
  const auto uid = values<std::int64_t>(*d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64);
  const auto align = values<std::int64_t>(*d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64);
  const auto type = values<int>(*d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE);
  if (dims.size() != 4 || strides.size() != 4 || uid.size() != 1 || align.size() != 1 || type.size() != 1 ||
      type[0] != CUDNN_DATA_FLOAT)
    return false;
  std::copy(dims.begin(), dims.end(), t.dims.begin());
  std::copy(strides.begin(), strides.end(), t.strides.begin());
  t.uid = uid[0];
  t.align = align[0];
  return true;
}

// One convolution operation, read from its descriptor: x [n, c, h, w], w [k, c, r, s], y [n, k, oh, ow].
struct conv_op {
  cudnnBackendDescriptorType_t kind;
  tensor x, w, y;
  std::int64_t stride[2] = {1, 1}, pre[2] = {0, 0}, post[2] = {0, 0};
  float alpha = 1, beta = 0;
};
inline int attr_base(cudnnBackendDescriptorType_t kind) {
  return kind == CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR         ? 700
         : kind == CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR ? 706
                                                                                : 712;
}
inline cudnnStatus_t read_conv(const descriptor& d, conv_op& op) {
  op.kind = d.type;
  const int b = attr_base(d.type);
  // From each kind's first attribute: alpha, beta, the convolution, w (dw), x (dx), y (dy).
  const int w = b + 3, x = b + 4, y = b + 5;
  if (!read_tensor(named(d, x), op.x) || !read_tensor(named(d, w), op.w) || !read_tensor(named(d, y), op.y))
    return CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED;
  const auto* conv = named(d, b + 2);
  const auto alpha = values<float>(d, b, CUDNN_TYPE_FLOAT), beta = values<float>(d, b + 1, CUDNN_TYPE_FLOAT);
  if (conv == nullptr || conv->type != CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR || alpha.size() != 1 || beta.size() != 1)
    return CUDNN_STATUS_BAD_PARAM;
  op.alpha = alpha[0];
  op.beta = beta[0];
  const auto st = values<std::int64_t>(*conv, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64);
  const auto pre = values<std::int64_t>(*conv, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64);
  const auto post = values<std::int64_t>(*conv, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64);
  const auto dil = values<std::int64_t>(*conv, CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64);
  const auto mode = values<int>(*conv, CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE);
  const auto spatial = values<std::int64_t>(*conv, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64);
  if (st.size() != 2 || pre.size() != 2 || post.size() != 2 || dil.size() != 2 || mode.size() != 1 || spatial.size() != 1 ||
      spatial[0] != 2)
    return CUDNN_STATUS_BAD_PARAM;
  if (dil[0] != 1 || dil[1] != 1 || mode[0] != CUDNN_CROSS_CORRELATION) return CUDNN_STATUS_NOT_SUPPORTED;
  for (int i = 0; i < 2; ++i) {
    op.stride[i] = st[static_cast<std::size_t>(i)];
    op.pre[i] = pre[static_cast<std::size_t>(i)];
    op.post[i] = post[static_cast<std::size_t>(i)];
  }
  // The shapes must agree: n and c shared, y's spatial dims those the convolution gives.
  const auto& X = op.x.dims;
  const auto& W = op.w.dims;
  const auto& Y = op.y.dims;
  const auto extent = [&](int i) { return (X[2 + i] + op.pre[i] + op.post[i] - W[2 + i]) / op.stride[i] + 1; };
  if (X[0] != Y[0] || X[1] != W[1] || Y[1] != W[0] || Y[2] != extent(0) || Y[3] != extent(1)) return CUDNN_STATUS_BAD_PARAM;
  return CUDNN_STATUS_SUCCESS;
}
inline bool packed_krsc(const tensor& w) {
  const auto& d = w.dims;
  return w.strides == std::array<std::int64_t, 4>{d[1] * d[2] * d[3], 1, d[3] * d[1], d[1]};
}
inline std::size_t offset(const tensor& t, std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) {
  return static_cast<std::size_t>(a * t.strides[0] + b * t.strides[1] + c * t.strides[2] + d * t.strides[3]);
}
inline float tf32(float v) { // round to nearest of 10 mantissa bits, as a tensor core reads fp32
  std::uint32_t u;
  std::memcpy(&u, &v, 4);
  u = (u + 0x1000u) & ~0x1fffu;
  std::memcpy(&v, &u, 4);
  return v;
}
// Runs the operation: y = alpha·conv(x, w) + beta·y for forward, and its two gradients.
inline void run_conv(const conv_op& op, int engine, float* x, float* w, float* y) {
  const auto in = [&](float v) { return engine == 0 ? tf32(v) : v; };
  const auto& X = op.x.dims;
  const auto& W = op.w.dims;
  const auto& Y = op.y.dims;
  const auto& out = op.kind == CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR         ? op.y
                    : op.kind == CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR ? op.x
                                                                                              : op.w;
  float* out_ptr = &out == &op.y ? y : &out == &op.x ? x : w;
  std::vector<double> acc(static_cast<std::size_t>(out.dims[0] * out.dims[1] * out.dims[2] * out.dims[3]), 0.0);
  const auto dense = [&](std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) {
    return static_cast<std::size_t>(((a * out.dims[1] + b) * out.dims[2] + c) * out.dims[3] + d);
  };
  for (std::int64_t n = 0; n < Y[0]; ++n)
    for (std::int64_t k = 0; k < Y[1]; ++k)
      for (std::int64_t oh = 0; oh < Y[2]; ++oh)
        for (std::int64_t ow = 0; ow < Y[3]; ++ow)
          for (std::int64_t c = 0; c < X[1]; ++c)
            for (std::int64_t r = 0; r < W[2]; ++r)
              for (std::int64_t s = 0; s < W[3]; ++s) {
                const auto h = oh * op.stride[0] - op.pre[0] + r, col = ow * op.stride[1] - op.pre[1] + s;
                if (h < 0 || h >= X[2] || col < 0 || col >= X[3]) continue;
                if (&out == &op.y)
                  acc[dense(n, k, oh, ow)] += double(in(x[offset(op.x, n, c, h, col)])) * in(w[offset(op.w, k, c, r, s)]);
                else if (&out == &op.x)
                  acc[dense(n, c, h, col)] += double(in(y[offset(op.y, n, k, oh, ow)])) * in(w[offset(op.w, k, c, r, s)]);
                else
                  acc[dense(k, c, r, s)] += double(in(x[offset(op.x, n, c, h, col)])) * in(y[offset(op.y, n, k, oh, ow)]);
              }
  for (std::int64_t a = 0; a < out.dims[0]; ++a)
    for (std::int64_t b = 0; b < out.dims[1]; ++b)
      for (std::int64_t c = 0; c < out.dims[2]; ++c)
        for (std::int64_t d = 0; d < out.dims[3]; ++d) {
          float& v = out_ptr[offset(out, a, b, c, d)];
          v = static_cast<float>(op.alpha * acc[dense(a, b, c, d)] + (op.beta == 0 ? 0.0 : op.beta * double(v)));
        }
}

inline cudnnStatus_t finalize(descriptor& d) {
  switch (d.type) {
  case CUDNN_BACKEND_TENSOR_DESCRIPTOR: {
    tensor t;
    if (!read_tensor(&d, t)) return CUDNN_STATUS_BAD_PARAM;
    break;
  }
  case CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR:
  case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR:
  case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR: {
    conv_op op;
    if (const auto s = read_conv(d, op); s != CUDNN_STATUS_SUCCESS) return s;
    break;
  }
  case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR:
    if (named(d, CUDNN_ATTR_OPERATIONGRAPH_OPS) == nullptr ||
        values<void*>(d, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE).size() != 1)
      return CUDNN_STATUS_BAD_PARAM;
    break;
  case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR:
    if (named(d, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH) == nullptr ||
        values<int>(d, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE).size() != 1)
      return CUDNN_STATUS_BAD_PARAM;
    break;
  case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR: {
    const auto* config = named(d, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG);
    if (config == nullptr || config->engine < 0 || get(config->graph) == nullptr ||
        values<void*>(d, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE).size() != 1)
      return CUDNN_STATUS_BAD_PARAM;
    conv_op op;
    if (const auto s = read_conv(*named(*config->graph, CUDNN_ATTR_OPERATIONGRAPH_OPS), op); s != CUDNN_STATUS_SUCCESS)
      return s;
    if (settings.packed_filters_only && !packed_krsc(op.w)) return CUDNN_STATUS_NOT_SUPPORTED;
    d.engine = config->engine;
    d.graph = config->graph;
    break;
  }
  case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR:
    if (values<std::int64_t>(d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64).size() !=
        values<void*>(d, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR).size())
      return CUDNN_STATUS_BAD_PARAM;
    break;
  default: break;
  }
  d.finalized = true;
  return CUDNN_STATUS_SUCCESS;
}

} // namespace cudnn_emulation

inline const char* cudnnGetErrorString(cudnnStatus_t s) {
  switch (s) {
  case CUDNN_STATUS_SUCCESS: return "CUDNN_STATUS_SUCCESS";
  case CUDNN_STATUS_NOT_INITIALIZED: return "CUDNN_STATUS_NOT_INITIALIZED";
  case CUDNN_STATUS_BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
  case CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED: return "CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED";
  case CUDNN_STATUS_NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED";
  case CUDNN_STATUS_EXECUTION_FAILED: return "CUDNN_STATUS_EXECUTION_FAILED";
  }
  return "CUDNN_STATUS_UNKNOWN";
}
inline cudnnStatus_t cudnnCreate(cudnnHandle_t* h) {
  *h = new cudnnContext{};
  return CUDNN_STATUS_SUCCESS;
}
inline cudnnStatus_t cudnnDestroy(cudnnHandle_t h) {
  delete h;
  return CUDNN_STATUS_SUCCESS;
}
inline cudnnStatus_t cudnnSetStream(cudnnHandle_t h, cudaStream_t s) {
  if (h == nullptr) return CUDNN_STATUS_NOT_INITIALIZED;
  h->stream = s;
  return CUDNN_STATUS_SUCCESS;
}
inline cudnnStatus_t cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t type, cudnnBackendDescriptor_t* d) {
  auto* p = new cudnn_emulation::descriptor{type, {}, false, -1, nullptr};
  cudnn_emulation::live().insert(p);
  *d = p;
  return CUDNN_STATUS_SUCCESS;
}
inline cudnnStatus_t cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t d) {
  auto* p = cudnn_emulation::get(d);
  if (p == nullptr) return CUDNN_STATUS_BAD_PARAM;
  cudnn_emulation::live().erase(p);
  delete p;
  return CUDNN_STATUS_SUCCESS;
}
inline cudnnStatus_t cudnnBackendSetAttribute(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                                              cudnnBackendAttributeType_t type, std::int64_t count, const void* values) {
  auto* p = cudnn_emulation::get(d);
  if (p == nullptr || p->finalized || count < 0 || (count > 0 && values == nullptr)) return CUDNN_STATUS_BAD_PARAM;
  const auto bytes = static_cast<std::size_t>(count) * cudnn_emulation::element_bytes(type);
  cudnn_emulation::attribute a{type, std::vector<unsigned char>(bytes), count};
  if (bytes > 0) std::memcpy(a.bytes.data(), values, bytes);
  p->attrs[name] = std::move(a);
  return CUDNN_STATUS_SUCCESS;
}
inline cudnnStatus_t cudnnBackendFinalize(cudnnBackendDescriptor_t d) {
  auto* p = cudnn_emulation::get(d);
  if (p == nullptr || p->finalized) return CUDNN_STATUS_BAD_PARAM;
  return cudnn_emulation::finalize(*p);
}
inline cudnnStatus_t cudnnBackendGetAttribute(cudnnBackendDescriptor_t const d, cudnnBackendAttributeName_t name,
                                              cudnnBackendAttributeType_t type, std::int64_t requested,
                                              std::int64_t* count, void* out) {
  using namespace cudnn_emulation;
  auto* p = get(d);
  if (p == nullptr || count == nullptr) return CUDNN_STATUS_BAD_PARAM;
  if (!p->finalized && p->type != CUDNN_BACKEND_ENGINE_DESCRIPTOR) return CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED;
  if (name == CUDNN_ATTR_ENGINEHEUR_RESULTS && p->type == CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR &&
      type == CUDNN_TYPE_BACKEND_DESCRIPTOR) {
    const bool fallback = values<int>(*p, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE)[0] == CUDNN_HEUR_MODE_FALLBACK;
    std::vector<int> engines;
    if (!settings.no_engines) engines = fallback ? std::vector<int>{2} : std::vector<int>{0, 1, 2};
    *count = std::min<std::int64_t>(requested, static_cast<std::int64_t>(engines.size()));
    if (requested == 0) *count = static_cast<std::int64_t>(engines.size());
    for (std::int64_t i = 0; i < std::min<std::int64_t>(requested, static_cast<std::int64_t>(engines.size())); ++i) {
      auto* config = get(static_cast<cudnnBackendDescriptor_t*>(out)[i]);
      if (config == nullptr || config->type != CUDNN_BACKEND_ENGINECFG_DESCRIPTOR) return CUDNN_STATUS_BAD_PARAM;
      config->engine = engines[static_cast<std::size_t>(i)];
      config->graph = named(*p, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH);
      config->finalized = true;
    }
    return CUDNN_STATUS_SUCCESS;
  }
  if (name == CUDNN_ATTR_ENGINECFG_ENGINE && p->type == CUDNN_BACKEND_ENGINECFG_DESCRIPTOR && requested == 1) {
    auto* engine = get(*static_cast<cudnnBackendDescriptor_t*>(out));
    if (engine == nullptr || engine->type != CUDNN_BACKEND_ENGINE_DESCRIPTOR) return CUDNN_STATUS_BAD_PARAM;
    engine->engine = p->engine;
    engine->graph = p->graph;
    engine->finalized = true;
    *count = 1;
    return CUDNN_STATUS_SUCCESS;
  }
  if (name == CUDNN_ATTR_ENGINE_NUMERICAL_NOTE && p->type == CUDNN_BACKEND_ENGINE_DESCRIPTOR &&
      type == CUDNN_TYPE_NUMERICAL_NOTE) {
    if (p->engine < 0) return CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED;
    std::vector<cudnnBackendNumericalNote_t> notes;
    if (p->engine == 0) notes = {CUDNN_NUMERICAL_NOTE_TENSOR_CORE};
    if (p->engine == 1) notes = {CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC};
    *count = std::min<std::int64_t>(requested, static_cast<std::int64_t>(notes.size()));
    std::copy_n(notes.begin(), *count, static_cast<cudnnBackendNumericalNote_t*>(out));
    return CUDNN_STATUS_SUCCESS;
  }
  if (name == CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE && p->type == CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR &&
      type == CUDNN_TYPE_INT64 && requested >= 1) {
    *static_cast<std::int64_t*>(out) = engine_workspace[p->engine];
    *count = 1;
    return CUDNN_STATUS_SUCCESS;
  }
  return CUDNN_STATUS_NOT_SUPPORTED; // not emulated
}
inline cudnnStatus_t cudnnBackendExecute(cudnnHandle_t h, cudnnBackendDescriptor_t plan, cudnnBackendDescriptor_t pack) {
  using namespace cudnn_emulation;
  auto* p = get(plan);
  auto* v = get(pack);
  if (h == nullptr) return CUDNN_STATUS_NOT_INITIALIZED;
  if (p == nullptr || v == nullptr || !p->finalized || !v->finalized || p->type != CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)
    return CUDNN_STATUS_BAD_PARAM;
  // The plan runs what its graph, operation and tensors say: each must still be alive.
  auto* graph = get(p->graph);
  auto* op_desc = graph != nullptr ? named(*graph, CUDNN_ATTR_OPERATIONGRAPH_OPS) : nullptr;
  conv_op op;
  if (op_desc == nullptr || read_conv(*op_desc, op) != CUDNN_STATUS_SUCCESS) return CUDNN_STATUS_BAD_PARAM;
  const auto uids = values<std::int64_t>(*v, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64);
  const auto ptrs = values<void*>(*v, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR);
  const auto ws = values<void*>(*v, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR);
  if (engine_workspace[p->engine] > 0 && (ws.size() != 1 || ws[0] == nullptr)) return CUDNN_STATUS_BAD_PARAM;
  float* data[3] = {nullptr, nullptr, nullptr};
  const tensor* tensors[3] = {&op.x, &op.w, &op.y};
  for (int t = 0; t < 3; ++t)
    for (std::size_t i = 0; i < uids.size(); ++i)
      if (uids[i] == tensors[t]->uid) {
        if (reinterpret_cast<std::uintptr_t>(ptrs[i]) % static_cast<std::uintptr_t>(tensors[t]->align) != 0)
          return CUDNN_STATUS_BAD_PARAM; // less aligned than the tensor promised
        data[t] = static_cast<float*>(ptrs[i]);
      }
  if (data[0] == nullptr || data[1] == nullptr || data[2] == nullptr) return CUDNN_STATUS_BAD_PARAM;
  ++settings.executions;
  const int engine = p->engine;
  cuda_emulation::enqueue([op, engine, x = data[0], w = data[1], y = data[2]] { run_conv(op, engine, x, w, y); });
  return CUDNN_STATUS_SUCCESS;
}
