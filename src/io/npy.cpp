// src/io/npy.cpp — NumPy .npy reader and writer (see npy.hpp for the contract).
//
// Format (numpy.lib.format): magic "\x93NUMPY", major and minor version bytes, header length
// (uint16 little-endian for 1.0, uint32 for 2.0 and 3.0), then an ASCII (3.0: UTF-8) Python dict
// literal padded with spaces and ended by '\n', then the raw data.
#include "io/npy.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>

#include "tokenmix/error.hpp"

namespace tokenmix::io {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the .npy reader assumes a little-endian host ('<', '=' and '|' are native)");

constexpr unsigned char kMagic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
constexpr std::size_t kMagicSize = sizeof(kMagic);

[[noreturn]] void format_fail(const std::string& name, const std::string& what) {
  throw FileError(ErrorCode::format_error, "npy file '" + name + "': " + what);
}

[[noreturn]] void os_fail(const std::string& name, const std::string& what, int err) {
  throw FileError(ErrorCode::io_error,
                  "npy file '" + name + "': " + what + ": " + std::strerror(err));
}

/// A readable rendering of (possibly binary) bytes for messages: printable ASCII as is, other
/// bytes as \xNN, cut after `limit` bytes.
std::string printable(std::span<const unsigned char> bytes, std::size_t limit = 48) {
  std::string out;
  const std::size_t n = std::min(bytes.size(), limit);
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned char c = bytes[i];
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  if (bytes.size() > limit) out += "...";
  return out;
}

// ---------------------------------------------------------------------------------------------
// The header dict: a small parser for the subset of Python literals .npy headers use.

struct Header {
  std::string descr;
  bool fortran_order = false;
  std::vector<std::int64_t> shape;
};

class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& name) : text_(text), name_(name) {}

  Header parse() {
    Header header;
    bool have_descr = false, have_fortran = false, have_shape = false;
    skip_space();
    expect('{', "'{' opening the header dict");
    skip_space();
    while (!at_end() && peek() != '}') {
      const std::string key = parse_string("a quoted dict key");
      skip_space();
      expect(':', "':' after key '" + key + "'");
      skip_space();
      if (key == "descr") {
        if (have_descr) fail("key 'descr' appears twice");
        have_descr = true;
        if (at_end() || (peek() != '\'' && peek() != '"'))
          fail("'descr' must be a quoted dtype string such as '<f4'; found " + found_here());
        header.descr = parse_string("a dtype string");
      } else if (key == "fortran_order") {
        if (have_fortran) fail("key 'fortran_order' appears twice");
        have_fortran = true;
        header.fortran_order = parse_bool();
      } else if (key == "shape") {
        if (have_shape) fail("key 'shape' appears twice");
        have_shape = true;
        header.shape = parse_shape();
      } else {
        fail("unexpected key '" + key + "' (expected exactly 'descr', 'fortran_order', 'shape')");
      }
      skip_space();
      if (at_end()) break;
      if (peek() == ',') {
        ++pos_;
        skip_space();
      } else if (peek() != '}') {
        fail("expected ',' or '}' after the value of '" + key + "'; found " + found_here());
      }
    }
    expect('}', "'}' closing the header dict");
    // Only padding may follow: spaces and the terminating newline (NumPy also pads with spaces).
    while (!at_end()) {
      const char c = peek();
      if (c != ' ' && c != '\n' && c != '\r' && c != '\t' && c != '\0')
        fail("unexpected text after the header dict: " + found_here());
      ++pos_;
    }
    std::string missing;
    if (!have_descr) missing += " 'descr'";
    if (!have_fortran) missing += " 'fortran_order'";
    if (!have_shape) missing += " 'shape'";
    if (!missing.empty()) fail("header dict lacks the key(s)" + missing);
    return header;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    format_fail(name_, "malformed header: " + what);
  }

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return text_[pos_]; }

  std::string found_here() const {
    if (at_end()) return "end of header";
    const auto rest = text_.substr(pos_, 24);
    return "'" + printable({reinterpret_cast<const unsigned char*>(rest.data()), rest.size()}, 24) +
           (text_.size() - pos_ > 24 ? "...'" : "'");
  }

  void skip_space() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r'))
      ++pos_;
  }

  void expect(char c, const std::string& what) {
    if (at_end() || peek() != c) fail("expected " + what + "; found " + found_here());
    ++pos_;
  }

  std::string parse_string(const std::string& what) {
    if (at_end() || (peek() != '\'' && peek() != '"'))
      fail("expected " + what + "; found " + found_here());
    const char quote = peek();
    const std::size_t start = ++pos_;
    while (!at_end() && peek() != quote && peek() != '\n') {
      if (peek() == '\\') fail("escape sequences are not supported in header strings");
      ++pos_;
    }
    if (at_end() || peek() == '\n')
      fail("unterminated string starting at offset " + std::to_string(start - 1));
    std::string s(text_.substr(start, pos_ - start));
    ++pos_;
    return s;
  }

  bool parse_bool() {
    if (text_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (text_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    fail("'fortran_order' must be True or False; found " + found_here());
  }

  std::vector<std::int64_t> parse_shape() {
    std::vector<std::int64_t> shape;
    expect('(', "'(' opening the 'shape' tuple");
    skip_space();
    bool need_comma_for_single = true;
    while (!at_end() && peek() != ')') {
      shape.push_back(parse_dim(shape.size()));
      skip_space();
      if (!at_end() && peek() == ',') {
        ++pos_;
        need_comma_for_single = false;
        skip_space();
      } else if (!at_end() && peek() != ')') {
        fail("expected ',' or ')' in 'shape'; found " + found_here());
      } else {
        need_comma_for_single = shape.size() == 1;
      }
    }
    expect(')', "')' closing the 'shape' tuple");
    if (shape.size() == 1 && need_comma_for_single)
      fail("'shape' of one dimension must be written '(n,)'");
    if (shape.size() > 32)
      fail("'shape' has " + std::to_string(shape.size()) + " dimensions (NumPy allows at most 32)");
    return shape;
  }

  std::int64_t parse_dim(std::size_t index) {
    const std::size_t start = pos_;
    bool negative = false;
    if (!at_end() && peek() == '-') {
      negative = true;
      ++pos_;
    }
    if (at_end() || peek() < '0' || peek() > '9') {
      pos_ = start;
      fail("'shape' entries must be integers; found " + found_here());
    }
    std::int64_t value = 0;
    bool overflow = false;
    while (!at_end() && peek() >= '0' && peek() <= '9') {
      const int digit = peek() - '0';
      if (value > (std::numeric_limits<std::int64_t>::max() - digit) / 10) overflow = true;
      if (!overflow) value = value * 10 + digit;
      ++pos_;
    }
    if (!at_end() && peek() == 'L') ++pos_;  // Python 2 long literal, written by old NumPy
    const std::string digits(text_.substr(start, pos_ - start));
    if (negative)
      format_fail(name_, "shape[" + std::to_string(index) + "] is negative (" + digits +
                             "); dimensions must be >= 0");
    if (overflow)
      format_fail(name_,
                  "shape[" + std::to_string(index) + "] = " + digits + " does not fit in 64 bits");
    return value;
  }

  std::string_view text_;
  const std::string& name_;
  std::size_t pos_ = 0;
};

// ---------------------------------------------------------------------------------------------

enum class Elem { f32, f64 };

Elem parse_descr(const std::string& descr, const std::string& name) {
  if (descr.size() == 3 && (descr[0] == '<' || descr[0] == '=' || descr[0] == '|')) {
    if (descr.substr(1) == "f4") return Elem::f32;
    if (descr.substr(1) == "f8") return Elem::f64;
  }
  std::string hint;
  if (!descr.empty() && descr[0] == '>') hint = " (big-endian data is not supported)";
  format_fail(name, "unsupported dtype '" + descr +
                        "'; expected little-endian float32 '<f4' or float64 '<f8'" + hint);
}

std::uint32_t read_le(const unsigned char* p, int bytes) {
  std::uint32_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Validates the prefix and header; returns the header, the element type and the data offset.
// Throws on anything wrong, without allocating based on declared sizes.
struct Layout {
  Header header;
  Elem elem = Elem::f32;
  std::size_t data_offset = 0;
  std::uint64_t count = 0;  // number of elements
};

Layout parse_layout(std::span<const unsigned char> bytes, std::uint64_t file_size,
                    const std::string& name) {
  if (bytes.size() < kMagicSize || std::memcmp(bytes.data(), kMagic, kMagicSize) != 0) {
    format_fail(name, "bad magic: expected \"\\x93NUMPY\"; found \"" +
                          printable(bytes.first(std::min(bytes.size(), kMagicSize))) + "\"" +
                          (bytes.size() < kMagicSize
                               ? " (file is only " + std::to_string(bytes.size()) + " bytes)"
                               : ""));
  }
  if (bytes.size() < kMagicSize + 2)
    format_fail(name, "truncated header: file ends after " + std::to_string(bytes.size()) +
                          " bytes, before the version bytes");
  const int major = bytes[6], minor = bytes[7];
  if ((major != 1 && major != 2 && major != 3) || minor != 0)
    format_fail(name, "unsupported format version " + std::to_string(major) + "." +
                          std::to_string(minor) + "; expected 1.0, 2.0 or 3.0");
  const int len_bytes = major == 1 ? 2 : 4;
  const std::size_t prefix = kMagicSize + 2 + static_cast<std::size_t>(len_bytes);
  if (bytes.size() < prefix)
    format_fail(name, "truncated header: file ends after " + std::to_string(bytes.size()) +
                          " bytes, inside the header-length field (need " + std::to_string(prefix) +
                          ")");
  const std::uint64_t header_len = read_le(bytes.data() + 8, len_bytes);
  if (header_len > file_size - prefix)
    format_fail(name, "truncated header: header length field says " + std::to_string(header_len) +
                          " bytes but only " + std::to_string(file_size - prefix) +
                          " bytes follow it");
  if (bytes.size() < prefix + header_len)
    format_fail(name, "truncated header: expected " + std::to_string(header_len) +
                          " header bytes, found " + std::to_string(bytes.size() - prefix));
  const std::string_view text(reinterpret_cast<const char*>(bytes.data() + prefix),
                              static_cast<std::size_t>(header_len));
  if (major < 3) {
    for (const char c : text)
      if (static_cast<unsigned char>(c) >= 0x80)
        format_fail(name, "malformed header: non-ASCII byte in a version " + std::to_string(major) +
                              ".0 header");
  }

  Layout layout;
  layout.header = HeaderParser(text, name).parse();
  layout.elem = parse_descr(layout.header.descr, name);
  if (layout.header.fortran_order)
    format_fail(name,
                "fortran_order is True; only C-order (fortran_order False) arrays are "
                "supported (save with np.ascontiguousarray)");
  const std::uint64_t itemsize = layout.elem == Elem::f32 ? 4 : 8;
  std::uint64_t count = 1;
  for (std::size_t i = 0; i < layout.header.shape.size(); ++i) {
    const auto dim = static_cast<std::uint64_t>(layout.header.shape[i]);
    if (__builtin_mul_overflow(count, dim, &count))
      format_fail(name, "shape " + shape_to_string(layout.header.shape) +
                            " has an element count that overflows 64 bits");
  }
  std::uint64_t data_bytes = 0;
  if (__builtin_mul_overflow(count, itemsize, &data_bytes))
    format_fail(name, "shape " + shape_to_string(layout.header.shape) + " of '" +
                          layout.header.descr + "' declares more than 2^64 bytes of data");
  if (count > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
      count > std::vector<float>().max_size())
    format_fail(name, "shape " + shape_to_string(layout.header.shape) + " is too large");
  layout.data_offset = prefix + static_cast<std::size_t>(header_len);
  const std::uint64_t available = file_size - layout.data_offset;
  if (available != data_bytes) {
    const std::string declared = "shape " + shape_to_string(layout.header.shape) + " of '" +
                                 layout.header.descr + "' needs " + std::to_string(data_bytes) +
                                 " data bytes";
    if (available < data_bytes)
      format_fail(name, "truncated data: " + declared + " but the file holds only " +
                            std::to_string(available));
    format_fail(name, "data size does not match the header: " + declared + " but the file holds " +
                          std::to_string(available) + " (" +
                          std::to_string(available - data_bytes) + " extra bytes)");
  }
  layout.count = count;
  return layout;
}

NpyArray convert(const Layout& layout, const unsigned char* data, const std::string& name) {
  NpyArray array;
  array.shape = layout.header.shape;
  const auto n = static_cast<std::size_t>(layout.count);
  array.data.resize(n);
  if (layout.elem == Elem::f32) {
    if (n > 0) std::memcpy(array.data.data(), data, n * sizeof(float));
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      double x;
      std::memcpy(&x, data + i * sizeof(double), sizeof(double));
      if (std::isfinite(x) &&
          std::fabs(x) > static_cast<double>(std::numeric_limits<float>::max())) {
        // Round-to-nearest would give FLT_MAX up to half an ulp above it; beyond, the
        // conversion is undefined behaviour in C++ and an infinity in practice. Refuse instead.
        std::ostringstream v;
        v.precision(17);
        v << x;
        format_fail(name, "float64 element " + std::to_string(i) + " = " + v.str() +
                              " is outside the float32 range (|x| <= 3.4028235e+38)");
      }
      array.data[i] = static_cast<float>(x);
    }
  }
  return array;
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

/// Reads exactly `size` bytes at `offset` (loops over short reads).
void read_exact(int fd, unsigned char* out, std::size_t size, std::uint64_t offset,
                const std::string& name) {
  std::size_t done = 0;
  while (done < size) {
    const ssize_t got = ::pread(fd, out + done, size - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      os_fail(name, "read failed", errno);
    }
    if (got == 0)
      format_fail(name, "file shrank while being read (expected " + std::to_string(size) +
                            " more bytes at offset " + std::to_string(offset + done) + ")");
    done += static_cast<std::size_t>(got);
  }
}

void write_all(int fd, const unsigned char* p, std::size_t size, const std::string& name) {
  while (size > 0) {
    const ssize_t put = ::write(fd, p, size);
    if (put < 0) {
      if (errno == EINTR) continue;
      os_fail(name, "write failed", errno);
    }
    p += put;
    size -= static_cast<std::size_t>(put);
  }
}

std::string header_text(std::span<const std::int64_t> shape) {
  std::string s = "{'descr': '<f4', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  s += "), }";
  return s;
}

}  // namespace

