// src/api/options.cpp — names of the attention options' enums (one spelling everywhere: the C++
// API, the CLI's --align and Python's align=).
#include <string>

#include "tokenmix/attention.hpp"
#include "tokenmix/error.hpp"

namespace tokenmix {

const char* to_string(CausalAlign align) noexcept {
  switch (align) {
    case CausalAlign::bottom_right:
      return "bottom_right";
    case CausalAlign::top_left:
      return "top_left";
  }
  return "unknown";
}

CausalAlign parse_causal_align(const std::string& text, const char* what) {
  for (CausalAlign a : {CausalAlign::bottom_right, CausalAlign::top_left}) {
    if (text == to_string(a)) return a;
  }
  throw ArgumentError(
      ErrorCode::invalid_argument,
      std::string(what) + " must be one of bottom_right, top_left; got '" + text + "'");
}

}  // namespace tokenmix
