// Torch bindings of the CPU causal product (csrc/cpu/causal_product.h).
// The Python side (kernelstudy/core/cpu_backend.py) validates arguments first; the checks here
// only guard the kernel against misuse. Narrow ATen/pybind includes instead of
// <torch/extension.h> keep the build at about a third of the time.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <cstdint>
#include <tuple>

#include "causal_product.h"
#include "check_messages.h"

namespace {

namespace py = pybind11;
using ks_messages::dtype_name;
using ks_messages::shape;

// Ask Linux for transparent huge pages on a large output before it is first written: a
// fresh 32 MB buffer otherwise costs thousands of page faults, a large part of the run time.
void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t huge = uintptr_t(2) << 20;
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + huge - 1) & ~(huge - 1);
  const uintptr_t last = (begin + t.nbytes()) & ~(huge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
                    "q, k and v must be CPU tensors");
  TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                   "q, k and v must share one dtype");
  TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble,
                   "q, k and v must be float32 or float64, got ", dtype_name(q.scalar_type()));
  TORCH_CHECK_VALUE(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 &&
                        v.sizes().slice(0, 3) == q.sizes().slice(0, 3),
                    "expected q, k: (B,H,N,F) and v: (B,H,N,M), got ", shape(q.sizes()), ", ",
                    shape(k.sizes()), ", ", shape(v.sizes()));
}

at::Tensor new_output(const at::Tensor& like) {
  at::Tensor out = at::empty(like.sizes(), like.options());
  advise_huge_pages(out);
  return out;
}

// out (B,H,N,M) = sum_{j<=i} (q_i . k_j) v_j, or over j >= i with `reverse`;
// q, k: (B,H,N,F), v: (B,H,N,M), all float32 or all float64 on the CPU.
at::Tensor causal_product(at::Tensor q, at::Tensor k, at::Tensor v, bool reverse,
                          int64_t threads) {
  check_inputs(q, k, v);
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  const int64_t b = q.size(0), h = q.size(1), n = q.size(2), f = q.size(3), m = v.size(3);
  // no features: every score is 0 (and the kernel would index its empty packing buffers)
  if (f == 0) return at::zeros(v.sizes(), v.options());
  at::Tensor out = new_output(v);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_product", [&] {
    ks_cpu::causal_product<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                                     v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), b * h, n,
                                     f, m, reverse, static_cast<int>(threads));
  });
  return out;
}

// (dq, dk, dv) of out = causal_product(q, k, v) given grad = dL/dout (B,H,N,M); a gradient
// not asked for comes back as None. Recomputes everything from q, k, v and grad:
//   dq = causal(grad, v, k),  dk = anticausal(v, grad, q),  dv = anticausal(k, q, grad),
// dk and dv in one pass over their shared state.
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_product_backward(
    at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor grad, bool need_dq, bool need_dk,
    bool need_dv, int64_t threads) {
  check_inputs(q, k, v);
  TORCH_CHECK_VALUE(grad.device().is_cpu() && grad.scalar_type() == v.scalar_type() &&
                        grad.sizes() == v.sizes(),
                    "grad must be a CPU tensor of the dtype and shape of v, got ",
                    dtype_name(grad.scalar_type()), " ", shape(grad.sizes()));
  at::Tensor dq, dk, dv;
  if (need_dq) dq = causal_product(grad, v, k, false, threads);
  if (need_dk && need_dv) {
    q = q.contiguous();
    k = k.contiguous();
    v = v.contiguous();
    grad = grad.contiguous();
    dk = new_output(k);
    dv = new_output(v);
    const int64_t b = q.size(0), h = q.size(1), n = q.size(2), f = q.size(3), m = v.size(3);
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_product_backward", [&] {
      ks_cpu::causal_product_backward_kv<scalar_t>(
          q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
          grad.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), b * h, n,
          f, m, static_cast<int>(threads));
    });
  } else if (need_dk) {
    dk = causal_product(v, grad, q, true, threads);
  } else if (need_dv) {
    dv = causal_product(k, q, grad, true, threads);
  }
  return {dq, dk, dv};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kernelstudy: causal linear-attention product on the CPU (C++/OpenMP)";
  m.def("causal_product", &causal_product, "causal (or anti-causal) product",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("reverse") = false,
        py::arg("threads") = 1, py::call_guard<py::gil_scoped_release>());
  m.def("causal_product_backward", &causal_product_backward,
        "gradients (dq, dk, dv) of the causal product; None where not needed", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("grad"), py::arg("need_dq") = true,
        py::arg("need_dk") = true, py::arg("need_dv") = true, py::arg("threads") = 1,
        py::call_guard<py::gil_scoped_release>());
#ifdef _OPENMP
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif
}
