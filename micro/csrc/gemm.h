// nodraft's few-row matrix product (gemm.cpp), for the other kernels of the library.
#pragma once

#include <cstdint>

namespace nodraft_kernels {

// C (M, N) = A (M, K) @ B, all float32 row-major; B (K, N), or with ``packed``
// (N / 16, K, 16). Every C element is one sum over k in order: a row's result
// does not depend on M (gemm.cpp's contract).
void gemm(const float* a, int64_t M, int64_t K, const float* b, int64_t N, bool packed,
          float* c);

}  // namespace nodraft_kernels
