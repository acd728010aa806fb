/* tessel's whole one-row decode step for x86 CPUs: one sequence's token through every plain Llama
   layer a model (or a pipeline stage) holds, in one call, as the PyTorch operator tessel::decode_row.

   A one-row step reads every weight once; what else it does is small (norms, codes, rotary, one
   row of attention, SiLU), but run as compiled graphs called from Python it cost about as much as
   the weights' reads (benchmarks/decode_profile.py). Here each layer is the model's formulas on
   float32 rows, the integer sums by the int8 GEMV kernels (int8_gemv_kernels.h):

     h, r        = rmsnorm(x + r) * w_in           (the first layer: r = x, h = rmsnorm(x) * w_in)
     qkv         = int8_linear(h)                  codes = round(h / s), s = max(amax|h|, 1e-8) / 127
                                                   y = (sums(codes) * s) * s_w + bias
     q, k        each head rmsnorm(head) * w_q, w_k (Qwen3's q/k norms, where the layer has them)
     q, k        rotated by the position's tables  x * [c | c] + [x2 | x1] * [-s | s]
     k, v        stored at the row's slot of the paged cache [blocks, block_size, Hkv, D]
     a           = softmax(q k^T * scale) v        over the context's tokens, through the block table
     x           = int8_linear(a)                  o_proj
     h, r        = rmsnorm(x + r) * w_post
     x           = down(silu(gate) * up)           gate, up = int8_linear(h)
   and after the last layer rmsnorm(x + r) * w_final (the last stage), or x + r (the stream a stage
   before the last sends on).

   The same formulas as the compiled graphs, not their bits: sums are taken in this file's order, exp
   is a polynomial (Cephes' expf, within 2 ulp). Compiled with -march=native on the machine that runs
   it, or -march=x86-64-v3 for an AVX2-only one (tessel/kernels/decode_row.py): the attention takes
   AVX-512's kernels, else AVX2's, else portable loops; the GEMV kernel follows the packed weight's
   layout. */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "int8_gemv_kernels.h"

namespace {

constexpr float CODE_EPS = 1e-8f;  // tessel.kernels.quantize_rows.EPS
constexpr float QMAX = 127.0f;
constexpr float ROUND_MAGIC = 12582912.0f;  // 1.5 * 2**23: (v + M) - M rounds |v| < 2**22 half to even
constexpr int64_t PER_LAYER = 20;          // tensors per layer in `weights` (decode_row's schema)

struct Linear {
  const int8_t* packed;
  const int32_t* wsum128;  // VNNI only
  const float* scale;      // per output channel
  const float* bias;       // nullptr: none
  int64_t n, k;
  bool vnni;
};

struct Layer {
  const float* norm_in;
  const float* norm_post;
  const float* q_norm;  // per head, over head_dim; nullptr: none (and k_norm too)
  const float* k_norm;
  Linear qkv, o, gate_up, down;
  float* k_cache;
  float* v_cache;
};

struct Shape {
  int64_t hidden, heads, kv_heads, head_dim, block_size;
  float eps, scale;
};

inline float exp_poly(float x) {
  /* Cephes' expf: 2**n * p(r), x = n ln2 + r; written so that the compiler vectorises the loops
     that call it (no library call, no branch). */
  x = std::min(std::max(x, -87.33654f), 88.72283f);
  const float n = (x * 1.44269504088896341f + ROUND_MAGIC) - ROUND_MAGIC;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

void rms_norm(const float* s, const float* w, float* out, int64_t n, float eps) {
  /* out may be s */
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; i++) squares += s[i] * s[i];
  const float rstd = 1.0f / std::sqrt(squares / (float)n + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; i++) out[i] = (s[i] * rstd) * w[i];
}

void add_into(float* residual, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) residual[i] = x[i] + residual[i];
}

bool int8_linear(const Linear& l, const float* x, float* codes, float* y) {
  float amax = 0.0f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < l.k; i++) amax = std::max(amax, std::fabs(x[i]));
  const float s = std::max(amax, CODE_EPS) / QMAX;
#pragma omp simd
  for (int64_t i = 0; i < l.k; i++) codes[i] = (x[i] / s + ROUND_MAGIC) - ROUND_MAGIC;
  const int status = l.vnni ? gemv_vnni(codes, l.packed, l.wsum128, y, l.n, l.k)
                            : gemv_avx2(codes, l.packed, y, l.n, l.k);
  if (status != 0) return false;
