// Torch binding for nvfp4_quant.cu: registers torch.ops.rackserve_nvfp4.quantize_into.
//
// Only argument checking lives here; the arithmetic is in the torch-free kernel file. The caller (cuda_kernels.py)
// allocates the outputs, computes g_e on the device and passes the current CUDA stream as an integer, so this
// file needs no CUDA headers and compiles quickly with the host compiler.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>

extern "C" int rackserve_nvfp4_quantize(const void* x, int dtype, int64_t rows, int64_t k, int64_t row_stride,
                                        const float* global_scale, uint8_t* packed, uint8_t* scales, void* stream);
extern "C" const char* rackserve_nvfp4_error_string(int err);

namespace {

void check_output(const at::Tensor& t, const char* name, const at::Tensor& x, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.device() == x.device(), "rackserve_nvfp4.quantize_into: ", name, " must be on ", x.device(),
              ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous(), "rackserve_nvfp4.quantize_into: ", name,
              " must be a contiguous uint8 tensor");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, "rackserve_nvfp4.quantize_into: ", name,
              " must have shape [", rows, ", ", cols, "], got ", t.sizes());
}

void quantize_into(const at::Tensor& x, const at::Tensor& global_scale, const at::Tensor& packed,
                   const at::Tensor& scales, int64_t stream) {
  TORCH_CHECK(x.is_cuda(), "rackserve_nvfp4.quantize_into: x must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1),
              "rackserve_nvfp4.quantize_into: x must be 2-D [rows, K] with unit stride along K");
  int dtype = -1;
  switch (x.scalar_type()) {
    case at::kFloat:
      dtype = 0;
      break;
    case at::kBFloat16:
      dtype = 1;
      break;
    case at::kHalf:
      dtype = 2;
      break;
    default:
      TORCH_CHECK(false, "rackserve_nvfp4.quantize_into: x must be float32, bfloat16 or float16, got ",
                  x.scalar_type());
  }
  const int64_t rows = x.size(0);
  const int64_t k = x.size(1);
  const int64_t nb = (k + 15) / 16;
  TORCH_CHECK(global_scale.device() == x.device() && global_scale.scalar_type() == at::kFloat &&
                  global_scale.numel() == 1,
              "rackserve_nvfp4.quantize_into: global_scale must be one float32 on ", x.device());
  check_output(packed, "packed", x, rows, nb * 8);
  check_output(scales, "scales", x, rows, nb);
  const int err = rackserve_nvfp4_quantize(x.data_ptr(), dtype, rows, k, x.stride(0),
                                           global_scale.data_ptr<float>(), packed.data_ptr<uint8_t>(),
                                           scales.data_ptr<uint8_t>(), reinterpret_cast<void*>(stream));
  TORCH_CHECK(err == 0, "rackserve_nvfp4.quantize_into: kernel launch failed: ", rackserve_nvfp4_error_string(err));
}

}  // namespace

TORCH_LIBRARY(rackserve_nvfp4, m) {
  m.def("quantize_into(Tensor x, Tensor global_scale, Tensor(a!) packed, Tensor(b!) scales, int stream) -> ()",
        &quantize_into);
}
