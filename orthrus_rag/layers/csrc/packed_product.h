// A step's product by a Linear's weight from C++ (the layer loop, layer_loop.h, and its column-split form,
// layer_split.h): the few-row bf16 product (gemv_bf16.h) where the step asks for it, else oneDNN's packed copy where
// there is one, as linear.onednn_linear multiplies, else the dense weight.
#pragma once
#include "gemv_bf16.h"
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

// x times the dense `w` through the few-row bf16 product where `gemv` (the step's rows are few enough, layer_loop.h),
// else the packed weight `pw` where there is one (defined), else `w`; the same bias each way.
inline at::Tensor project(const at::Tensor& x, const at::Tensor& w, const at::Tensor* pw, const at::Tensor& b,
                          bool gemv = false) {
  if (gemv) return gemv_detail::product(x, w, b);
  if (pw) return packed(x, *pw, b);
  return at::linear(x, w, bias(b));
}

// x times a quantized weight (layers/quantized.py's QuantWeight): int8 with one scale per output row (group 0), or
// int4 in torch's packed layout with a scale and a zero per `group` inputs; torch's weight-only CPU kernels, as
// QuantWeight.matmul calls them. x: [T, in], contiguous.
// From `dense_from` rows (> 0) an int8 weight is widened to x's dtype and multiplied by the dense product, the row
// scales applied after (quantized.py's QuantWeight.matmul, which owns the threshold).
inline at::Tensor quantized(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& qs, int64_t group,
                            const at::Tensor& b, int64_t dense_from = 0) {
  at::Tensor y;
  if (group == 0 && dense_from > 0 && x.size(0) >= dense_from)
    y = at::linear(x, qw.to(x.scalar_type())).mul_(qs);
  else
    y = group > 0 ? at::_weight_int4pack_mm_for_cpu(x, qw, group, qs) : at::_weight_int8pack_mm(x, qw, qs);
  if (b.numel() > 0) y.add_(b);
  return y;
}
}  // namespace loop_detail
