// Fused CPU kernels for the engine's per-layer glue: the work between the projections that torch would run as
// ~40 small ops per layer, each paying dispatch and a pass over memory. Decode at small batch is dominated by
// exactly that overhead once the GEMMs are pre-packed (model.py), so these replace it with four calls:
//
//   rms_norm / add_rms_norm   RMSNorm in fp32 (optionally after the residual add, vLLM's fused_add_rms_norm)
//   rope_store                rotary embedding of q and k in place, then K and V written to their paged slots
//   paged_decode_attention    one query token per sequence against its blocks, read where they lie (no gather)
//   silu_mul                  SwiGLU's silu(gate) * up
//
// Plain C++17 with a C ABI, no torch headers: compiles in seconds (services/engine/cpu_ops.py builds it with
// -O3 -march=native on first use and loads it with ctypes, which drops the GIL for the call). OpenMP pragmas
// link against the libgomp torch already loaded, so these share torch's thread pool instead of adding one.
//
// Numerics follow the torch reference path in model.py: fp32 math on bf16 or fp32 storage, bf16 rounded to
// nearest even like c10::BFloat16, and no FMA contraction (-ffp-contract=off) so the elementwise kernels
// (residual add, rotary) are bit-identical to torch; silu differs only by exp_f32's last-bit error. Reductions (RMS, attention) differ from torch
// only in summation order.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using bf16 = uint16_t;

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

template <typename T>
inline T from_f(float f);
template <>
inline float from_f<float>(float f) {
    return f;
}
template <>
inline bf16 from_f<bf16>(float f) {
    uint32_t u = __builtin_bit_cast(uint32_t, f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays a (quiet) NaN
    u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest, ties to even
    return static_cast<bf16>(u >> 16);
}

// exp in fp32 that vectorizes (glibc's vector expf needs -ffast-math): Cody-Waite range reduction to
// r in [-ln2/2, ln2/2] and Cephes' degree-6 polynomial, within 2 ulp of expf over the clamped range.
// Inputs below -87.3 give ~1e-38 instead of a denormal or 0, which no caller here can tell apart.
inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    return y * __builtin_bit_cast(float, bits);
}

constexpr int64_t kParallelRows = 32;  // below this many rows a parallel region costs more than it saves
constexpr int kMaxHeadDim = 256;

template <typename T>
inline void norm_row(const T* x, const float* w, T* out, int64_t h, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < h; ++i) {
        float v = to_f(x[i]);
        ss += v * v;
    }
    const float r = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) out[i] = from_f<T>((to_f(x[i]) * r) * w[i]);
}

template <typename T>
void rms_norm(const T* x, const float* w, T* out, int64_t rows, int64_t h, float eps) {
#pragma omp parallel for if (rows >= kParallelRows)
    for (int64_t r = 0; r < rows; ++r) norm_row(x + r * h, w, out + r * h, h, eps);
}

template <typename T>
void add_rms_norm(T* residual, const T* delta, const float* w, T* out, int64_t rows, int64_t h, float eps) {
#pragma omp parallel for if (rows >= kParallelRows)
    for (int64_t r = 0; r < rows; ++r) {
        T* res = residual + r * h;
        const T* d = delta + r * h;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) res[i] = from_f<T>(to_f(res[i]) + to_f(d[i]));
        norm_row(res, w, out + r * h, h, eps);
    }
}

