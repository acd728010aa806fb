/* tessel's one-row int8 GEMV kernels for x86 (AVX-512 VNNI and AVX2), over the packed layouts that
   tessel/kernels/int8_gemv.py builds; included by the operators that call them (int8_gemv.cpp, and
   decode_row.cpp's whole one-row step). Each returns 0, or 1 when it could not allocate its codes.

     out[n] = (float) sum_k codes[k] * w[n, k]        codes: integers in [-127, 127] given as float32 */
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>

namespace {

#define STACK_CODES 8192
/* The weights are read once per step: each kernel asks for the lines PREFETCH_BYTES ahead of those it
   reads, non-temporal, so that they stream through rather than push out what the step reads again
   (the KV cache, the activations). A prefetch past the weights' end does not fault. */
#define PREFETCH_BYTES 4096

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
static int gemv_vnni(const float* codes, const int8_t* packed, const int32_t* wsum128, float* out,
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
      for (int r = 0; r < 16; r++) _mm_prefetch((const char*)wi + PREFETCH_BYTES + r * 64, _MM_HINT_NTA);
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
static int gemv_avx2(const float* codes, const int8_t* packed, float* out, int64_t n, int64_t k) {
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
      for (int r = 0; r < 4; r++) _mm_prefetch((const char*)wi + PREFETCH_BYTES + r * 64, _MM_HINT_NTA);
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
