/* tessel's one-row int8 GEMV for x86 CPUs: W8A8's integer sums of one row of activation codes, as
   the PyTorch operator tessel::int8_gemv_sums (so the compiled decode graphs can call it).

     out[n] = (float) sum_k codes[k] * w[n, k]        codes: integers in [-127, 127] given as float32

   exact int32 sums, converted to float32 once (the int32 GEMM's numbers). Both kernels read the
   weight in a packed layout built once per layer (tessel/kernels/int8_gemv.py), so a call streams
   one contiguous buffer:

     vnni  AVX-512 VNNI: blocks of 16 rows x 64 columns, [N/16][K/64][16][64], zero padded.
           vpdpbusd multiplies unsigned bytes by signed ones and sums four products into int32,
           so the codes go in as codes + 128 (unsigned) and 128 * sum_k w[n, k] (`wsum128`,
           packed with the weight) comes off the sum after.
     avx2  AVX2: blocks of 8 rows x 32 columns, [N/8][K/32][8][32], zero padded. vpmaddubsw sums
           pairs of u8 x s8 products into int16, which 255 * 127 * 2 would overflow, so it
           multiplies |codes| by the weight with the codes' signs (vpsignb): at most 127 * 127 * 2.
           A weight of -128 would lose its sign there: such weights do not take this kernel.

   Built by the C++ compiler at first use, not at install (tessel/kernels/int8_gemv.py). */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>

namespace {

#define STACK_CODES 8192

static uint8_t* code_buffer(uint8_t* stack, int64_t n) {
  return n <= STACK_CODES ? stack : (uint8_t*)std::aligned_alloc(64, (size_t)((n + 63) / 64 * 64));
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __m512i sum_rows16(const __m512i a[16]) {
  /* lane i of the result: the sum of a[i]'s sixteen int32 lanes */
  __m512i x[8], y[4];
  for (int i = 0; i < 8; i++)
    x[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                            _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; i++)
    y[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(x[2 * i], x[2 * i + 1]),
                            _mm512_unpackhi_epi64(x[2 * i], x[2 * i + 1]));
  __m512i s01 = _mm512_add_epi32(_mm512_shuffle_i32x4(y[0], y[1], 0x88), _mm512_shuffle_i32x4(y[0], y[1], 0xdd));
  __m512i s23 = _mm512_add_epi32(_mm512_shuffle_i32x4(y[2], y[3], 0x88), _mm512_shuffle_i32x4(y[2], y[3], 0xdd));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(s01, s23, 0x88), _mm512_shuffle_i32x4(s01, s23, 0xdd));
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
int gemv_vnni(const float* codes, const int8_t* packed, const int32_t* wsum128, float* out,
                          int64_t n, int64_t k) {
  const int64_t blocks = (n + 15) / 16, kb = (k + 63) / 64;
  uint8_t stack[STACK_CODES] __attribute__((aligned(64)));
  uint8_t* u = code_buffer(stack, kb * 64);
  if (!u) return 1;
  for (int64_t i = 0; i < kb * 64; i++) u[i] = (uint8_t)(i < k ? (int32_t)codes[i] + 128 : 128);
  for (int64_t b = 0; b < blocks; b++) {
    const int8_t* w = packed + b * kb * 1024;
    __m512i a[16];
    for (int r = 0; r < 16; r++) a[r] = _mm512_setzero_si512();
    for (int64_t i = 0; i < kb; i++) {
      const __m512i x = _mm512_loadu_si512(u + i * 64);
      const int8_t* wi = w + i * 1024;
      for (int r = 0; r < 16; r++) a[r] = _mm512_dpbusd_epi32(a[r], x, _mm512_loadu_si512(wi + r * 64));
    }
    const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum_rows16(a), _mm512_loadu_si512(wsum128 + b * 16)));
    const int64_t left = n - b * 16;
    _mm512_mask_storeu_ps(out + b * 16, left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1), sums);
  }
  if (u != stack) std::free(u);
  return 0;
}

