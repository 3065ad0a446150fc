// src/kernels/kernel_skeleton.cpp — the parallel region of the SIMD kernels (kernel_skeleton.hpp).
#include "kernels/kernel_skeleton.hpp"

#include <omp.h>

namespace tokenmix::kernels {

void RunTeam(int team, void (*body)(void*), void* ctx) {
  if (team <= 1 && omp_get_level() == 0) {  // no region to open (kernel_skeleton.hpp)
    body(ctx);
    return;
  }
#pragma omp parallel num_threads(team)
  body(ctx);
}

}  // namespace tokenmix::kernels
