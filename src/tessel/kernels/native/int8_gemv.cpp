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
#include <torch/library.h>

#include "int8_gemv_kernels.h"

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