__attribute__((target("avx2")))
static inline __m256i sum_rows8(const __m256i a[8]) {
  /* lane i of the result: the sum of a[i]'s eight int32 lanes */
  __m256i h01 = _mm256_hadd_epi32(a[0], a[1]), h23 = _mm256_hadd_epi32(a[2], a[3]);
  __m256i h45 = _mm256_hadd_epi32(a[4], a[5]), h67 = _mm256_hadd_epi32(a[6], a[7]);
  __m256i q0 = _mm256_hadd_epi32(h01, h23), q1 = _mm256_hadd_epi32(h45, h67);
  /* q0: rows 0-3 low half, rows 0-3 high half; q1: rows 4-7 likewise */
  return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

__attribute__((target("avx2")))
int gemv_avx2(const float* codes, const int8_t* packed, float* out, int64_t n, int64_t k) {
  const int64_t blocks = (n + 7) / 8, kb = (k + 31) / 32;
  int8_t stack[STACK_CODES] __attribute__((aligned(64)));
  int8_t* x = (int8_t*)code_buffer((uint8_t*)stack, kb * 32);
  if (!x) return 1;
  for (int64_t i = 0; i < kb * 32; i++) x[i] = (int8_t)(i < k ? (int32_t)codes[i] : 0);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; b++) {
    const int8_t* w = packed + b * kb * 256;
    __m256i a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_si256();
    for (int64_t i = 0; i < kb; i++) {
      const __m256i xv = _mm256_loadu_si256((const __m256i*)(x + i * 32));
      const __m256i ax = _mm256_sign_epi8(xv, xv);
      const int8_t* wi = w + i * 256;
      for (int r = 0; r < 8; r++) {
        const __m256i wv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(wi + r * 32)), xv);
        a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, wv), ones));
      }
    }
    int32_t sums[8] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i*)sums, sum_rows8(a));
    for (int64_t r = 0; r < 8 && b * 8 + r < n; r++) out[b * 8 + r] = (float)sums[r];
  }
  if ((uint8_t*)x != (uint8_t*)stack) std::free(x);
  return 0;
}

}  // namespace

// codes float32 [1, K] (integers in [-127, 127]), packed int8 [N/r, K/c, r, c] (r x c = 16 x 64: the
// VNNI kernel, 8 x 32: AVX2's), wsum128 int32 [N padded] (VNNI; empty for AVX2) -> float32 [1, n]
at::Tensor int8_gemv_sums(const at::Tensor& codes, const at::Tensor& packed, const at::Tensor& wsum128, int64_t n) {
  TORCH_CHECK(codes.dim() == 2 && codes.size(0) == 1 && codes.scalar_type() == at::kFloat && codes.is_contiguous(),
              "int8_gemv_sums: codes must be contiguous float32 [1, K]; got ", codes.sizes());
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "int8_gemv_sums: packed must be a contiguous int8 [N/r, K/c, r, c]; got ", packed.sizes());
  const int64_t k = codes.size(1), rows = packed.size(2), cols = packed.size(3);
  const bool vnni = rows == 16 && cols == 64;
  TORCH_CHECK(vnni || (rows == 8 && cols == 32), "int8_gemv_sums: blocks of 16 x 64 or 8 x 32; got ", rows, " x ", cols);
  TORCH_CHECK(packed.size(0) * rows >= n && packed.size(1) * cols >= k && packed.size(1) * cols < k + cols,
              "int8_gemv_sums: packed ", packed.sizes(), " does not hold [", n, ", ", k, "]");
  at::Tensor out = at::empty({1, n}, codes.options());
  int status;
  if (vnni) {
    TORCH_CHECK(wsum128.scalar_type() == at::kInt && wsum128.is_contiguous() && wsum128.numel() == packed.size(0) * 16,
                "int8_gemv_sums: wsum128 must be int32 [", packed.size(0) * 16, "]");
    status = gemv_vnni(codes.data_ptr<float>(), packed.data_ptr<int8_t>(), wsum128.data_ptr<int32_t>(),
                       out.data_ptr<float>(), n, k);
  } else {
    status = gemv_avx2(codes.data_ptr<float>(), packed.data_ptr<int8_t>(), out.data_ptr<float>(), n, k);
  }
  TORCH_CHECK(status == 0, "int8_gemv_sums: could not allocate ", k, " bytes of codes");
  return out;
}

TORCH_LIBRARY(tessel, m) { m.def("int8_gemv_sums(Tensor codes, Tensor packed, Tensor wsum128, int n) -> Tensor"); }
TORCH_LIBRARY_IMPL(tessel, CPU, m) { m.impl("int8_gemv_sums", &int8_gemv_sums); }