// qkv: [tokens, (nh + 2 nkv) * hd] rows of q heads, k heads, v heads (the fused projection's output).
// cos/sin: [max_context, hd] fp32 tables from model.rope_tables (full-width cos, sign-folded sin), so that
// rotating is x * cos + roll(x, hd/2) * sin. k_cache/v_cache: one layer, [nkv, slots, hd].
template <typename T>
void rope_store(T* qkv, int64_t tokens, const int64_t* positions, const float* cos, const float* sin,
                T* k_cache, T* v_cache, const int64_t* slots, int64_t nh, int64_t nkv, int64_t hd,
                int64_t num_slots) {
    const int64_t row = (nh + 2 * nkv) * hd, half = hd / 2;
#pragma omp parallel for if (tokens >= kParallelRows)
    for (int64_t t = 0; t < tokens; ++t) {
        const float* c = cos + positions[t] * hd;
        const float* s = sin + positions[t] * hd;
        T* base = qkv + t * row;
        float xf[kMaxHeadDim];
        for (int64_t head = 0; head < nh + nkv; ++head) {
            T* x = base + head * hd;
            for (int64_t i = 0; i < hd; ++i) xf[i] = to_f(x[i]);
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) x[i] = from_f<T>(xf[i] * c[i] + xf[i + half] * s[i]);
#pragma omp simd
            for (int64_t i = half; i < hd; ++i) x[i] = from_f<T>(xf[i] * c[i] + xf[i - half] * s[i]);
        }
        for (int64_t g = 0; g < nkv; ++g) {
            const int64_t dst = (g * num_slots + slots[t]) * hd;
            std::memcpy(k_cache + dst, base + (nh + g) * hd, hd * sizeof(T));
            std::memcpy(v_cache + dst, base + (nh + nkv + g) * hd, hd * sizeof(T));
        }
    }
}

template <typename T>
inline void prefetch(const T* p, int64_t elems) {
    const char* c = reinterpret_cast<const char*>(p);
    for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off);
}

// Attention inner loops for one K or V row against the `group` query heads that share it. The generic versions
// are plain loops; with AVX-512 and a head dim that is a multiple of 16 known at compile time, the row is
// converted once into registers and each head's dot product is FMAs plus one horizontal add.
template <typename T, int64_t HD>
struct RowOps {
    static void scores(const float* qf, int64_t group, int64_t hd, const T* k, float* s, int64_t s_stride,
                       float scale) {
        float kf[kMaxHeadDim];
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) kf[i] = to_f(k[i]);
        for (int64_t j = 0; j < group; ++j) {
            const float* qj = qf + j * hd;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < hd; ++i) dot += qj[i] * kf[i];
            s[j * s_stride] = dot * scale;
        }
    }
    static void accumulate(float* acc, int64_t group, int64_t hd, const T* v, const float* p, int64_t p_stride) {
        float vf[kMaxHeadDim];
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) vf[i] = to_f(v[i]);
        for (int64_t j = 0; j < group; ++j) {
            const float pj = p[j * p_stride];
            float* aj = acc + j * hd;
#pragma omp simd
            for (int64_t i = 0; i < hd; ++i) aj[i] += pj * vf[i];
        }
    }
};

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename T, int64_t HD>
    requires(HD > 0 && HD % 16 == 0)
struct RowOps<T, HD> {
    static constexpr int64_t C = HD / 16;
    static void scores(const float* qf, int64_t group, int64_t, const T* k, float* s, int64_t s_stride,
                       float scale) {
        __m512 kz[C];
        for (int64_t c = 0; c < C; ++c) kz[c] = load16(k + 16 * c);
        for (int64_t j = 0; j < group; ++j) {
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qf + j * HD), kz[0]);
            for (int64_t c = 1; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + j * HD + 16 * c), kz[c], acc);
            s[j * s_stride] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
    static void accumulate(float* acc, int64_t group, int64_t, const T* v, const float* p, int64_t p_stride) {
        __m512 vz[C];
        for (int64_t c = 0; c < C; ++c) vz[c] = load16(v + 16 * c);
        for (int64_t j = 0; j < group; ++j) {
            const __m512 pj = _mm512_set1_ps(p[j * p_stride]);
            float* aj = acc + j * HD;
            for (int64_t c = 0; c < C; ++c)
                _mm512_storeu_ps(aj + 16 * c, _mm512_fmadd_ps(pj, vz[c], _mm512_loadu_ps(aj + 16 * c)));
        }
    }
};
#endif

