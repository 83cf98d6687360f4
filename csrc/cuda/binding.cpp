// Torch bindings of the CUDA linear-attention core (launchers.h, linear_attention.cu). The
// headers are ATen's and pybind11's alone, not torch/extension.h (the C++ frontend): half the
// compile time.
// The Python side (kernelstudy/core/cuda_backend.py) validates arguments first; the checks here
// guard the kernels against misuse. Every call runs on the current CUDA stream of the inputs'
// device; workspaces come from torch's caching allocator.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "check_messages.h"
#include "launchers.h"

namespace {

using ks_messages::device_name;
using ks_messages::dtype_name;
using ks_messages::number;
using ks_messages::shape;

ks_cuda::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return ks_cuda::DType::kFloat32;
    case at::kHalf:
      return ks_cuda::DType::kFloat16;
    case at::kBFloat16:
      return ks_cuda::DType::kBFloat16;
    default:
      break;
  }
  TORCH_CHECK_TYPE(false, "expected float32, float16 or bfloat16 tensors, got ",
                   dtype_name(t.scalar_type()));
  return ks_cuda::DType::kFloat32;  // unreachable
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "kernelstudy CUDA kernel ", what, " failed: ",
              cudaGetErrorString(err));
}

// A (B,H,N,D) CUDA tensor on like's device, of dtype `dtype` (like's unless given).
void check_sequence(const at::Tensor& t, const char* name, const at::Tensor& like,
                    c10::optional<at::ScalarType> dtype = c10::nullopt) {
  const at::ScalarType want = dtype.value_or(like.scalar_type());
  TORCH_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " must be on ", device_name(like.device()),
                    ", got ", device_name(t.device()));
  TORCH_CHECK_TYPE(t.scalar_type() == want, name, " must have dtype ", dtype_name(want), ", got ",
                   dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == 4, name, " must be (B,H,N,D), got ", shape(t.sizes()));
  // the kernels index within a 64-row tile in 32 bits (load_tile): 64 * D < 2^31
  TORCH_CHECK_VALUE(t.size(3) < (int64_t{1} << 24), name,
                    "'s last dimension must be below 2^24, got ", number(t.size(3)));
}

void check_rows(const at::Tensor& t, const char* name, const at::Tensor& like, int64_t seq) {
  TORCH_CHECK_VALUE(t.size(0) == like.size(0) && t.size(1) == like.size(1) && t.size(2) == seq,
                    name, " must be (", number(like.size(0)), ",", number(like.size(1)), ",",
                    number(seq), ",D), got ", shape(t.sizes()));
}

at::TensorOptions f32(const at::Tensor& like) { return like.options().dtype(at::kFloat); }