#pragma omp simd
  for (int64_t i = 0; i < l.n; i++) y[i] = (y[i] * s) * l.scale[i];
  if (l.bias != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < l.n; i++) y[i] += l.bias[i];
  }
  return true;
}

void rotate(float* head, const float* c2, const float* s2, int64_t d, float* tmp) {
  const int64_t half = d / 2;
  std::memcpy(tmp, head, sizeof(float) * d);
#pragma omp simd
  for (int64_t i = 0; i < half; i++) head[i] = tmp[i] * c2[i] + tmp[i + half] * s2[i];
#pragma omp simd
  for (int64_t i = half; i < d; i++) head[i] = tmp[i] * c2[i] + tmp[i - half] * s2[i];
}

void softmax(float* s, int64_t n) {
  float top = -INFINITY;
  for (int64_t t = 0; t < n; t++) top = std::max(top, s[t]);
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < n; t++) {
    s[t] = exp_poly(s[t] - top);
    total += s[t];
  }
#pragma omp simd
  for (int64_t t = 0; t < n; t++) s[t] /= total;
}

template <typename Visit>
void each_token(const Shape& sh, const float* cache, const int32_t* table, int64_t context, int64_t kv, Visit visit) {
  /* visit(t, row of token t for kv head `kv`) over the context's tokens, block by block (no division
     per token) */
  const int64_t row = sh.kv_heads * sh.head_dim;
  for (int64_t first = 0, b = 0; first < context; first += sh.block_size, b++) {
    const float* base = cache + (int64_t)table[b] * sh.block_size * row + kv * sh.head_dim;
    const int64_t n = std::min(sh.block_size, context - first);
    for (int64_t i = 0; i < n; i++) visit(first + i, base + i * row);
  }
}

void key_scores_each(const Shape& sh, const float* qg, int64_t group, const float* k_cache, const int32_t* table,
                     int64_t context, int64_t kv, float* sg) {
  const int64_t d = sh.head_dim;
  each_token(sh, k_cache, table, context, kv, [&](int64_t t, const float* kt) {
    for (int64_t j = 0; j < group; j++) {
      const float* qh = qg + j * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; i++) dot += qh[i] * kt[i];
      sg[j * context + t] = dot * sh.scale;
    }
  });
}

using Weighted = void (*)(const float*, const float* const*, int, int64_t, float*);

#ifdef __AVX512F__
__m512 sum_rows16_ps(const __m512 a[16]) {
  /* lane i of the result: the sum of a[i]'s sixteen lanes (int8_gemv_kernels.h's sum_rows16 in float) */
  __m512 x[8], y[4];
  for (int i = 0; i < 8; i++)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; i++)
    y[i] = _mm512_add_ps(  // the pairs moved as 64-bit units, added as floats
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]))));
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xdd));
}

void dots16(const float* q, const float* const* rows, int n, int64_t d, float scale, float* out) {
  /* out[r] = scale * q . rows[r] for r < n <= 16: sixteen lanes of partial sums per row, summed
     across rows at once (sum_rows16) instead of one horizontal sum per row. Always sixteen rows (the
     missing ones read row 0 and are not stored): a constant count keeps a[] in registers, where a
     loop to n keeps it in memory */
  const float* at[16];
  for (int r = 0; r < 16; r++) at[r] = rows[r < n ? r : 0];
  __m512 a[16];
  for (int r = 0; r < 16; r++) a[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 m = d - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (d - c)) - 1);
    const __m512 qv = _mm512_maskz_loadu_ps(m, q + c);
    for (int r = 0; r < 16; r++) a[r] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, at[r] + c), a[r]);
  }
  const __m512 total = sum_rows16_ps(a);
  _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1), _mm512_mul_ps(total, _mm512_set1_ps(scale)));
}

