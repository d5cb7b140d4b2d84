// Operator schemas of megatron_slmoe._C.
//
// The ops are declared once here with TORCH_LIBRARY under the `slmoe` namespace; each device's
// sources register their kernel for the same op with TORCH_LIBRARY_IMPL(slmoe, <Key>, m)
// (csrc/cpu: CPU, csrc/cuda: CUDA, csrc/ascendc: PrivateUse1). The dispatcher picks the kernel from
// the tensors' device, and Python asks it which devices have one (megatron_slmoe.ops.native_kernels).
// We use the dispatcher rather than pybind functions so a device build only adds kernels, never
// changes the Python surface.

#include <Python.h>
#include <torch/library.h>

#include "packed_scratch.h"

TORCH_LIBRARY(slmoe, m) {
  // Rows of x are grouped by expert; tokens_per_expert (int64, CPU) gives the group sizes.
  // lora_x, when given, replaces x as the LoRA input (x times a dropout mask).
  // probs [T] (x's dtype), when given, scales each output row: y = probs * (x W^T + s h B^T) (the
  // router probability of an expert row; fc2 being linear, the same as scaling its input).
  // Returns y [T, d_out] and h = lora_x A^T [T, r] (never scaled), kept for the backward.
  m.def(
      "lora_grouped_linear_fwd(Tensor x, Tensor weight, Tensor lora_a, Tensor lora_b, "
      "Tensor tokens_per_expert, float scaling, Tensor? lora_x=None, Tensor? probs=None) "
      "-> (Tensor, Tensor)");
  // Returns (dx, dA, dB); an output whose output_mask entry is false comes back undefined (None).
  // lora_mask, when given, is the dropout mask that made lora_x, applied to the LoRA term of dx.
  // probs, when given, is the forward's: dA and dB are for the scaled output, and dx comes back
  // WITHOUT the row scale, g = dy W + (s dy B A) [* mask]; the caller forms dx = probs * g and
  // dprobs = rowsum(x * g) from it (no further GEMM).
  m.def(
      "lora_grouped_linear_bwd(Tensor grad_y, Tensor lora_x, Tensor weight, Tensor lora_a, "
      "Tensor lora_b, Tensor h, Tensor tokens_per_expert, float scaling, Tensor? lora_mask=None, "
      "bool[3] output_mask=[True, True, True], Tensor? probs=None) -> (Tensor, Tensor, Tensor)");
  // The same two over a packed (quantised) frozen W of logical shape [E, d_out, d_in] =
  // [packed.size(0), matrix_shape]: `format` is one of megatron_slmoe.ops.quantized_weights' formats
  // (mxfp4-pack-quantized, pack-quantized, block-fp8), `block` the [rows, cols] one scale covers.
  // Each expert's W_e is decoded into a scratch tile of x's dtype where a GEMM needs it and dropped
  // after; the backward decodes it again. Results, and the input gradient without the row scale,
  // as the dense ops'.
  m.def(
      "lora_grouped_linear_packed_fwd(Tensor x, Tensor lora_a, Tensor lora_b, Tensor tokens_per_expert, "
      "float scaling, Tensor? lora_x, Tensor? probs, Tensor packed, Tensor scale, str format, int[2] block, "
      "int[2] matrix_shape) -> (Tensor, Tensor)");
  m.def(
      "lora_grouped_linear_packed_bwd(Tensor grad_y, Tensor lora_x, Tensor lora_a, Tensor lora_b, Tensor h, "
      "Tensor tokens_per_expert, float scaling, Tensor? lora_mask, bool[3] output_mask, Tensor? probs, "
      "Tensor packed, Tensor scale, str format, int[2] block, int[2] matrix_shape) -> (Tensor, Tensor, Tensor)");
  // Experts the CUDA packed kernel decodes at once, of `experts` local experts whose decoded [out, in]
  // takes `expert_bytes` (csrc/packed_scratch.h); on every build, so the planner's price of that
  // scratch is checked against the kernel's own rule where there is no GPU. No tensors: one kernel
  // for every device.
  m.def("packed_scratch_experts(int experts, int expert_bytes) -> int", &slmoe::packed_scratch_experts);
}

// `import megatron_slmoe._C` only needs a module object; loading the library runs the static
// registrations above. No Python functions are bound here on purpose (see the top comment).
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "megatron_slmoe native kernels", -1,
                                          nullptr};
  return PyModule_Create(&module_def);
}