// An fp32 (B,H,len) tensor for x (B,H,N,D) on x's device, contiguous (len: N unless given; dims
// names it in messages), or nullopt for none.
c10::optional<at::Tensor> checked_rows(const c10::optional<at::Tensor>& w, const char* name,
                                       const at::Tensor& x, int64_t len = -1,
                                       const char* dims = "(B,H,N)") {
  if (!w.has_value() || !w->defined()) return c10::nullopt;
  if (len < 0) len = x.size(2);
  TORCH_CHECK_TYPE(w->scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK_VALUE(w->device() == x.device(), name, " must be on ", device_name(x.device()));
  TORCH_CHECK_VALUE(w->dim() == 3 && w->size(0) == x.size(0) && w->size(1) == x.size(1) &&
                        w->size(2) == len,
                    name, " must be ", dims, " = (", number(x.size(0)), ",", number(x.size(1)), ",",
                    number(len), "), got ", shape(w->sizes()));
  return w->contiguous();
}

// A key padding mask (B, N) bool for the sequences of x (B,H,N,D), contiguous; undefined for
// none.
at::Tensor checked_mask(const c10::optional<at::Tensor>& mask, const at::Tensor& x) {
  if (!mask.has_value() || !mask->defined()) return at::Tensor();
  const int64_t b = x.size(0), n = x.size(2);
  TORCH_CHECK_TYPE(mask->scalar_type() == at::kBool, "key_padding_mask must be bool");
  TORCH_CHECK_VALUE(mask->device() == x.device(), "key_padding_mask must be on ",
                    device_name(x.device()));
  TORCH_CHECK_VALUE(mask->dim() == 2 && mask->size(0) == b && mask->size(1) == n,
                    "key_padding_mask must be (B, N) = (", number(b), ", ", number(n), "), got ",
                    shape(mask->sizes()));
  return mask->contiguous();
}

// The results of a read-out from q (B,H,N,F): out (B,H,N,M) in `out_type` and, with
// `with_den`, den (B,H,N) fp32. `done` where there is nothing to compute (N·M = 0 or F = 0): out
// and den are then zero (M = 0 with N > 0 still gives a defined den for the backward's d).
struct Readout {
  at::Tensor out, den;
  bool done;
};

Readout readout(const at::Tensor& q, int64_t m, at::ScalarType out_type, bool with_den) {
  const int64_t b = q.size(0), h = q.size(1), n = q.size(2), f = q.size(3);
  Readout r{at::empty({b, h, n, m}, q.options().dtype(out_type)),
            with_den ? at::empty({b, h, n}, f32(q)) : at::Tensor(), false};
  if (r.out.numel() == 0 || f == 0) {
    r.out.zero_();
    if (with_den) r.den.zero_();
    r.done = true;
  }
  return r;
}

// out (B,H,N,M) = sum_{j<=i} (q_i . k_j) v_j (j >= i with `reverse`), in fp32 if `out_fp32`
// else in the inputs' dtype; den (B,H,N) fp32 = sum_{j<=i} q_i . k_j if `with_den` (else None).
// `normalize` divides out by den + eps. walk_blocks > 0 selects the walk kernel, `mma_walk` its
// register form (launchers.h).
std::vector<at::Tensor> causal_product(at::Tensor q, at::Tensor k, at::Tensor v, bool reverse,
                                       bool out_fp32, bool with_den, bool normalize, double eps,
                                       int64_t walk_blocks, bool mma_walk) {
  TORCH_CHECK_VALUE(walk_blocks >= 0, "walk_blocks must be >= 0, got ", number(walk_blocks));
  check_sequence(q, "q", q);
  check_sequence(k, "k", q);
  check_sequence(v, "v", q);
  const int64_t b = q.size(0), h = q.size(1), n = q.size(2), f = q.size(3), m = v.size(3);
  check_rows(k, "k", q, n);
  check_rows(v, "v", q, n);
  TORCH_CHECK_VALUE(k.size(3) == f, "q and k must have the same last dimension");
  const c10::cuda::CUDAGuard guard(q.device());
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  auto [out, den, done] = readout(q, m, out_fp32 ? at::kFloat : q.scalar_type(), with_den);
  if (done) return {out, den};
  auto ws = at::empty({ks_cuda::causal_workspace_floats(dtype_of(q), b * h, n, f, m, walk_blocks,
                                                    mma_walk)},
                      f32(q));
  check_launch(ks_cuda::causal_product(dtype_of(q), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                       out.data_ptr(), out_fp32,
                                       with_den ? den.data_ptr<float>() : nullptr, normalize,
                                       static_cast<float>(eps), ws.data_ptr<float>(), b * h, n, f,
                                       m, reverse, walk_blocks, mma_walk,
                                       c10::cuda::getCurrentCUDAStream()),
               "causal_product");
  return {out, den};
}

// [dq, dk, dv] of the causal product for g = dL/dout (B,H,N,M), from the fused backward: dq, dk
// (B,H,N,F) in fp32 if `out_fp32` else in the inputs' dtype, dv (B,H,N,M) in fp32 if `dv_fp32`
// (None: as out_fp32) else in the inputs' dtype (the normalized backward adds terms to dq and dk
// in fp32, not to dv). walk_blocks > 0 selects the walk's fused backward, `mma_walk` its register
// form, `walks_together` its two walks in one grid where that applies (launchers.h).
std::vector<at::Tensor> causal_backward(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g,
                                        bool out_fp32, c10::optional<bool> dv_fp32,
                                        int64_t walk_blocks, bool mma_walk, bool walks_together) {
  TORCH_CHECK_VALUE(walk_blocks >= 0, "walk_blocks must be >= 0, got ", number(walk_blocks));
  const bool dv32 = dv_fp32.value_or(out_fp32);
  TORCH_CHECK_VALUE(out_fp32 || !dv32, "dv_fp32=True needs out_fp32=True");
  check_sequence(q, "q", q);
  check_sequence(k, "k", q);
  check_sequence(v, "v", q);
  check_sequence(g, "g", q);
  const int64_t b = q.size(0), h = q.size(1), n = q.size(2), f = q.size(3), m = v.size(3);
  check_rows(k, "k", q, n);
  check_rows(v, "v", q, n);
  check_rows(g, "g", q, n);
  TORCH_CHECK_VALUE(k.size(3) == f, "q and k must have the same last dimension");
  TORCH_CHECK_VALUE(g.size(3) == m, "g and v must have the same last dimension");
  const c10::cuda::CUDAGuard guard(q.device());
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  g = g.contiguous();
  const auto opts = out_fp32 ? f32(q) : q.options();
  auto dq = at::empty({b, h, n, f}, opts);
  auto dk = at::empty({b, h, n, f}, opts);
  auto dv = at::empty({b, h, n, m}, dv32 ? f32(q) : q.options());
  if (b * h * n == 0) return {dq, dk, dv};
  if (f == 0 || m == 0) return {dq.zero_(), dk.zero_(), dv.zero_()};
  auto ws = at::empty(
      {ks_cuda::causal_backward_workspace_floats(dtype_of(q), b * h, n, f, m, walk_blocks,
                                                 mma_walk, walks_together)},
      f32(q));
  check_launch(ks_cuda::causal_backward(dtype_of(q), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                        g.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                        out_fp32, dv32, ws.data_ptr<float>(), b * h, n, f, m,
                                        walk_blocks, mma_walk, walks_together,
                                        c10::cuda::getCurrentCUDAStream()),
               "causal_backward");
  return {dq, dk, dv};
}

// state (B,H,F*M+F) fp32: S = sum_j keep_j k_j v_j^T (row-major F x M), then z = sum_j keep_j k_j.
// v in k's dtype, or float32 beside a 16-bit k (the backward's fp32 row terms: fp32 tiles).
at::Tensor full_state(at::Tensor k, at::Tensor v, c10::optional<at::Tensor> key_padding_mask) {
  check_sequence(k, "k", k);
  const bool v_fp32 = v.scalar_type() == at::kFloat && k.scalar_type() != at::kFloat;
  check_sequence(v, "v", k, v_fp32 ? at::kFloat : k.scalar_type());
  const int64_t b = k.size(0), h = k.size(1), n = k.size(2), f = k.size(3), m = v.size(3);
  check_rows(v, "v", k, n);
  const c10::cuda::CUDAGuard guard(k.device());
  k = k.contiguous();
  v = v.contiguous();
  const at::Tensor mask = checked_mask(key_padding_mask, k);
  auto state = at::empty({b, h, f * m + f}, f32(k));
  if (state.numel() == 0) return state;
  if (m == 0 || n == 0) return state.zero_();
  auto ws = at::empty({ks_cuda::full_state_workspace_floats(b * h, n, f, m)}, f32(k));
  check_launch(ks_cuda::full_state(dtype_of(k), k.data_ptr(), v.data_ptr(), v_fp32,
                                   mask.defined() ? mask.data_ptr<bool>() : nullptr, h,
                                   state.data_ptr<float>(), ws.data_ptr<float>(), b * h, n, f, m,
                                   c10::cuda::getCurrentCUDAStream()),
               "full_state");
  return state;
}

// out (B,H,N,M) = q . S (divided by q . z + eps with `normalize`; plus bias (B,H,M) fp32 where
// given), in fp32 with `out_fp32`, else in `out_dtype` (q's unless given: float16 or bfloat16
// for a float32 q, rounded once); den (B,H,N) = q . z. Rows whose key_padding_mask (B,N) is
// False come out as zeros (out and den).
std::vector<at::Tensor> full_apply(at::Tensor q, at::Tensor state, int64_t m, bool out_fp32,
                                   bool with_den, bool normalize, double eps,
                                   c10::optional<at::Tensor> bias,
                                   c10::optional<at::Tensor> key_padding_mask,
                                   c10::optional<at::ScalarType> out_dtype) {
  check_sequence(q, "q", q);
  const int64_t b = q.size(0), h = q.size(1), n = q.size(2), f = q.size(3);
  TORCH_CHECK_TYPE(state.scalar_type() == at::kFloat, "state must be float32");
  TORCH_CHECK_VALUE(state.device() == q.device(), "state must be on ", device_name(q.device()));
  TORCH_CHECK_VALUE(m >= 0 && state.dim() == 3 && state.size(0) == b && state.size(1) == h &&
                        state.size(2) == f * m + f,
                    "state must be (B,H,F*M+F) = (", number(b), ",", number(h), ",",
                    number(f * m + f), "), got ", shape(state.sizes()));
  at::ScalarType out_type = out_fp32 ? at::kFloat : q.scalar_type();
  const bool q_fp32 = out_dtype.has_value() && *out_dtype != q.scalar_type();
  if (q_fp32) {
    TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat && !out_fp32 &&
                         (*out_dtype == at::kHalf || *out_dtype == at::kBFloat16),
                     "out_dtype must be q's dtype, or float16 or bfloat16 for a float32 q "
                     "without out_fp32, got ",
                     dtype_name(*out_dtype), " for q of ", dtype_name(q.scalar_type()));
    out_type = *out_dtype;
  }
  const at::Tensor add = checked_rows(bias, "bias", q, m, "(B,H,M)").value_or(at::Tensor());
  const c10::cuda::CUDAGuard guard(q.device());
  q = q.contiguous();
  state = state.contiguous();
  const at::Tensor mask = checked_mask(key_padding_mask, q);
  auto [out, den, done] = readout(q, m, out_type, with_den);
  if (done) {  // F = 0 or nothing to write: the bias alone on the kept rows
    if (add.defined() && out.numel() > 0) {
      out.copy_(add.unsqueeze(2).expand({b, h, n, m}));
      if (mask.defined()) out.mul_(mask.view({b, 1, n, 1}));
    }
    return {out, den};
  }
  // the entry of the attention's dtype: q's, or out's for an fp32 q read into 16 bits
  check_launch(ks_cuda::full_apply(dtype_of(q_fp32 ? out : q), q.data_ptr(), q_fp32,
                                   state.data_ptr<float>(),
                                   add.defined() ? add.data_ptr<float>() : nullptr,
                                   mask.defined() ? mask.data_ptr<bool>() : nullptr, h,
                                   out.data_ptr(), out_fp32,
                                   with_den ? den.data_ptr<float>() : nullptr, normalize,
                                   static_cast<float>(eps), b * h, n, f, m,
                                   c10::cuda::getCurrentCUDAStream()),
               "full_apply");
  return {out, den};
}

