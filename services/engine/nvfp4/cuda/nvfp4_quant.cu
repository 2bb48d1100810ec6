// NVFP4 quantize kernel, bit-exact with services/engine/nvfp4/recipe.py (the contract is docs/nvfp4.md).
//
// Torch-free on purpose: it compiles with nvcc alone (the tests compile it for sm_90 and sm_100a on machines
// without a GPU) and exposes a C launcher that binding.cpp wraps for torch. One thread quantizes one block
// of 16 elements: it reads the block, writes 8 packed bytes and 1 scale byte.
//
// E2M1 uses the hardware `cvt.rn.satfinite.e2m1x2.f32` where the target has it (sm_100a/sm_103a/sm_110a/
// sm_120a/sm_121a and their families), the exact threshold ladder of docs/nvfp4.md elsewhere. E4M3 uses
// __nv_cvt_float_to_fp8(..., __NV_SATFINITE, __NV_E4M3) (RNE, subnormals kept). Multiplications and divisions
// are spelled __fmul_rn / __fdiv_rn on the device so that fast-math flags can neither contract nor
// approximate them: the order of fp32 roundings is part of the contract.
//
// The same block routine also compiles for the host (rackserve_nvfp4_quantize_host), which lets the tests
// check the software path byte for byte against the torch reference without a GPU.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#if defined(__CUDA_ARCH__) &&                                                                    \
    (defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM103_ALL) ||               \
     defined(__CUDA_ARCH_FEAT_SM110_ALL) || defined(__CUDA_ARCH_FEAT_SM120_ALL) ||               \
     defined(__CUDA_ARCH_FEAT_SM121_ALL) ||                                                      \
     (defined(__CUDA_ARCH_FAMILY_SPECIFIC__) &&                                                  \
      (__CUDA_ARCH_FAMILY_SPECIFIC__ == 1000 || __CUDA_ARCH_FAMILY_SPECIFIC__ == 1030 ||        \
       __CUDA_ARCH_FAMILY_SPECIFIC__ == 1100 || __CUDA_ARCH_FAMILY_SPECIFIC__ == 1200 ||        \
       __CUDA_ARCH_FAMILY_SPECIFIC__ == 1210)))
#define RACKSERVE_HW_E2M1 1
#else
#define RACKSERVE_HW_E2M1 0
#endif

#if defined(__CUDA_ARCH__)
#define RS_MUL(a, b) __fmul_rn((a), (b))
#define RS_DIV(a, b) __fdiv_rn((a), (b))
#else
#define RS_MUL(a, b) ((a) * (b))
#define RS_DIV(a, b) ((a) / (b))
#endif

namespace rackserve_nvfp4 {

constexpr int kBlock = 16;
constexpr float kE4M3Max = 448.0f;

enum InputDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

__host__ __device__ inline float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

__host__ __device__ inline uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

__host__ __device__ inline float e4m3_byte_to_float(uint8_t b) {
  const int e = (b >> 3) & 0xF;
  const int m = b & 7;
  if (e == 0) return static_cast<float>(m) * 0.001953125f;  // m * 2^-9, exact
  return bits_to_float(static_cast<uint32_t>(e + 120) << 23 | static_cast<uint32_t>(m) << 20);
}

// docs/nvfp4.md's ladder: a <= 0.25 -> 0, < 0.75 -> 0.5, <= 1.25 -> 1, < 1.75 -> 1.5, <= 2.5 -> 2, < 3.5 -> 3,
// <= 5 -> 4, else 6 (ties to the even code). The sign comes from the bits so -0.0 gives code 8.
__host__ __device__ inline uint32_t e2m1_code_sw(float y) {
  const uint32_t bits = float_to_bits(y);
  const float a = fabsf(y);
  const uint32_t mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                       (a > 5.0f);
  return mag | ((bits >> 31) << 3);
}

// Four pairs -> four bytes, element 2j in the low nibble of byte j.
__host__ __device__ inline uint32_t e2m1_pack8(const float (&y)[8]) {
#if RACKSERVE_HW_E2M1
  uint32_t out;
  // cvt.e2m1x2 puts its first source in the high nibble, so the odd element goes first.
  asm("{\n"
      ".reg .b8 b0, b1, b2, b3;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b0, %2, %1;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b1, %4, %3;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b2, %6, %5;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b3, %8, %7;\n"
      "mov.b32 %0, {b0, b1, b2, b3};\n"
      "}"
      : "=r"(out)
      : "f"(y[0]), "f"(y[1]), "f"(y[2]), "f"(y[3]), "f"(y[4]), "f"(y[5]), "f"(y[6]), "f"(y[7]));
  return out;
#else
  uint32_t out = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t byte = e2m1_code_sw(y[2 * j]) | (e2m1_code_sw(y[2 * j + 1]) << 4);
    out |= byte << (8 * j);
  }
  return out;
#endif
}

// The recipe for one block: x[16] (fp32) -> 8 packed bytes (lo, hi words) and the scale byte.
__host__ __device__ inline void quantize_block(const float (&x)[kBlock], float g, uint32_t& lo, uint32_t& hi,
                                               uint8_t& scale_byte) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) amax = fmaxf(amax, fabsf(x[i]));
  // s_b = e4m3(g_e * (a_b * (1/6))), clamped to 448 first.
  const float v = fminf(RS_MUL(g, RS_MUL(amax, 1.0f / 6.0f)), kE4M3Max);
  scale_byte = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
  const float s = e4m3_byte_to_float(scale_byte);
  // inv = 1 / (s_b * (1 / g_e)), both divisions IEEE; 0 when the block scale is 0.
  const float inv = (s == 0.0f) ? 0.0f : RS_DIV(1.0f, RS_MUL(s, RS_DIV(1.0f, g)));
  float y[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) y[i] = RS_MUL(x[i], inv);
  lo = e2m1_pack8(y);