std::string shape_to_string(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string NpyArray::shape_string() const {
  return shape_to_string(shape);
}

NpyArray parse_npy(std::span<const unsigned char> bytes, const std::string& name) {
  const Layout layout = parse_layout(bytes, bytes.size(), name);
  return convert(layout, bytes.data() + layout.data_offset, name);
}

NpyArray read_npy(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) os_fail(path, "cannot open for reading", errno);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) os_fail(path, "cannot stat", errno);
  if (S_ISDIR(st.st_mode))
    throw FileError(ErrorCode::io_error, "npy file '" + path + "': is a directory");
  if (!S_ISREG(st.st_mode))
    throw FileError(ErrorCode::io_error, "npy file '" + path + "': not a regular file");
  const auto file_size = static_cast<std::uint64_t>(st.st_size);

  // Prefix first (at most 12 bytes), then the header whose length is now known and checked
  // against the file size, then the data whose size the header's shape has been checked against.
  unsigned char prefix[12];
  const std::size_t prefix_got = static_cast<std::size_t>(std::min<std::uint64_t>(file_size, 12));
  read_exact(fd.get(), prefix, prefix_got, 0, path);
  std::size_t prefix_len = prefix_got;
  std::uint64_t header_len = 0;
  if (prefix_got >= 8 && std::memcmp(prefix, kMagic, kMagicSize) == 0) {
    const int len_bytes = prefix[6] == 1 ? 2 : 4;
    if (prefix_got >= static_cast<std::size_t>(8 + len_bytes)) {
      prefix_len = static_cast<std::size_t>(8 + len_bytes);
      header_len = read_le(prefix + 8, len_bytes);
    }
  }
  std::vector<unsigned char> head(prefix, prefix + prefix_len);
  if (header_len > 0 && header_len <= file_size - prefix_len) {
    head.resize(prefix_len + static_cast<std::size_t>(header_len));
    read_exact(fd.get(), head.data() + prefix_len, static_cast<std::size_t>(header_len), prefix_len,
               path);
  }
  const Layout layout = parse_layout(head, file_size, path);  // throws on any inconsistency

  const std::uint64_t data_bytes = file_size - layout.data_offset;
  NpyArray result;
  if (layout.elem == Elem::f32) {
    result.shape = layout.header.shape;
    result.data.resize(static_cast<std::size_t>(layout.count));
    read_exact(fd.get(), reinterpret_cast<unsigned char*>(result.data.data()),
               static_cast<std::size_t>(data_bytes), layout.data_offset, path);
  } else {
    std::vector<unsigned char> raw(static_cast<std::size_t>(data_bytes));
    read_exact(fd.get(), raw.data(), raw.size(), layout.data_offset, path);
    result = convert(layout, raw.data(), path);
  }
  // A file that grew while being read is not what the header described.
  unsigned char extra;
  const ssize_t more = ::pread(fd.get(), &extra, 1, static_cast<off_t>(file_size));
  if (more > 0) format_fail(path, "file grew while being read");
  return result;
}

