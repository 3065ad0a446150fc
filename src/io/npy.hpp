// src/io/npy.hpp — NumPy .npy files: a strict reader and an atomic float32 writer.
//
// Used by the command-line tool (`tokenmix run --q q.npy ...`) and its tests. Internal: not
// installed, not part of the public API.
//
// Reading accepts format versions 1.0, 2.0 and 3.0; the header dict must hold exactly the keys
// 'descr', 'fortran_order' and 'shape'. Element types: little-endian float32 ('<f4', '=f4',
// '|f4') and float64 ('<f8', '=f8', '|f8', converted to float32; a finite value outside the
// float32 range is rejected rather than silently turned into infinity). Anything else
// (big-endian, integers, float16, structured dtypes, Fortran order) is rejected.
//
// Every rejection throws tokenmix::FileError whose message names the file, what was expected and
// what was found; code() is ErrorCode::format_error for a malformed file and ErrorCode::io_error
// when the operating system fails. Sizes are validated against the file size before anything is
// allocated, so a header declaring a huge or overflowing shape costs nothing. Nothing is ever
// half-read: on error no array is returned.
//
// Writing produces version 1.0, '<f4', C order, header padded so the data starts at a multiple of
// 64 bytes. The bytes go to a temporary file in the same directory which is renamed over the
// destination only when complete, so a failed write leaves no file behind.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace tokenmix::io {

/// A C-order float32 array as read from (or to be written to) a .npy file.
struct NpyArray {
  std::vector<std::int64_t> shape;  ///< empty for a 0-d array (one element)
  std::vector<float> data;          ///< product(shape) elements, C (row-major) order

  /// Number of elements, product(shape).
  std::int64_t size() const noexcept { return static_cast<std::int64_t>(data.size()); }
  /// "[2, 3, 4]" (for messages).
  std::string shape_string() const;
};

/// "[2, 3, 4]" (for messages).
std::string shape_to_string(std::span<const std::int64_t> shape);

/// Reads `path`. Throws FileError (format_error / io_error) as described above.
NpyArray read_npy(const std::string& path);

/// Parses the complete contents of a .npy file held in memory; `name` is used in messages.
NpyArray parse_npy(std::span<const unsigned char> bytes, const std::string& name);

/// Writes `data` with `shape` as a version 1.0 '<f4' C-order file, atomically (temporary file +
/// rename). Throws ArgumentError(shape_mismatch) if data.size() != product(shape) or a dimension is
/// negative, FileError(io_error) if the file cannot be written (then nothing is left behind).
void write_npy(const std::string& path, std::span<const std::int64_t> shape,
               std::span<const float> data);
inline void write_npy(const std::string& path, const NpyArray& array) {
  write_npy(path, array.shape, array.data);
}

/// The exact bytes write_npy would write (header and data), for tests and in-memory use.
std::vector<unsigned char> encode_npy(std::span<const std::int64_t> shape,
                                      std::span<const float> data);

}  // namespace tokenmix::io