template <int CHUNKS>
void weighted16(const float* p, const float* const* rows, int n, int64_t d, float* out) {
  /* out += sum_r p[r] * rows[r] for r < n <= 16, the output's CHUNKS * 16 >= d columns held in
     registers across the rows (a constant count: acc[] stays in registers) */
  const int64_t tail = d - (CHUNKS - 1) * 16;
  __mmask16 m[CHUNKS];
  for (int c = 0; c < CHUNKS; c++)
    m[c] = c + 1 < CHUNKS || tail >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << tail) - 1);
  __m512 acc[CHUNKS];
  for (int c = 0; c < CHUNKS; c++) acc[c] = _mm512_maskz_loadu_ps(m[c], out + c * 16);
  for (int r = 0; r < n; r++) {
    const __m512 pr = _mm512_set1_ps(p[r]);
    for (int c = 0; c < CHUNKS; c++)
      acc[c] = _mm512_fmadd_ps(pr, _mm512_maskz_loadu_ps(m[c], rows[r] + c * 16), acc[c]);
  }
  for (int c = 0; c < CHUNKS; c++) _mm512_mask_storeu_ps(out + c * 16, m[c], acc[c]);
}

Weighted weighted16_for(int64_t d) {
  /* head dims up to 128: eight chunks of sixteen */
  static const Weighted by_chunks[8] = {weighted16<1>, weighted16<2>, weighted16<3>, weighted16<4>,
                                        weighted16<5>, weighted16<6>, weighted16<7>, weighted16<8>};
  return by_chunks[(d + 15) / 16 - 1];
}

#endif

#if defined(__AVX2__) && defined(__FMA__)
__m256i tail_lanes(int64_t left) {
  /* lanes i < left set (left < 8), for AVX2's masked loads and stores */
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

__m256 sum_rows8_ps(const __m256 a[8]) {
  /* lane i of the result: the sum of a[i]'s eight lanes (int8_gemv_kernels.h's sum_rows8 in float) */
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

void dots8(const float* q, const float* const* rows, int n, int64_t d, float scale, float* out) {
  /* dots16 for AVX2: eight rows, eight lanes of partial sums each, always eight (registers) */
  const float* at[8];
  for (int r = 0; r < 8; r++) at[r] = rows[r < n ? r : 0];
  __m256 a[8];
  for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
    for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(at[r] + c), a[r]);
  }
  if (c < d) {
    const __m256i m = tail_lanes(d - c);
    const __m256 qv = _mm256_maskload_ps(q + c, m);
    for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(qv, _mm256_maskload_ps(at[r] + c, m), a[r]);
  }
  const __m256 total = _mm256_mul_ps(sum_rows8_ps(a), _mm256_set1_ps(scale));
  _mm256_maskstore_ps(out, n >= 8 ? _mm256_set1_epi32(-1) : tail_lanes(n), total);
}

template <int CHUNKS>
void weighted8(const float* p, const float* const* rows, int n, int64_t d, float* out) {
  /* weighted16 for AVX2: the output's CHUNKS * 8 >= d columns in registers across the rows */
  const int64_t tail = d - (CHUNKS - 1) * 8;
  const __m256i last = tail >= 8 ? _mm256_set1_epi32(-1) : tail_lanes(tail);
  __m256 acc[CHUNKS];
  for (int c = 0; c + 1 < CHUNKS; c++) acc[c] = _mm256_loadu_ps(out + c * 8);
  acc[CHUNKS - 1] = _mm256_maskload_ps(out + (CHUNKS - 1) * 8, last);
  for (int r = 0; r < n; r++) {
    const __m256 pr = _mm256_set1_ps(p[r]);
    for (int c = 0; c + 1 < CHUNKS; c++) acc[c] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(rows[r] + c * 8), acc[c]);
    acc[CHUNKS - 1] =
        _mm256_fmadd_ps(pr, _mm256_maskload_ps(rows[r] + (CHUNKS - 1) * 8, last), acc[CHUNKS - 1]);
  }
  for (int c = 0; c + 1 < CHUNKS; c++) _mm256_storeu_ps(out + c * 8, acc[c]);
  _mm256_maskstore_ps(out + (CHUNKS - 1) * 8, last, acc[CHUNKS - 1]);
}

Weighted weighted8_for(int64_t d) {
  /* head dims up to 128: sixteen chunks of eight */
  static const Weighted by_chunks[16] = {weighted8<1>,  weighted8<2>,  weighted8<3>,  weighted8<4>,
                                         weighted8<5>,  weighted8<6>,  weighted8<7>,  weighted8<8>,
                                         weighted8<9>,  weighted8<10>, weighted8<11>, weighted8<12>,
                                         weighted8<13>, weighted8<14>, weighted8<15>, weighted8<16>};
  return by_chunks[(d + 7) / 8 - 1];
}
#endif