// One new token per sequence. q: [batch] rows (row stride q_stride) of [nh, hd]; out: [batch, nh * hd].
// tables: [batch, max_blocks] block ids; lens: context length of each sequence, the new token included (its K/V
// already stored). GQA: q head i reads kv head i / (nh / nkv). Softmax in fp32 with the max subtracted.
// HD: the head dim as a compile-time constant (fully unrolled, register-resident loops), or 0 for any.
template <typename T, int64_t HD>
void paged_decode_attention(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                            const int32_t* tables, int64_t max_blocks, const int32_t* lens, T* out,
                            int64_t batch, int64_t nh, int64_t nkv, int64_t head_dim, int64_t block_size,
                            int64_t num_slots, float scale) {
    const int64_t hd = HD ? HD : head_dim;
    const int64_t group = nh / nkv;
    int64_t work = 0;
    for (int64_t b = 0; b < batch; ++b) work += lens[b];
#pragma omp parallel if (work * nkv >= 2048)
    {
        std::vector<float> scores, qf(group * hd), acc(group * hd);
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t b = 0; b < batch; ++b) {
            for (int64_t g = 0; g < nkv; ++g) {
                const int64_t n = lens[b];
                const int32_t* table = tables + b * max_blocks;
                const T* kh = k_cache + g * num_slots * hd;
                const T* vh = v_cache + g * num_slots * hd;
                scores.resize(group * n);
                for (int64_t j = 0; j < group; ++j)
                    for (int64_t i = 0; i < hd; ++i) qf[j * hd + i] = to_f(q[b * q_stride + (g * group + j) * hd + i]);
                const int64_t block_elems = block_size * hd;
                for (int64_t t0 = 0; t0 < n; t0 += block_size) {  // block by block: no division per token
                    const T* kb = kh + static_cast<int64_t>(table[t0 / block_size]) * block_elems;
                    const int64_t m = n - t0 < block_size ? n - t0 : block_size;
                    if (t0 + block_size < n)  // blocks are scattered: fetch the next one while this one computes
                        prefetch(kh + static_cast<int64_t>(table[t0 / block_size + 1]) * block_elems, block_elems);
                    for (int64_t o = 0; o < m; ++o)
                        RowOps<T, HD>::scores(qf.data(), group, hd, kb + o * hd, scores.data() + t0 + o, n, scale);
                }
                float denom[64];
                for (int64_t j = 0; j < group; ++j) {
                    float* sj = scores.data() + j * n;
                    float m = -INFINITY;
#pragma omp simd reduction(max : m)
                    for (int64_t t = 0; t < n; ++t) m = sj[t] > m ? sj[t] : m;
                    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t t = 0; t < n; ++t) {
                        sj[t] = exp_f32(sj[t] - m);
                        sum += sj[t];
                    }
                    denom[j] = sum;
                }
                std::fill(acc.begin(), acc.end(), 0.f);
                for (int64_t t0 = 0; t0 < n; t0 += block_size) {
                    const T* vb = vh + static_cast<int64_t>(table[t0 / block_size]) * block_elems;
                    const int64_t m = n - t0 < block_size ? n - t0 : block_size;
                    if (t0 + block_size < n)
                        prefetch(vh + static_cast<int64_t>(table[t0 / block_size + 1]) * block_elems, block_elems);
                    for (int64_t o = 0; o < m; ++o)
                        RowOps<T, HD>::accumulate(acc.data(), group, hd, vb + o * hd, scores.data() + t0 + o, n);
                }
                for (int64_t j = 0; j < group; ++j) {
                    const float inv = 1.f / denom[j];
                    T* o = out + b * nh * hd + (g * group + j) * hd;
                    for (int64_t i = 0; i < hd; ++i) o[i] = from_f<T>(acc[j * hd + i] * inv);
                }
            }
        }
    }
}

template <typename T>
void paged_decode_attention(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                            const int32_t* tables, int64_t max_blocks, const int32_t* lens, T* out,
                            int64_t batch, int64_t nh, int64_t nkv, int64_t hd, int64_t block_size,
                            int64_t num_slots, float scale) {
    auto run = [&](auto kernel) {
        kernel(q, q_stride, k_cache, v_cache, tables, max_blocks, lens, out, batch, nh, nkv, hd, block_size,
               num_slots, scale);
    };
    if (hd == 64)
        run(paged_decode_attention<T, 64>);
    else if (hd == 128)
        run(paged_decode_attention<T, 128>);
    else
        run(paged_decode_attention<T, 0>);
}