std::vector<unsigned char> encode_npy(std::span<const std::int64_t> shape,
                                      std::span<const float> data) {
  std::uint64_t count = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0)
      throw ArgumentError(ErrorCode::shape_mismatch, "write_npy: shape[" + std::to_string(i) +
                                                         "] must be >= 0; got " +
                                                         std::to_string(shape[i]));
    if (__builtin_mul_overflow(count, static_cast<std::uint64_t>(shape[i]), &count))
      throw ArgumentError(ErrorCode::overflow,
                          "write_npy: shape " + shape_to_string(shape) + " overflows 64 bits");
  }
  if (count != data.size())
    throw ArgumentError(ErrorCode::shape_mismatch,
                        "write_npy: shape " + shape_to_string(shape) + " has " +
                            std::to_string(count) + " elements but " + std::to_string(data.size()) +
                            " values were given");
  std::string header = header_text(shape);
  // 10-byte prefix + header + '\n' must be a multiple of 64 (numpy.lib.format's ARRAY_ALIGN).
  const std::size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  if (header.size() > 0xffff)
    throw ArgumentError(ErrorCode::overflow, "write_npy: header too long for format 1.0");
  std::vector<unsigned char> out;
  out.reserve(10 + header.size() + data.size_bytes());
  out.insert(out.end(), kMagic, kMagic + kMagicSize);
  out.push_back(1);
  out.push_back(0);
  out.push_back(static_cast<unsigned char>(header.size() & 0xff));
  out.push_back(static_cast<unsigned char>(header.size() >> 8));
  out.insert(out.end(), header.begin(), header.end());
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  out.insert(out.end(), p, p + data.size_bytes());
  return out;
}

void write_npy(const std::string& path, std::span<const std::int64_t> shape,
               std::span<const float> data) {
  const std::vector<unsigned char> bytes = encode_npy(shape, data);  // validates first

  static std::atomic<unsigned> counter{0};
  const std::string tmp =
      path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666));
  if (fd.get() < 0) os_fail(path, "cannot create temporary file '" + tmp + "'", errno);
  try {
    write_all(fd.get(), bytes.data(), bytes.size(), path);
    if (::fsync(fd.get()) != 0 && errno != EINVAL && errno != EROFS)
      os_fail(path, "fsync failed", errno);
    if (::close(fd.release()) != 0) os_fail(path, "close failed", errno);
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      os_fail(path, "cannot rename temporary file into place", errno);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

}  // namespace tokenmix::io
