// tokenmix/error.hpp — the typed errors every public entry point throws.
//
// Nothing in tokenmix aborts the host process on bad input: each entry point validates its
// arguments and throws one of the classes below. Messages name the argument, what was expected
// and what was given, e.g.
//   "attention_forward: k.shape[2] (H_kv) must divide q.shape[2] (H_q = 8); got H_kv = 3".
#pragma once

#include <stdexcept>
#include <string>

namespace tokenmix {

/// What kind of failure an Error reports; lets callers branch without parsing messages.
enum class ErrorCode {
  invalid_argument,  ///< a value is outside its allowed range (non-finite scale, bad option)
  shape_mismatch,    ///< tensor shapes or head counts are inconsistent with each other
  null_pointer,      ///< a required data pointer is null
  aliasing,          ///< an output overlaps an input or another output
  overflow,          ///< sizes whose products overflow 64-bit or index arithmetic
  unsupported,       ///< valid request that this build or CPU cannot serve (e.g. a forced ISA)
  format_error,      ///< a malformed file (e.g. .npy) was rejected
  io_error,          ///< the operating system failed to read or write a file
  out_of_memory,     ///< memory a call needs (e.g. kernel scratch) could not be allocated
};

/// Human-readable name of an ErrorCode ("shape_mismatch", ...).
const char* to_string(ErrorCode code) noexcept;

/// Base class of every exception tokenmix throws.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

/// Arguments that are individually or jointly invalid (shapes, values, pointers, aliasing,
/// overflowing sizes). The code() tells which.
class ArgumentError : public Error {
 public:
  using Error::Error;
};

/// The request is valid but not supported here (an ISA this CPU or build lacks, a dtype the
/// operation does not implement yet).
class UnsupportedError : public Error {
 public:
  explicit UnsupportedError(const std::string& message) : Error(ErrorCode::unsupported, message) {}
};

/// Memory the call needs could not be obtained (ErrorCode::out_of_memory), or its size does not
/// fit in 64-bit arithmetic (ErrorCode::overflow). The message names the entry point, what the
/// memory was for and its size in bytes; nothing has been written to any output.
class ResourceError : public Error {
 public:
  using Error::Error;
};

/// A file that is malformed (bad magic, truncated, inconsistent header, unsupported dtype) or
/// cannot be read or written. Nothing is half-read: on error, no output is produced.
class FileError : public Error {
 public:
  using Error::Error;
};

}  // namespace tokenmix
