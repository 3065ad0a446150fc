// tools/cli/common.cpp — helpers shared by the subcommands (see common.hpp).
#include "common.hpp"

#include <cblas.h>

#include <cstdio>
#include <iostream>

namespace tokenmix::cli {

void progress(const std::string& message) {
  std::cerr << "tokenmix: " << message << std::endl;
}

std::string fmt(double value, const char* format) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, value);
  return buf;
}

void apply_blas_threads(int threads) {
  if (threads > 0) openblas_set_num_threads(threads);
}

}  // namespace tokenmix::cli
