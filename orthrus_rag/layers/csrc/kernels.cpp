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
  m.def("layer_loop", torch::wrap_pybind_function(layer_loop), "layer_loop");
  m.def("layer_loop_pointwise", torch::wrap_pybind_function(layer_loop_pointwise), "layer_loop_pointwise");
}