struct Ahead {
  /* the next block's rows, asked for in parts while this block is read: a whole block at once (64 KB
     with Qwen3-0.6B's eight kv heads of 128) is more lines than the core tracks in flight, so the
     prefetches wait for each other in a burst instead of overlapping the reads; one part before each
     head's kernel keeps a few in flight at a time */
  const char* next = nullptr;
  int64_t bytes = 0;

  void part(int64_t i, int64_t parts) const {
    const int64_t share = (bytes / parts + 63) / 64 * 64;
    const int64_t end = std::min(bytes, (i + 1) * share);
    for (int64_t o = i * share; o < end; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
  }
};

template <typename Visit>
void each_chunk(const Shape& sh, const float* cache, const int32_t* table, int64_t context, Visit visit) {
  /* visit(first token, n <= 16, the n tokens' rows, the next block) over the context, 16 tokens of
     one block at a time: a block's rows are contiguous, so each chunk reads one stretch of memory */
  const int64_t row = sh.kv_heads * sh.head_dim;
  const float* rows[16];
  for (int64_t first = 0, b = 0; first < context; first += sh.block_size, b++) {
    const float* base = cache + (int64_t)table[b] * sh.block_size * row;
    const int64_t in_block = std::min(sh.block_size, context - first);
    Ahead ahead;
    if (first + sh.block_size < context) {
      ahead.next = (const char*)(cache + (int64_t)table[b + 1] * sh.block_size * row);
      ahead.bytes = std::min(sh.block_size, context - first - sh.block_size) * row * (int64_t)sizeof(float);
    }
    for (int64_t i = 0; i < in_block; i += 16) {
      const int n = (int)std::min<int64_t>(16, in_block - i);
      for (int r = 0; r < n; r++) rows[r] = base + (i + r) * row;
      // blocks of more than 16 tokens: the next block's parts go with this block's first chunk
      visit(first + i, n, rows, i == 0 ? ahead : Ahead{});
    }
  }
}

using Dots = void (*)(const float*, const float* const*, int, int64_t, float, float*);

void attend_chunks(const Shape& sh, const float* q, const float* k_cache, const float* v_cache, const int32_t* table,
                   int64_t context, float* out, std::vector<float>& scores, Dots dots, Weighted weigh, int width) {
  /* `attend` in chunks of 16 tokens of a block, every head on each chunk while it is in cache; the
     kernels (AVX-512's or AVX2's) take `width` of a chunk's rows at a time */
  const int64_t d = sh.head_dim, group = sh.heads / sh.kv_heads;
  scores.resize((size_t)(context * sh.heads));
  float* s = scores.data();
  const float* at[16];
  each_chunk(sh, k_cache, table, context, [&](int64_t first, int n, const float* const* rows, const Ahead& ahead) {
    for (int64_t h = 0; h < sh.heads; h++) {
      ahead.part(h, sh.heads);
      for (int r = 0; r < n; r++) at[r] = rows[r] + (h / group) * d;
      for (int o = 0; o < n; o += width)
        dots(q + h * d, at + o, std::min(width, n - o), d, sh.scale, s + h * context + first + o);
    }
  });
  for (int64_t h = 0; h < sh.heads; h++) softmax(s + h * context, context);
  std::fill(out, out + sh.heads * d, 0.0f);
  each_chunk(sh, v_cache, table, context, [&](int64_t first, int n, const float* const* rows, const Ahead& ahead) {
    for (int64_t h = 0; h < sh.heads; h++) {
      ahead.part(h, sh.heads);
      for (int r = 0; r < n; r++) at[r] = rows[r] + (h / group) * d;
      for (int o = 0; o < n; o += width)
        weigh(s + h * context + first + o, at + o, std::min(width, n - o), d, out + h * d);
    }
  });
}

void attend(const Shape& sh, const float* q, const float* k_cache, const float* v_cache, const int32_t* table,
            int64_t context, float* out, std::vector<float>& scores) {
  /* One row's attention over `context` cached tokens, q [heads, D]. GQA: each kv head serves
     `group` query heads, which read each of its keys and values once, together. */
#ifdef __AVX512F__
  if (sh.head_dim <= 128)
    return attend_chunks(sh, q, k_cache, v_cache, table, context, out, scores, dots16, weighted16_for(sh.head_dim), 16);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (sh.head_dim <= 128)
    return attend_chunks(sh, q, k_cache, v_cache, table, context, out, scores, dots8, weighted8_for(sh.head_dim), 8);
#endif
  const int64_t d = sh.head_dim, group = sh.heads / sh.kv_heads;
  scores.resize((size_t)(context * group));
  for (int64_t kv = 0; kv < sh.kv_heads; kv++) {
    const float* qg = q + kv * group * d;
    float* sg = scores.data();
    key_scores_each(sh, qg, group, k_cache, table, context, kv, sg);
    for (int64_t j = 0; j < group; j++) softmax(sg + j * context, context);
    float* og = out + kv * group * d;
    std::fill(og, og + group * d, 0.0f);
    each_token(sh, v_cache, table, context, kv, [&](int64_t t, const float* vt) {
      for (int64_t j = 0; j < group; j++) {
        const float p = sg[j * context + t];
        float* oh = og + j * d;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) oh[i] += p * vt[i];
      }
    });
  }
}

