// Rank-r approximation of a matrix by power (subspace) iteration, as GEAR's SVDSolver: R ~ A B^T
// with A [rows, r] orthonormal and B [cols, r] = R^T A. Deterministic: the random start depends
// only on `seed`. Columns of A are re-orthonormalized (modified Gram-Schmidt) every iteration,
// which keeps them from collapsing onto the top singular vector; the last A is orthonormal.
#pragma once

#include <cstdint>

namespace strata::kernels {

// r must be <= min(rows, cols); iterations >= 1. Rank-deficient inputs give zero columns.
void LowRankApproximate(const float* r_matrix,  // [rows, cols], row-major
                        int rows, int cols, int rank, int iterations, uint64_t seed,
                        float* a,   // [rows, rank] out
                        float* b);  // [cols, rank] out

}  // namespace strata::kernels
