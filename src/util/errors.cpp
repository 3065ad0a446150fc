// src/util/errors.cpp — names of error codes and dtypes, and the error classes.
#include "tokenmix/error.hpp"
#include "tokenmix/tensor.hpp"

namespace tokenmix {

const char* to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::invalid_argument:
      return "invalid_argument";
    case ErrorCode::shape_mismatch:
      return "shape_mismatch";
    case ErrorCode::null_pointer:
      return "null_pointer";
    case ErrorCode::aliasing:
      return "aliasing";
    case ErrorCode::overflow:
      return "overflow";
    case ErrorCode::unsupported:
      return "unsupported";
    case ErrorCode::format_error:
      return "format_error";
    case ErrorCode::io_error:
      return "io_error";
    case ErrorCode::out_of_memory:
      return "out_of_memory";
  }
  return "unknown";
}

const char* to_string(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::boolean:
      return "bool";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::int8:
      return "int8";
    case DType::fp8_e4m3:
      return "fp8_e4m3";
  }
  return "unknown";
}

std::size_t size_of(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32:
      return 4;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::boolean:
      return 1;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::int8:
    case DType::fp8_e4m3:
      return 1;
  }
  return 0;
}

}  // namespace tokenmix
