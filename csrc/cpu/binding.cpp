// Torch bindings of the CPU causal product (csrc/cpu/causal_product.h).
// The Python side (kernelstudy/core/cpu_backend.py) validates arguments first; the checks here
// only guard the kernel against misuse.
#include <torch/extension.h>

#include "causal_product.h"

namespace {

// out (B,H,N,M) = sum_{j<=i} (q_i . k_j) v_j, or over j >= i with `reverse`;
// q, k: (B,H,N,F), v: (B,H,N,M), all float32 or all float64 on the CPU.
torch::Tensor causal_product(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool reverse,
                             int64_t threads) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
                    "q, k and v must be CPU tensors");
  TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                   "q, k and v must share one dtype");
  TORCH_CHECK_TYPE(q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kDouble,
                   "q, k and v must be float32 or float64, got ", q.scalar_type());
  TORCH_CHECK_VALUE(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 &&
                        v.sizes().slice(0, 3) == q.sizes().slice(0, 3),
                    "expected q, k: (B,H,N,F) and v: (B,H,N,M), got ", q.sizes(), ", ",
                    k.sizes(), ", ", v.sizes());
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  const int64_t b = q.size(0), h = q.size(1), n = q.size(2), f = q.size(3), m = v.size(3);
  auto out = torch::empty({b, h, n, m}, v.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_product", [&] {
    ks_cpu::causal_product<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                                     v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), b * h, n,
                                     f, m, reverse, static_cast<int>(threads));
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kernelstudy: causal linear-attention product on the CPU (C++/OpenMP)";
  m.def("causal_product", &causal_product, "causal (or anti-causal) product",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("reverse") = false,
        py::arg("threads") = 1, py::call_guard<py::gil_scoped_release>());
#ifdef _OPENMP
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif
}
