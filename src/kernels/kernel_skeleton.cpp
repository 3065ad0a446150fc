// src/kernels/kernel_skeleton.cpp — the parallel region of the SIMD kernels (kernel_skeleton.hpp).
#include "kernels/kernel_skeleton.hpp"

namespace tokenmix::kernels {

void RunTeam(int team, void (*body)(void*), void* ctx) {
#pragma omp parallel num_threads(team)
  body(ctx);
}

}  // namespace tokenmix::kernels