#pragma unroll
  for (int i = 0; i < 8; ++i) y[i] = RS_MUL(x[8 + i], inv);
  hi = e2m1_pack8(y);
}

template <typename T>
__device__ inline float to_float(T v);
template <>
__device__ inline float to_float<float>(float v) {
  return v;
}
template <>
__device__ inline float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ inline float to_float<__half>(__half v) {
  return __half2float(v);
}

// kAligned: K % 16 == 0 and rows start on 16-byte boundaries, so a block is read with 16-byte vector loads.
template <typename T, bool kAligned>
__global__ void quantize_kernel(const T* __restrict__ x, int64_t rows, int64_t k, int64_t nb, int64_t row_stride,
                                const float* __restrict__ global_scale, uint8_t* __restrict__ packed,
                                uint8_t* __restrict__ scales) {
  const float g = *global_scale;
  const int64_t total = rows * nb;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / nb;
    const int64_t blk = i - row * nb;
    const T* src = x + row * row_stride + blk * kBlock;
    float v[kBlock];
    if constexpr (kAligned) {
      constexpr int kPerVec = 16 / sizeof(T);
#pragma unroll
      for (int c = 0; c < kBlock / kPerVec; ++c) {
        const uint4 raw = reinterpret_cast<const uint4*>(src)[c];
        const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int j = 0; j < kPerVec; ++j) v[c * kPerVec + j] = to_float(elems[j]);
      }
    } else {
      const int64_t col0 = blk * kBlock;
#pragma unroll
      for (int j = 0; j < kBlock; ++j) v[j] = (col0 + j < k) ? to_float(src[j]) : 0.0f;  // zero padding
    }
    uint32_t lo, hi;
    uint8_t scale_byte;
    quantize_block(v, g, lo, hi, scale_byte);
    reinterpret_cast<uint2*>(packed)[i] = make_uint2(lo, hi);  // packed row stride is nb * 8 bytes
    scales[i] = scale_byte;
  }
}

template <typename T>
cudaError_t launch_typed(const void* x, int64_t rows, int64_t k, int64_t row_stride, const float* global_scale,
                         uint8_t* packed, uint8_t* scales, cudaStream_t stream) {
  const int64_t nb = (k + kBlock - 1) / kBlock;
  const int64_t total = rows * nb;
  if (total == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  // Enough CTAs to fill any current GPU several times over; the grid-stride loop covers the rest.
  const int64_t want = (total + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(want < 65536 ? want : 65536);
  const T* xt = static_cast<const T*>(x);
  const bool aligned = (k % kBlock == 0) && (row_stride * sizeof(T)) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(x) % 16 == 0;
  if (aligned) {
    quantize_kernel<T, true><<<grid, kThreads, 0, stream>>>(xt, rows, k, nb, row_stride, global_scale, packed,
                                                            scales);
  } else {
    quantize_kernel<T, false><<<grid, kThreads, 0, stream>>>(xt, rows, k, nb, row_stride, global_scale, packed,
                                                             scales);
  }
  return cudaGetLastError();
}

}  // namespace rackserve_nvfp4

extern "C" {

// Quantize rows x k elements (row_stride elements apart) into packed [rows, nb*8] and scales [rows, nb],
// nb = ceil(k / 16). global_scale points to g_e on the device. dtype: 0 float32, 1 bfloat16, 2 float16.
// Returns a cudaError_t (0 on success).
int rackserve_nvfp4_quantize(const void* x, int dtype, int64_t rows, int64_t k, int64_t row_stride,
                             const float* global_scale, uint8_t* packed, uint8_t* scales, void* stream) {
  using namespace rackserve_nvfp4;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kFloat32:
      return launch_typed<float>(x, rows, k, row_stride, global_scale, packed, scales, s);
    case kBFloat16:
      return launch_typed<__nv_bfloat16>(x, rows, k, row_stride, global_scale, packed, scales, s);
    case kFloat16:
      return launch_typed<__half>(x, rows, k, row_stride, global_scale, packed, scales, s);
    default:
      return cudaErrorInvalidValue;
  }
}

const char* rackserve_nvfp4_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

// The same block routine on the CPU, fp32 input only: the software E2M1 path of the kernel, for tests.
void rackserve_nvfp4_quantize_host(const float* x, int64_t rows, int64_t k, float global_scale, uint8_t* packed,
                                   uint8_t* scales) {
  using namespace rackserve_nvfp4;
  const int64_t nb = (k + kBlock - 1) / kBlock;
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t blk = 0; blk < nb; ++blk) {
      float v[kBlock];
      for (int j = 0; j < kBlock; ++j) {
        const int64_t col = blk * kBlock + j;
        v[j] = col < k ? x[row * k + col] : 0.0f;
      }
      uint32_t lo, hi;
      uint8_t scale_byte;
      quantize_block(v, global_scale, lo, hi, scale_byte);
      uint8_t* out = packed + (row * nb + blk) * 8;
      for (int j = 0; j < 4; ++j) {
        out[j] = static_cast<uint8_t>(lo >> (8 * j));
        out[4 + j] = static_cast<uint8_t>(hi >> (8 * j));
      }
      scales[row * nb + blk] = scale_byte;
    }
  }
}

}  // extern "C"