// out (B,H,N,F): out_i = base_i + post_i * sum_{j<=i} pre_j x_j (j >= i with `reverse`), in
// fp32 if `out_fp32` else in x's dtype (rounded once); base (B,H,N,F) fp32 or None (= 0).
at::Tensor scaled_cumsum(at::Tensor x, c10::optional<at::Tensor> pre,
                         c10::optional<at::Tensor> post, bool reverse,
                         c10::optional<at::Tensor> base, bool out_fp32) {
  check_sequence(x, "x", x);
  const int64_t b = x.size(0), h = x.size(1), n = x.size(2), f = x.size(3);
  const c10::cuda::CUDAGuard guard(x.device());
  x = x.contiguous();
  auto pre_c = checked_rows(pre, "pre", x);
  auto post_c = checked_rows(post, "post", x);
  at::Tensor base_c;
  if (base.has_value() && base->defined()) {
    TORCH_CHECK_TYPE(base->scalar_type() == at::kFloat, "base must be float32");
    TORCH_CHECK_VALUE(base->device() == x.device(), "base must be on ", device_name(x.device()));
    TORCH_CHECK_VALUE(base->sizes() == x.sizes(), "base must be (B,H,N,F) = ",
                      shape(x.sizes()), ", got ", shape(base->sizes()));
    base_c = base->contiguous();
  }
  auto out = at::empty({b, h, n, f}, out_fp32 ? f32(x) : x.options());
  if (out.numel() == 0) return out;
  auto ws = at::empty({ks_cuda::cumsum_workspace_floats(b * h, n, f)}, f32(x));
  check_launch(ks_cuda::scaled_cumsum(dtype_of(x), x.data_ptr(),
                                      pre_c ? pre_c->data_ptr<float>() : nullptr,
                                      post_c ? post_c->data_ptr<float>() : nullptr,
                                      base_c.defined() ? base_c.data_ptr<float>() : nullptr,
                                      out.data_ptr(), out_fp32, ws.data_ptr<float>(), b * h, n,
                                      f, reverse, c10::cuda::getCurrentCUDAStream()),
               "scaled_cumsum");
  return out;
}