void silu_and_mul(const float* gate_up, float* out, int64_t f) {
#pragma omp simd
  for (int64_t i = 0; i < f; i++) {
    const float g = gate_up[i];
    out[i] = g / (1.0f + exp_poly(-g)) * gate_up[f + i];
  }
}

struct Buffers {
  std::vector<float> h, qkv, attn, gate_up, act, codes, tmp, scores;
};

bool layer_step(const Shape& sh, const Layer& l, float* x, float* r, bool first, const float* c2, const float* s2,
                int64_t slot, const int32_t* table, int64_t context, Buffers& b) {
  const int64_t hidden = sh.hidden, d = sh.head_dim, q_size = sh.heads * d, kv_size = sh.kv_heads * d;
  if (first) {
    std::memcpy(r, x, sizeof(float) * hidden);
  } else {
    add_into(r, x, hidden);
  }
  rms_norm(r, l.norm_in, b.h.data(), hidden, sh.eps);
  if (!int8_linear(l.qkv, b.h.data(), b.codes.data(), b.qkv.data())) return false;
  float* q = b.qkv.data();
  float* k = q + q_size;
  const float* v = k + kv_size;
  if (l.q_norm != nullptr) {
    for (int64_t h = 0; h < sh.heads; h++) rms_norm(q + h * d, l.q_norm, q + h * d, d, sh.eps);
    for (int64_t h = 0; h < sh.kv_heads; h++) rms_norm(k + h * d, l.k_norm, k + h * d, d, sh.eps);
  }
  for (int64_t h = 0; h < sh.heads + sh.kv_heads; h++) rotate(q + h * d, c2, s2, d, b.tmp.data());
  std::memcpy(l.k_cache + slot * kv_size, k, sizeof(float) * kv_size);
  std::memcpy(l.v_cache + slot * kv_size, v, sizeof(float) * kv_size);
  attend(sh, q, l.k_cache, l.v_cache, table, context, b.attn.data(), b.scores);
  if (!int8_linear(l.o, b.attn.data(), b.codes.data(), x)) return false;
  add_into(r, x, hidden);
  rms_norm(r, l.norm_post, b.h.data(), hidden, sh.eps);
  if (!int8_linear(l.gate_up, b.h.data(), b.codes.data(), b.gate_up.data())) return false;
  silu_and_mul(b.gate_up.data(), b.act.data(), l.down.k);
  return int8_linear(l.down, b.act.data(), b.codes.data(), x);
}

Linear linear_of(const at::Tensor* t, int64_t in_features) {
  /* t: packed, wsum128, scale, bias (empty: none) */
  const bool vnni = t[0].size(2) == 16;
  Linear l{t[0].data_ptr<int8_t>(), vnni ? t[1].data_ptr<int32_t>() : nullptr, t[2].data_ptr<float>(),
           t[3].numel() ? t[3].data_ptr<float>() : nullptr, t[2].numel(), in_features, vnni};
  return l;
}

