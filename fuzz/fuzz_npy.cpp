// fuzz/fuzz_npy.cpp — libFuzzer target for the .npy reader (src/io/npy.hpp).
//
// The input is the complete contents of a .npy file. parse_npy must either return an array or
// throw tokenmix::FileError; anything else (another exception, a crash, a sanitizer report, an
// allocation the file size does not justify) is a finding. An accepted array must survive a
// round trip through encode_npy/parse_npy unchanged (bit for bit, NaN payloads included), and
// read_npy on the same bytes in a file must agree with parse_npy (same array or both rejecting).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>

#include "io/npy.hpp"
#include "tokenmix/error.hpp"

namespace {

bool same(const tokenmix::io::NpyArray& a, const tokenmix::io::NpyArray& b) {
  return a.shape == b.shape && a.data.size() == b.data.size() &&
         (a.data.empty() ||
          std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(float)) == 0);
}

// The file-reading path: the same bytes through read_npy. Returns true if it accepted them.
bool read_from_file(const std::uint8_t* data, std::size_t size, tokenmix::io::NpyArray& out) {
  static const std::string path =
      (std::getenv("TMPDIR") ? std::string(std::getenv("TMPDIR")) : std::string("/tmp")) +
      "/tokenmix-fuzz-npy-" + std::to_string(::getpid()) + ".npy";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  bool ok = true;
  try {
    out = tokenmix::io::read_npy(path);
  } catch (const tokenmix::FileError& e) {
    if (e.code() != tokenmix::ErrorCode::format_error) std::abort();
    ok = false;
  }
  std::remove(path.c_str());
  return ok;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tokenmix;
  io::NpyArray array, from_file;
  const bool file_ok = read_from_file(data, size, from_file);
  try {
    array = io::parse_npy(std::span<const unsigned char>(data, size), "fuzz.npy");
  } catch (const FileError& e) {
    if (e.code() != ErrorCode::format_error) std::abort();  // no file system involved
    if (file_ok) std::abort();                              // read_npy accepted it
    return 0;
  }
  if (!file_ok || !same(array, from_file)) std::abort();
  // The reader validates sizes against the input before allocating: a float32 array cannot hold
  // more elements than the input has bytes / 4 (float64 files shrink on conversion).
  if (static_cast<std::size_t>(array.size()) * sizeof(float) > size) std::abort();
  // The element count is the product of the dimensions; a zero anywhere makes it 0 even when the
  // other dimensions' partial product would overflow (the shape (2^41, 15, 461444, 0) is valid).
  std::int64_t count = 1;
  bool has_zero = false, overflowed = false;
  for (std::int64_t d : array.shape) {
    if (d < 0) std::abort();
    has_zero = has_zero || d == 0;
    if (!overflowed) overflowed = __builtin_mul_overflow(count, d, &count);
  }
  if (has_zero)
    count = 0;
  else if (overflowed)
    std::abort();  // a non-empty array this large cannot fit in the input
  if (count != array.size()) std::abort();

  const std::vector<unsigned char> encoded = io::encode_npy(array.shape, array.data);
  if (!same(io::parse_npy(encoded, "round-trip.npy"), array)) std::abort();
  return 0;
}
