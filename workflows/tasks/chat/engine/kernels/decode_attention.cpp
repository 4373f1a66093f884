// Decode attention over the engine's slot cache, fp32, on a CPU: each decode token's query heads against its
// own slot's first `length` positions, reading each key and value once (workflows.tasks.chat.engine.kernels).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;  // ATen's SIMD type, the width the build's flags give (kernels/__init__.py)

// One (token, key/value head) item: its `group` query heads over positions [0, len) of one slot's keys and
// values. Each head in turn: its scores (NV vectors of q in registers, one reduction a key), its softmax, then
// its weighted sum of the values (NV accumulators in registers). The item's keys and values come from memory
// once, for the first head; the other heads read them again from the core's cache (len x dim floats each).
template <int NV>
void attend_item(const float* q, const float* k, const float* v, float* o, float* scores, int64_t group,
                 int64_t len, float scale) {
  constexpr int64_t W = Vec::size();
  constexpr int64_t dim = NV * W;
  for (int64_t g = 0; g < group; ++g) {
    Vec qv[NV];
    for (int j = 0; j < NV; ++j) qv[j] = Vec::loadu(q + g * dim + j * W) * Vec(scale);
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < len; ++l) {
      const float* kl = k + l * dim;
      Vec acc = qv[0] * Vec::loadu(kl);
      for (int j = 1; j < NV; ++j) acc = at::vec::fmadd(qv[j], Vec::loadu(kl + j * W), acc);
      const float s = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, acc);
      scores[l] = s;
      top = std::max(top, s);
    }
    at::vec::map([top](Vec s) { return (s - Vec(top)).exp_u20(); }, scores, scores, len);
    const float sum = at::vec::reduce_all<float>([](Vec a, Vec b) { return a + b; }, scores, len);
    Vec out[NV];
    for (int j = 0; j < NV; ++j) out[j] = Vec(0.f);
    for (int64_t l = 0; l < len; ++l) {
      const float* vl = v + l * dim;
      const Vec p(scores[l]);
      for (int j = 0; j < NV; ++j) out[j] = at::vec::fmadd(p, Vec::loadu(vl + j * W), out[j]);
    }
    const Vec inv(1.f / sum);
    for (int j = 0; j < NV; ++j) (out[j] * inv).store(o + g * dim + j * W);
  }
}

// The same for a head dim that is no multiple of the vector width (scalar, rare)
void attend_item_any(const float* q, const float* k, const float* v, float* o, float* scores, int64_t group,
                     int64_t dim, int64_t len, float scale) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * dim;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < len; ++l) {
      float s = 0.f;
      for (int64_t d = 0; d < dim; ++d) s += qg[d] * k[l * dim + d];
      scores[l] = s * scale;
      top = std::max(top, scores[l]);
    }
    float sum = 0.f;
    for (int64_t l = 0; l < len; ++l) sum += (scores[l] = std::exp(scores[l] - top));
    float* og = o + g * dim;
    std::fill(og, og + dim, 0.f);
    for (int64_t l = 0; l < len; ++l)
      for (int64_t d = 0; d < dim; ++d) og[d] += scores[l] * v[l * dim + d];
    for (int64_t d = 0; d < dim; ++d) og[d] /= sum;
  }
}

// q [n, kv_heads, group, dim]; keys, values [slots, kv_heads, capacity, dim] (a layer's whole cache);
// slots, lengths [n] int64: token i attends to positions [0, lengths[i]) of slot slots[i].
// Returns [n, kv_heads, group, dim].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& slots, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat, "decode_attention: fp32 only");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(), "decode_attention: shapes");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous(), "decode_attention: layout");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && slots.is_contiguous() &&
                  lengths.is_contiguous(), "decode_attention: slots and lengths are int64");
  const int64_t n = q.size(0), heads = q.size(1), group = q.size(2), dim = q.size(3);
  const int64_t capacity = keys.size(2);
  TORCH_CHECK(keys.size(1) == heads && keys.size(3) == dim && slots.numel() == n && lengths.numel() == n,
              "decode_attention: shapes");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < keys.size(0) && lp[i] >= 1 && lp[i] <= capacity,
                "decode_attention: slot or length out of the cache");
  }
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  // work items (token, head), longest first, taken one at a time by whichever thread is free: one long
  // row does not leave the other threads idle while it reads its positions
  const int64_t items = n * heads;
  std::vector<int64_t> order(items);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lp[a / heads] > lp[b / heads]; });
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scores(capacity);
    for (int64_t w; (w = next.fetch_add(1)) < items;) {
      const int64_t i = order[w], t = i / heads, h = i % heads, len = lp[t];
      const float* ki = kp + (sp[t] * heads + h) * capacity * dim;
      const float* vi = vp + (sp[t] * heads + h) * capacity * dim;
      const float* qi = qp + i * group * dim;
      float* oi = op + i * group * dim;
      switch (dim == Vec::size() * (dim / Vec::size()) ? dim / Vec::size() : 0) {
        case 2: attend_item<2>(qi, ki, vi, oi, scores.data(), group, len, sc); break;
        case 4: attend_item<4>(qi, ki, vi, oi, scores.data(), group, len, sc); break;
        case 8: attend_item<8>(qi, ki, vi, oi, scores.data(), group, len, sc); break;
        case 16: attend_item<16>(qi, ki, vi, oi, scores.data(), group, len, sc); break;
        default: attend_item_any(qi, ki, vi, oi, scores.data(), group, dim, len, sc);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(workflows_kernels, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor slots, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(workflows_kernels, CPU, m) { m.impl("decode_attention", &decode_attention); }