// [dnum, dden] of the normalized attention out = num / d, d = den + eps, for g = dL/dout
// (B,H,N,M) and out (B,H,N,M) in one dtype, den (B,H,N) fp32: dnum = g / d (B,H,N,M) in bf16
// for bf16 inputs, else fp32 (the products' operand type), dden = -(g . out) / d (B,H,N) fp32.
// With `dden_column`: [dnum (B,H,N,M+1) with dden in its last column, in dnum's dtype, None].
// With `dnum_fp32`, dnum is fp32 for every input dtype.
std::vector<at::Tensor> normalized_grad(at::Tensor g, at::Tensor out, at::Tensor den,
                                        double eps, bool dden_column, bool dnum_fp32) {
  check_sequence(g, "g", g);
  check_sequence(out, "out", g);
  TORCH_CHECK_VALUE(out.sizes() == g.sizes(), "out must be ", shape(g.sizes()), ", got ",
                    shape(out.sizes()));
  const int64_t b = g.size(0), h = g.size(1), n = g.size(2), m = g.size(3);
  den = checked_rows(den, "den", g).value();  // fp32 (B,H,N), contiguous
  const c10::cuda::CUDAGuard guard(g.device());
  g = g.contiguous();
  out = out.contiguous();
  const bool bf16 = g.scalar_type() == at::kBFloat16 && !dnum_fp32;
  auto dnum = at::empty({b, h, n, m + dden_column}, bf16 ? g.options() : f32(g));
  auto dden = dden_column ? at::Tensor() : at::empty({b, h, n}, f32(g));
  check_launch(ks_cuda::normalized_grad(dtype_of(g), g.data_ptr(), out.data_ptr(),
                                        den.data_ptr<float>(), static_cast<float>(eps),
                                        dnum.data_ptr(), dnum_fp32,
                                        dden_column ? nullptr : dden.data_ptr<float>(),
                                        b * h * n, m, c10::cuda::getCurrentCUDAStream()),
               "normalized_grad");
  return {dnum, dden};
}

