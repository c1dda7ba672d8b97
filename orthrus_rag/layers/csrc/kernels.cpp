// The engine's one CPU extension (layers/cpu_extension.py builds it): every kernel in one translation unit (one
// build, not six: each costs ~30-60 s of compiling on a fresh machine) and the functions Python calls.
#include "decode_attention.h"
#include "prefill_attention.h"
#include "elementwise.h"
#include "sampling.h"
#include "lora.h"
#include "layer_loop.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", torch::wrap_pybind_function(decode_attention), "decode_attention");
  m.def("decode_attention_bf16_body", torch::wrap_pybind_function(decode_attention_bf16_body),
        "decode_attention_bf16_body");
  m.def("write_kv", torch::wrap_pybind_function(write_kv), "write_kv");
  m.def("prefill_attention", torch::wrap_pybind_function(prefill_attention), "prefill_attention");
  m.def("encoder_attention", torch::wrap_pybind_function(encoder_attention), "encoder_attention");
  m.def("prefill_attention_supported", torch::wrap_pybind_function(prefill_attention_supported),
        "prefill_attention_supported");
  m.def("prefill_attention_amx_runs", torch::wrap_pybind_function(prefill_attention_amx_runs),
        "prefill_attention_amx_runs");
  m.def("prefill_attention_use_amx", torch::wrap_pybind_function(prefill_attention_use_amx),
        "prefill_attention_use_amx");
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm), "add_rms_norm");
  m.def("rotary", torch::wrap_pybind_function(rotary), "rotary");
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul), "silu_mul");
  m.def("sample_probs", torch::wrap_pybind_function(sample_probs), "sample_probs");
  m.def("sample_logits", torch::wrap_pybind_function(sample_logits), "sample_logits");
  m.def("argmax_rows", torch::wrap_pybind_function(argmax_rows), "argmax_rows");
  m.def("lora_add", torch::wrap_pybind_function(lora_add), "lora_add");
  m.def("lora_bf16_pairs", torch::wrap_pybind_function(lora_bf16_pairs), "lora_bf16_pairs");
  m.def("gemv_bf16", torch::wrap_pybind_function(gemv_bf16), "gemv_bf16");
  m.def("gemv_bf16_runs", torch::wrap_pybind_function(gemv_bf16_runs), "gemv_bf16_runs");
  m.def("layer_loop_pointwise", torch::wrap_pybind_function(layer_loop_pointwise), "layer_loop_pointwise");
  // the layer loop (layer_loop.h): its model's arguments, built once; a step's, built per step; the loop itself
  namespace py = pybind11;
  using Tensors = std::vector<torch::Tensor>;
  using Ints = std::vector<int64_t>;
  py::class_<LoopModel>(m, "LayerLoopModel", "The layer loop's arguments that hold for every step of one model")
      .def(py::init([](Tensors weights, std::vector<double> eps, Ints windows, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, int64_t intermediate, double scale, Tensors packed_weights,
                       int64_t packed_from, int64_t gemv_rows, Tensors adapter_tensors, Ints adapter_ints,
                       std::vector<double> adapter_scales, Tensors quant_weights, Tensors quant_scales,
                       int64_t quant_group, int64_t quant_dense_from) {
             return std::make_unique<LoopModel>(std::move(weights), std::move(eps), std::move(windows), heads,
                                                kv_heads, head_dim, intermediate, scale, std::move(packed_weights),
                                                packed_from, gemv_rows, std::move(adapter_tensors), std::move(adapter_ints),
                                                std::move(adapter_scales), std::move(quant_weights),
                                                std::move(quant_scales), quant_group, quant_dense_from);
           }),
           py::kw_only(), py::arg("weights"), py::arg("eps"), py::arg("windows"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("scale"),
           py::arg("packed_weights") = Tensors{}, py::arg("packed_from") = 0, py::arg("gemv_rows") = 0,
           py::arg("adapter_tensors") = Tensors{},
           py::arg("adapter_ints") = Ints{}, py::arg("adapter_scales") = std::vector<double>{},
           py::arg("quant_weights") = Tensors{}, py::arg("quant_scales") = Tensors{}, py::arg("quant_group") = 0,
           py::arg("quant_dense_from") = 0)
      .def("set_split", torch::wrap_pybind_function([](LoopModel& self, Tensors parts, Ints cols) {
             self.set_split(std::move(parts), std::move(cols));
           }), py::arg("parts"), py::arg("cols"))
      .def_property_readonly("layers", &LoopModel::layers)
      .def_readonly("heads", &LoopModel::heads)
      .def_readonly("kv_heads", &LoopModel::kv_heads)
      .def_readonly("head_dim", &LoopModel::head_dim)
      .def_readonly("intermediate", &LoopModel::intermediate)
      .def_readonly("packed_from", &LoopModel::packed_from)
      .def_readonly("gemv_rows", &LoopModel::gemv_rows)
      .def_property_readonly("packed", [](const LoopModel& self) { return !self.packed_weights.empty(); })
      .def_property_readonly("quantized", [](const LoopModel& self) { return !self.quant_weights.empty(); })
      .def_property_readonly("split_threads", [](const LoopModel& self) {
        return self.split ? self.split->count() : int64_t{0};
      });
  py::class_<LoopStep>(m, "LayerLoopStep", "One step's arguments of the layer loop: its attention plan, its adapter "
                                           "rows, whether it takes the column-split form")
      .def(py::init([](torch::Tensor slot_mapping, Tensors chunks, Tensors groups, Ints q_all, bool identity,
                       Tensors sdpa, Ints sdpa_ints, Ints mask_windows, Ints lora_slots, Tensors lora_rows,
                       bool split) {
             return LoopStep{std::move(slot_mapping), std::move(chunks), std::move(groups), std::move(q_all),
                             identity, std::move(sdpa), std::move(sdpa_ints), std::move(mask_windows),
                             std::move(lora_slots), std::move(lora_rows), split};
           }),
           py::kw_only(), py::arg("slot_mapping"), py::arg("chunks") = Tensors{}, py::arg("groups") = Tensors{},
           py::arg("q_all") = Ints{}, py::arg("identity") = false, py::arg("sdpa") = Tensors{},
           py::arg("sdpa_ints") = Ints{}, py::arg("mask_windows") = Ints{}, py::arg("lora_slots") = Ints{},
           py::arg("lora_rows") = Tensors{}, py::arg("split") = false)
      .def_readonly("identity", &LoopStep::identity)
      .def_readonly("split", &LoopStep::split);
  m.def("layer_loop", torch::wrap_pybind_function(layer_loop), "layer_loop", py::arg("model"), py::arg("h"),
        py::arg("residual"), py::arg("cos"), py::arg("sin"), py::arg("caches"), py::arg("step"));
}