// gate_up: [rows, 2 * f] (gate | up); out: [rows, f] = silu(gate) * up, rounded after each op as torch does.
// Chunked through fp32 scratch so every loop is a plain float loop the compiler vectorizes.
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t f) {
    constexpr int64_t kChunk = 256;
    const int64_t chunks = (f + kChunk - 1) / kChunk;
#pragma omp parallel for collapse(2) if (rows * f >= 4096)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t ci = 0; ci < chunks; ++ci) {
            const int64_t c = ci * kChunk;
            const T* g = gate_up + r * 2 * f;
            const T* u = g + f;
            T* o = out + r * f;
            float a[kChunk], b[kChunk];
            const int64_t len = f - c < kChunk ? f - c : kChunk;
#pragma omp simd
            for (int64_t i = 0; i < len; ++i) a[i] = to_f(g[c + i]);
#pragma omp simd
            for (int64_t i = 0; i < len; ++i) b[i] = a[i] / (1.f + exp_f32(-a[i]));
#pragma omp simd
            for (int64_t i = 0; i < len; ++i) a[i] = to_f(from_f<T>(b[i])) * to_f(u[c + i]);
#pragma omp simd
            for (int64_t i = 0; i < len; ++i) o[c + i] = from_f<T>(a[i]);
        }
    }
}

}  // namespace

// C ABI: one entry per (kernel, dtype). dtype code: 0 = float32, 1 = bfloat16.
extern "C" {

int rs_abi_version() { return 1; }

#define RS_DISPATCH(dtype, call_f32, call_bf16) \
    do {                                        \
        if ((dtype) == 0) {                     \
            call_f32;                           \
        } else {                                \
            call_bf16;                          \
        }                                       \
    } while (0)

void rs_rms_norm(int dtype, const void* x, const float* w, void* out, int64_t rows, int64_t h, float eps) {
    RS_DISPATCH(dtype, rms_norm(static_cast<const float*>(x), w, static_cast<float*>(out), rows, h, eps),
                rms_norm(static_cast<const bf16*>(x), w, static_cast<bf16*>(out), rows, h, eps));
}

void rs_add_rms_norm(int dtype, void* residual, const void* delta, const float* w, void* out, int64_t rows,
                     int64_t h, float eps) {
    RS_DISPATCH(dtype,
                add_rms_norm(static_cast<float*>(residual), static_cast<const float*>(delta), w,
                             static_cast<float*>(out), rows, h, eps),
                add_rms_norm(static_cast<bf16*>(residual), static_cast<const bf16*>(delta), w,
                             static_cast<bf16*>(out), rows, h, eps));
}

void rs_rope_store(int dtype, void* qkv, int64_t tokens, const int64_t* positions, const float* cos,
                   const float* sin, void* k_cache, void* v_cache, const int64_t* slots, int64_t nh, int64_t nkv,
                   int64_t hd, int64_t num_slots) {
    RS_DISPATCH(dtype,
                rope_store(static_cast<float*>(qkv), tokens, positions, cos, sin, static_cast<float*>(k_cache),
                           static_cast<float*>(v_cache), slots, nh, nkv, hd, num_slots),
                rope_store(static_cast<bf16*>(qkv), tokens, positions, cos, sin, static_cast<bf16*>(k_cache),
                           static_cast<bf16*>(v_cache), slots, nh, nkv, hd, num_slots));
}

void rs_paged_decode_attention(int dtype, const void* q, int64_t q_stride, const void* k_cache,
                               const void* v_cache, const int32_t* tables, int64_t max_blocks,
                               const int32_t* lens, void* out, int64_t batch, int64_t nh, int64_t nkv, int64_t hd,
                               int64_t block_size, int64_t num_slots, float scale) {
    RS_DISPATCH(dtype,
                paged_decode_attention(static_cast<const float*>(q), q_stride, static_cast<const float*>(k_cache),
                                       static_cast<const float*>(v_cache), tables, max_blocks, lens,
                                       static_cast<float*>(out), batch, nh, nkv, hd, block_size, num_slots, scale),
                paged_decode_attention(static_cast<const bf16*>(q), q_stride, static_cast<const bf16*>(k_cache),
                                       static_cast<const bf16*>(v_cache), tables, max_blocks, lens,
                                       static_cast<bf16*>(out), batch, nh, nkv, hd, block_size, num_slots, scale));
}

void rs_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t f) {
    RS_DISPATCH(dtype, silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, f),
                silu_mul(static_cast<const bf16*>(gate_up), static_cast<bf16*>(out), rows, f));
}

}  // extern "C"
