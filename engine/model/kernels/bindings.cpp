// The Python module: every kernel the sources beside this file define, by the name engine code calls.
// pybind11 with the tensor type casters, not the whole C++ frontend that torch/extension.h brings
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

using namespace tokenpath;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python object, so they let go of the GIL as PyTorch's own operators do: the threads that
  // take a batch's tokens run beside a forward instead of queueing for the GIL after it, each switch to them a
  // wait of the stepping thread.
  const auto unlocked = py::call_guard<py::gil_scoped_release>();
  m.def("int8_linear", &int8_linear, unlocked, "x w^T with int8 weights, activations quantized to int8 per row");
  m.def("int8_silu_linear", &int8_silu_linear, unlocked, "silu(gate) * up of int8_linear's fused gate/up outputs");
  m.def("small_linear", &small_linear, unlocked, "x w^T (+ bias) for a few rows of x, float32, each row's result independent of M");
  m.def("rms_norm", &rms_norm, unlocked, "RMSNorm of each row, float32");
  m.def("rotary", &rotary, unlocked, "rotary embedding of the first heads of each row, float32");
  m.def("decode_attention", &decode_attention, unlocked, "attention of one new token (float32) over every cached position (float32, bfloat16 or float16)");
  m.def("prompt_attention", &prompt_attention, unlocked, "causal attention of fresh prompts side by side, each row as alone");
  m.def("with_rooms", &with_rooms, unlocked, "fresh prompts' keys or values, each copied into storage with room to grow");
  m.def("silu_mul", &silu_mul, unlocked, "silu(gate) * up of a fused gate/up output, float32");
  m.def("int8_wo_linear", &int8_wo_linear, unlocked, "x w^T with int8 weights and one scale per row, float32 x");
  m.def("int4_dyn_linear", &int4_dyn_linear, unlocked, "x w^T with int4 weights in blocks (Q4_1 arithmetic) for N outputs, x quantized to int8 per block of 32");
  py::class_<DecodeForms>(m, "DecodeForms", "the embedding, every layer's form and the head's, as decode_layers reads them")
      .def(py::init<at::Tensor, std::vector<LayerForm>, HeadForm>());
  m.def("decode_layers", &decode_layers, unlocked, "the logits of one new token per sequence: its embedding, every Llama decoder layer, appending to each sequence's KV caches, then the last norm and the head");
  m.def("argmax", &argmax, unlocked, "index of the largest value (the first among equals, the first NaN if any)");
  m.def("argmax_rows", &argmax_rows, unlocked, "argmax of each row of a 2-D tensor, in one call");
  m.def("release_threads", &release_threads, "free the calling thread's OpenMP threads until its next parallel region");
  m.def("int8_block_linear", &int8_block_linear, unlocked, "x w^T with int8 weights in blocks (Q8_0 arithmetic) for N outputs, x quantized to int8 per block of 32");
  m.def("has_vnni", &has_vnni, "whether int8_linear was built with AVX-512 VNNI instructions");
  m.def("has_amx_tiles", &has_amx_tiles, "whether int8_linear multiplies several rows on AMX tiles here");
  m.def("sparse_linear", &sparse_linear, unlocked, "x W^T with inputs below a threshold as zero, skipping their weight rows or multiplying their zeros, the same sums either way");
  m.def("mask_small", &mask_small, unlocked, "zero the entries below a magnitude threshold, and count them");
}