void check_linear(const at::Tensor* t, int64_t in_features, int64_t out_features, int64_t layer, const char* name) {
  const at::Tensor& packed = t[0];
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "decode_row: layer ", layer, " ", name, ": packed must be a contiguous int8 [N/r, K/c, r, c]");
  const int64_t rows = packed.size(2), cols = packed.size(3);
  const bool vnni = rows == 16 && cols == 64;
  TORCH_CHECK(vnni || (rows == 8 && cols == 32), "decode_row: layer ", layer, " ", name, ": blocks of 16 x 64 or 8 x 32");
  TORCH_CHECK(packed.size(0) * rows >= out_features && packed.size(1) * cols >= in_features &&
                  packed.size(1) * cols < in_features + cols,
              "decode_row: layer ", layer, " ", name, ": packed ", packed.sizes(), " does not hold [", out_features, ", ",
              in_features, "]");
  TORCH_CHECK(!vnni || (t[1].scalar_type() == at::kInt && t[1].is_contiguous() && t[1].numel() == packed.size(0) * 16),
              "decode_row: layer ", layer, " ", name, ": wsum128 must be int32 [", packed.size(0) * 16, "]");
  TORCH_CHECK(t[2].scalar_type() == at::kFloat && t[2].is_contiguous() && t[2].numel() == out_features,
              "decode_row: layer ", layer, " ", name, ": scale must be float32 [", out_features, "]");
  TORCH_CHECK(t[3].numel() == 0 || (t[3].scalar_type() == at::kFloat && t[3].is_contiguous() && t[3].numel() == out_features),
              "decode_row: layer ", layer, " ", name, ": bias must be empty or float32 [", out_features, "]");
}