// The walk kernels for operands like `q` (its dtype and device) with F = f, M = m, `mma_walk`
// and `walks_together` (launchers.h): {"product": (kernel, blocks per SM), "dkv": (kernel,
// blocks per SM)}, kernel 0 where none runs.
py::dict walk_kernels(const at::Tensor& q, int64_t f, int64_t m, bool mma_walk,
                      bool walks_together) {
  TORCH_CHECK_VALUE(q.is_cuda(), "q must be a CUDA tensor");
  TORCH_CHECK_VALUE(f > 0 && m > 0, "f and m must be positive, got f=", number(f),
                    ", m=", number(m));
  const c10::cuda::CUDAGuard guard(q.device());
  ks_cuda::WalkKernels w;
  check_launch(ks_cuda::walk_kernels(dtype_of(q), f, m, mma_walk, walks_together, &w),
               "walk_kernels");
  py::dict out;
  out["product"] = py::make_tuple(w.product, w.product_blocks_per_sm);
  out["dkv"] = py::make_tuple(w.dkv, w.dkv_blocks_per_sm);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kernelstudy: linear-attention core on CUDA (chunked, tensor cores, fp32 accumulation)";
  m.def("causal_product", &causal_product, "causal (or anti-causal) product, optional normalizer",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("reverse") = false,
        py::arg("out_fp32") = true, py::arg("with_den") = false, py::arg("normalize") = false,
        py::arg("eps") = 1e-6, py::arg("walk_blocks") = 0, py::arg("mma_walk") = false);
  m.def("causal_backward", &causal_backward, "fused gradients [dq, dk, dv] of the causal product",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("out_fp32") = false,
        py::arg("dv_fp32") = py::none(), py::arg("walk_blocks") = 0, py::arg("mma_walk") = false,
        py::arg("walks_together") = true);
  m.def("full_state", &full_state, "non-causal state [S | z] with key padding", py::arg("k"),
        py::arg("v"), py::arg("key_padding_mask") = py::none());
  m.def("full_apply", &full_apply,
        "non-causal read-out q . S (optionally normalized, or plus a bias), padded rows zero",
        py::arg("q"), py::arg("state"), py::arg("m"), py::arg("out_fp32") = true,
        py::arg("with_den") = false, py::arg("normalize") = false, py::arg("eps") = 1e-6,
        py::arg("bias") = py::none(), py::arg("key_padding_mask") = py::none(),
        py::arg("out_dtype") = py::none());
  m.def("scaled_cumsum", &scaled_cumsum,
        "deterministic weighted cumulative sum over N, added to base, fp32 or x's dtype",
        py::arg("x"), py::arg("pre") = py::none(), py::arg("post") = py::none(),
        py::arg("reverse") = false, py::arg("base") = py::none(), py::arg("out_fp32") = true);
  m.def("normalized_grad", &normalized_grad,
        "[g / d, -(g . out) / d] for d = den + eps: the normalized backward's row terms",
        py::arg("g"), py::arg("out"), py::arg("den"), py::arg("eps"),
        py::arg("dden_column") = false, py::arg("dnum_fp32") = false);
  m.def("walk_kernels", &walk_kernels,
        "the walk kernels (product, dk/dv) for q's dtype, F and M, with blocks per SM",
        py::arg("q"), py::arg("f"), py::arg("m"), py::arg("mma_walk") = false,
        py::arg("walks_together") = true);
  m.attr("chunk") = ks_cuda::kChunk;
}
