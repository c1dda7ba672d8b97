// A step's product by a Linear's weight from C++ (the layer loop, layer_loop.h, and its column-split form,
// layer_split.h): oneDNN's packed copy where there is one, as linear.onednn_linear multiplies, else the dense weight.
#pragma once
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <optional>

namespace loop_detail {
// mkldnn::_linear_pointwise, what linear.onednn_linear calls from Python: a dense input against a weight packed in
// oneDNN's blocked layout (layers/linear.py). Looked up once; each call is then one unboxed dispatch.
// NOTE: c10::string_view, not std::string_view: the two are one type only in recent torch (typed<> checks it)
using PointwiseFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                               c10::string_view, c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);

inline const c10::TypedOperatorHandle<PointwiseFn>& pointwise() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<PointwiseFn>();
  return op;
}

// A bias of zero elements stands for "none" (pybind's vector of tensors has no None).
inline std::optional<at::Tensor> bias(const at::Tensor& b) {
  return b.numel() == 0 ? std::nullopt : std::optional<at::Tensor>(b);
}

// x times the packed weight `pw`, plus the bias `b` (zero elements: none).
inline at::Tensor packed(const at::Tensor& x, const at::Tensor& pw, const at::Tensor& b) {
  return pointwise().call(x, pw, bias(b), "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// x times the packed weight `pw` where there is one (defined), else the dense `w`; the same bias either way.
inline at::Tensor project(const at::Tensor& x, const at::Tensor& w, const at::Tensor* pw, const at::Tensor& b) {
  if (pw) return packed(x, *pw, b);
  return at::linear(x, w, bias(b));
}
}  // namespace loop_detail