void check_floats(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, "decode_row: ", what,
              " must be contiguous float32 of ", n, " values; got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace

/* x float32 [1, H] (the embedded token, or the stream a stage received), weights: per layer
   [norm_in, norm_post, q_norm, k_norm (both empty: none), then qkv, o, gate_up, down each as packed,
   wsum128, scale, bias], the layers'
   caches [blocks, block_size, Hkv, D], the position's rope tables c2, s2 [D], the row's slot
   (int64 [1]), block table (int32 [>= blocks]) and context length (int32 [1], the new token counted)
   -> float32 [1, H]: the final norm's output (final_norm given) or the residual stream. */
at::Tensor decode_row(const at::Tensor& x, at::TensorList weights, at::TensorList k_caches, at::TensorList v_caches,
                      const at::Tensor& c2, const at::Tensor& s2, const at::Tensor& slot_mapping,
                      const at::Tensor& block_table, const at::Tensor& context_lens, int64_t heads, int64_t kv_heads,
                      double scale, double eps, const c10::optional<at::Tensor>& final_norm) {
  const int64_t layers = (int64_t)k_caches.size();
  TORCH_CHECK(layers > 0 && (int64_t)weights.size() == layers * PER_LAYER && (int64_t)v_caches.size() == layers,
              "decode_row: ", PER_LAYER, " weights and two caches per layer; got ", weights.size(), " weights and ",
              k_caches.size(), " + ", v_caches.size(), " caches");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "decode_row: x must be [1, H]; got ", x.sizes());
  const int64_t hidden = x.size(1);
  check_floats(x.contiguous(), hidden, "x");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "decode_row: ", heads, " heads over ", kv_heads,
              " kv heads");
  const at::Tensor& cache0 = k_caches[0];
  TORCH_CHECK(cache0.dim() == 4 && cache0.size(2) == kv_heads, "decode_row: caches must be [blocks, block_size, ",
              kv_heads, ", D]; got ", cache0.sizes());
  const int64_t d = cache0.size(3), block_size = cache0.size(1), blocks = cache0.size(0);
  TORCH_CHECK(d % 2 == 0, "decode_row: an even head dim; got ", d);
  check_floats(c2, d, "c2");
  check_floats(s2, d, "s2");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == 1, "decode_row: slot_mapping int64 [1]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.numel() == 1, "decode_row: context_lens int32 [1]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(), "decode_row: block_table int32");
  const int64_t slot = slot_mapping.item<int64_t>(), context = context_lens.item<int32_t>();
  TORCH_CHECK(context >= 1 && (context + block_size - 1) / block_size <= block_table.numel(), "decode_row: context ",
              context, " needs more blocks than the table's ", block_table.numel());
  TORCH_CHECK(slot >= 0 && slot < blocks * block_size, "decode_row: slot ", slot, " is past the cache");
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t i = 0; i < (context + block_size - 1) / block_size; i++)
    TORCH_CHECK(table[i] >= 0 && table[i] < blocks, "decode_row: block ", table[i], " is past the cache");

  const Shape sh{hidden, heads, kv_heads, d, block_size, (float)eps, (float)scale};
  const int64_t q_size = heads * d, kv_size = kv_heads * d;
  std::vector<Layer> plan;
  int64_t intermediate = 0;
  for (int64_t i = 0; i < layers; i++) {
    const at::Tensor* w = &weights[i * PER_LAYER];
    check_floats(w[0], hidden, "norm_in");
    check_floats(w[1], hidden, "norm_post");
    const bool qk_norm = w[2].numel() > 0;
    TORCH_CHECK(qk_norm == (w[3].numel() > 0), "decode_row: layer ", i, ": q_norm and k_norm both or neither");
    if (qk_norm) {
      check_floats(w[2], d, "q_norm");
      check_floats(w[3], d, "k_norm");
    }
    const int64_t f2 = w[14].numel();  // gate_up's scale: [2F]
    check_linear(w + 4, hidden, q_size + 2 * kv_size, i, "qkv");
    check_linear(w + 8, q_size, hidden, i, "o");
    check_linear(w + 12, hidden, f2, i, "gate_up");
    check_linear(w + 16, f2 / 2, hidden, i, "down");
    TORCH_CHECK(f2 % 2 == 0 && f2 > 0, "decode_row: layer ", i, ": gate_up's width must be even");
    for (const at::Tensor* cache : {&k_caches[i], &v_caches[i]})
      TORCH_CHECK(cache->scalar_type() == at::kFloat && cache->is_contiguous() && cache->sizes() == cache0.sizes(),
                  "decode_row: layer ", i, ": caches must be contiguous float32 ", cache0.sizes());
    intermediate = std::max(intermediate, f2 / 2);
    plan.push_back(Layer{w[0].data_ptr<float>(), w[1].data_ptr<float>(),
                         qk_norm ? w[2].data_ptr<float>() : nullptr, qk_norm ? w[3].data_ptr<float>() : nullptr,
                         linear_of(w + 4, hidden), linear_of(w + 8, q_size), linear_of(w + 12, hidden),
                         linear_of(w + 16, f2 / 2),
                         k_caches[i].data_ptr<float>(), v_caches[i].data_ptr<float>()});
  }
  if (final_norm.has_value()) check_floats(*final_norm, hidden, "final_norm");

  Buffers b;
  b.h.resize(hidden);
  b.qkv.resize(q_size + 2 * kv_size);
  b.attn.resize(q_size);
  b.gate_up.resize(2 * intermediate);
  b.act.resize(intermediate);
  b.codes.resize(std::max({hidden, q_size, intermediate}));
  b.tmp.resize(d);
  at::Tensor out = x.contiguous().clone();
  std::vector<float> residual(hidden);
  float* stream = out.data_ptr<float>();
  for (int64_t i = 0; i < layers; i++) {
    const bool ok = layer_step(sh, plan[i], stream, residual.data(), i == 0, c2.data_ptr<float>(),
                               s2.data_ptr<float>(), slot, table, context, b);
    TORCH_CHECK(ok, "decode_row: could not allocate the codes of a layer's linear");
  }
  add_into(residual.data(), stream, hidden);
  if (final_norm.has_value()) {
    rms_norm(residual.data(), final_norm->data_ptr<float>(), stream, hidden, sh.eps);
  } else {
    std::memcpy(stream, residual.data(), sizeof(float) * hidden);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(tessel, m) {
  m.def(
      "decode_row(Tensor x, Tensor[] weights, Tensor[] k_caches, Tensor[] v_caches, Tensor c2, Tensor s2, "
      "Tensor slot_mapping, Tensor block_table, Tensor context_lens, int heads, int kv_heads, float scale, "
      "float eps, Tensor? final_norm) -> Tensor");
}
TORCH_LIBRARY_IMPL(tessel, CPU, m) { m.impl("decode_row", &decode_row); }
