// tests/unit/test_npy.cpp — the .npy reader/writer of src/io (used by `tokenmix run --q ...`).
//
// Round trips, float64 → float32 conversion, and one test per kind of malformed file, each
// written byte by byte into a temporary directory. Every rejection must be a FileError with the
// right code whose message names the file and says what was expected and what was found, and a
// failed write must leave nothing behind.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "io/npy.hpp"
#include "tokenmix/error.hpp"

namespace {

namespace fs = std::filesystem;
using tokenmix::ErrorCode;
using tokenmix::FileError;
using tokenmix::io::NpyArray;
using tokenmix::io::read_npy;
using tokenmix::io::write_npy;
using Bytes = std::vector<unsigned char>;

class NpyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::temp_directory_path() / "tokenmix_npy_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::string write_file(const std::string& name, const Bytes& bytes) const {
    const std::string p = path(name);
    std::ofstream f(p, std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(f.good());
    return p;
  }

  /// Names of the entries of the temporary directory (to check nothing was left behind).
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_))
      names.push_back(e.path().filename().string());
    return names;
  }

  /// Reads `p` expecting a FileError with `code` whose message contains the file name and every
  /// one of `parts`.
  static void expect_rejected(const std::string& p, std::initializer_list<std::string> parts,
                              ErrorCode code = ErrorCode::format_error) {
    NpyArray out{{7}, {1, 2, 3, 4, 5, 6, 7}};
    try {
      out = read_npy(p);
      ADD_FAILURE() << "read_npy accepted " << p;
    } catch (const FileError& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      const std::string msg = e.what();
      EXPECT_NE(msg.find(p), std::string::npos) << "message does not name the file: " << msg;
      for (const auto& part : parts)
        EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in: " << msg;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "wrong exception type: " << e.what();
    }
    // Never half-read: the destination is untouched.
    EXPECT_EQ(out.shape, std::vector<std::int64_t>{7});
    EXPECT_EQ(out.data.size(), 7u);
  }

  fs::path dir_;
};

/// A .npy file: magic, version, header-length field, the header text (padded to 64 bytes and
/// ended by '\n' unless `raw_header`), then `data`.
Bytes npy_bytes(const std::string& dict, const Bytes& data, int major = 1, int minor = 0,
                bool raw_header = false) {
  std::string header = dict;
  const std::size_t prefix = major == 1 ? 10 : 12;
  if (!raw_header) {
    header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
    header += '\n';
  }
  Bytes out = {0x93,
               'N',
               'U',
               'M',
               'P',
               'Y',
               static_cast<unsigned char>(major),
               static_cast<unsigned char>(minor)};
  const std::size_t len = header.size();
  out.push_back(static_cast<unsigned char>(len & 0xff));
  out.push_back(static_cast<unsigned char>((len >> 8) & 0xff));
  if (major != 1) {
    out.push_back(static_cast<unsigned char>((len >> 16) & 0xff));
    out.push_back(static_cast<unsigned char>((len >> 24) & 0xff));
  }
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

template <class T>
Bytes raw(const std::vector<T>& values) {
  Bytes b(values.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), values.data(), b.size());
  return b;
}

std::string dict(const std::string& descr, const std::string& shape, bool fortran = false) {
  return "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") +
         ", 'shape': " + shape + ", }";
}

// --- round trips ------------------------------------------------------------------------------

TEST_F(NpyTest, RoundTripPreservesShapeAndBits) {
  std::mt19937 rng(42);
  std::normal_distribution<float> dist;
  const std::vector<std::vector<std::int64_t>> shapes = {{2, 3, 4, 5}, {7},    {},      {0, 3},
                                                         {1, 1, 1, 1}, {3, 0}, {129, 3}};
  int i = 0;
  for (const auto& shape : shapes) {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<float> data(static_cast<std::size_t>(n));
    for (auto& x : data) x = dist(rng);
    if (n > 2) {
      data[0] = std::numeric_limits<float>::infinity();
      data[1] = -0.0f;
      data[2] = std::numeric_limits<float>::denorm_min();
    }
    const std::string p = path("rt" + std::to_string(i++) + ".npy");
    write_npy(p, shape, data);
    const NpyArray back = read_npy(p);
    EXPECT_EQ(back.shape, shape);
    ASSERT_EQ(back.data.size(), data.size());
    if (!data.empty()) {
      EXPECT_EQ(std::memcmp(back.data.data(), data.data(), data.size() * sizeof(float)), 0);
    }

    // Layout: version 1.0, data 64-byte aligned, header ends with '\n'.
    std::ifstream f(p, std::ios::binary);
    const Bytes bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    ASSERT_GE(bytes.size(), 10u);
    EXPECT_EQ(bytes[6], 1);
    EXPECT_EQ(bytes[7], 0);
    const std::size_t header_len = bytes[8] | (bytes[9] << 8);
    EXPECT_EQ((10 + header_len) % 64, 0u);
    EXPECT_EQ(bytes[10 + header_len - 1], '\n');
    EXPECT_EQ(bytes.size(), 10 + header_len + data.size() * sizeof(float));
    const std::string header(bytes.begin() + 10,
                             bytes.begin() + 10 + static_cast<long>(header_len));
    EXPECT_NE(header.find("'descr': '<f4'"), std::string::npos) << header;
    EXPECT_NE(header.find("'fortran_order': False"), std::string::npos) << header;
    if (shape.size() == 1) {
      EXPECT_NE(header.find("(7,)"), std::string::npos) << header;
    }
  }
  EXPECT_EQ(listing().size(), shapes.size());  // no temporary files left behind
}

TEST_F(NpyTest, OverwriteReplacesExistingFile) {
  const std::string p = path("x.npy");
  write_npy(p, std::vector<std::int64_t>{3}, std::vector<float>{1, 2, 3});
  write_npy(p, std::vector<std::int64_t>{2}, std::vector<float>{4, 5});
  const NpyArray a = read_npy(p);
  EXPECT_EQ(a.shape, std::vector<std::int64_t>{2});
  EXPECT_EQ(a.data, (std::vector<float>{4, 5}));
  EXPECT_EQ(listing(), std::vector<std::string>{"x.npy"});
}

TEST_F(NpyTest, ParseInMemoryMatchesFile) {
  const std::vector<float> data = {1.5f, -2.0f, 3.25f, 0.0f, 8.0f, 1e-3f};
  const std::vector<std::int64_t> shape = {2, 3};
  const Bytes bytes = tokenmix::io::encode_npy(shape, data);
  const NpyArray a = tokenmix::io::parse_npy(bytes, "mem");
  EXPECT_EQ(a.shape, shape);
  EXPECT_EQ(a.data, data);
}

TEST_F(NpyTest, AcceptsVersions2And3AndNativeByteOrderMarks) {
  const std::vector<float> v = {1.0f, -2.5f, 3.0f};
  const Bytes data = raw(v);
  for (const auto& [major, descr] :
       std::vector<std::pair<int, std::string>>{{2, "<f4"}, {3, "<f4"}, {1, "=f4"}, {1, "|f4"}}) {
    std::string name = "v";  // e.g. "v2<.npy"
    name += std::to_string(major);
    name += descr[0];
    name += ".npy";
    const std::string p = write_file(name, npy_bytes(dict(descr, "(3,)"), data, major));
    const NpyArray a = read_npy(p);
    EXPECT_EQ(a.shape, std::vector<std::int64_t>{3}) << major << " " << descr;
    EXPECT_EQ(a.data, v) << major << " " << descr;
  }
  // Key order, double quotes, no trailing comma, Python 2 long suffix: all valid NumPy headers.
  const std::string p = write_file(
      "style.npy",
      npy_bytes("{\"shape\": (1L, 3L), \"fortran_order\": False, \"descr\": \"<f4\"}", data));
  const NpyArray a = read_npy(p);
  EXPECT_EQ(a.shape, (std::vector<std::int64_t>{1, 3}));
  EXPECT_EQ(a.data, v);
}

TEST_F(NpyTest, ConvertsFloat64ToFloat32) {
  const std::vector<double> v = {1.5,
                                 -2.25,
                                 1e-3,
                                 0.1,
                                 3.4028234663852886e38,
                                 -1e-300,
                                 std::numeric_limits<double>::infinity(),
                                 std::numeric_limits<double>::quiet_NaN()};
  for (const std::string descr : {"<f8", "=f8"}) {
    const std::string p =
        write_file("f8" + descr.substr(0, 1) + ".npy", npy_bytes(dict(descr, "(2, 4)"), raw(v)));
    const NpyArray a = read_npy(p);
    EXPECT_EQ(a.shape, (std::vector<std::int64_t>{2, 4}));
    ASSERT_EQ(a.data.size(), v.size());
    for (std::size_t i = 0; i + 1 < v.size(); ++i)
      EXPECT_EQ(a.data[i], static_cast<float>(v[i])) << i;
    EXPECT_TRUE(std::isnan(a.data.back()));
  }
}

TEST_F(NpyTest, RejectsFloat64OutsideFloat32Range) {
  const std::string p =
      write_file("big.npy", npy_bytes(dict("<f8", "(3,)"), raw(std::vector<double>{1, 1e300, 2})));
  expect_rejected(p, {"element 1", "1e+300", "float32 range"});
}

// --- malformed files --------------------------------------------------------------------------

TEST_F(NpyTest, RejectsBadMagic) {
  Bytes b = npy_bytes(dict("<f4", "(1,)"), raw(std::vector<float>{1}));
  b[5] = 'X';
  expect_rejected(write_file("magic.npy", b), {"bad magic", "expected", "\\x93NUMPY", "NUMPX"});
  expect_rejected(write_file("empty.npy", {}), {"bad magic", "only 0 bytes"});
  expect_rejected(write_file("text.npy", Bytes{'h', 'e', 'l', 'l', 'o', ',', ' ', 'w'}),
                  {"bad magic", "found \"hello,\""});
}

TEST_F(NpyTest, RejectsUnsupportedVersion) {
  const Bytes data = raw(std::vector<float>{1});
  expect_rejected(write_file("v4.npy", npy_bytes(dict("<f4", "(1,)"), data, 4, 0)),
                  {"unsupported format version 4.0", "expected 1.0, 2.0 or 3.0"});
  expect_rejected(write_file("v11.npy", npy_bytes(dict("<f4", "(1,)"), data, 1, 1)),
                  {"unsupported format version 1.1"});
}

TEST_F(NpyTest, RejectsTruncatedHeader) {
  const Bytes full = npy_bytes(dict("<f4", "(4,)"), raw(std::vector<float>{1, 2, 3, 4}));
  // Cut inside the header text: the length field promises more than the file holds.
  expect_rejected(write_file("cut_header.npy", Bytes(full.begin(), full.begin() + 40)),
                  {"truncated header", "says 118 bytes", "only 30 bytes"});
  // Cut inside the version / length fields.
  expect_rejected(write_file("cut_version.npy", Bytes(full.begin(), full.begin() + 7)),
                  {"truncated header", "before the version"});
  expect_rejected(write_file("cut_len.npy", Bytes(full.begin(), full.begin() + 9)),
                  {"truncated header", "header-length field"});
  // A version 2.0 length field claiming ~4 GiB.
  Bytes huge = npy_bytes(dict("<f4", "(1,)"), raw(std::vector<float>{1}), 2);
  huge[8] = huge[9] = huge[10] = huge[11] = 0xff;
  expect_rejected(write_file("huge_header.npy", huge), {"truncated header", "4294967295"});
}

TEST_F(NpyTest, RejectsTruncatedData) {
  const Bytes data = raw(std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8, 9});  // 36 bytes
  expect_rejected(write_file("short.npy", npy_bytes(dict("<f4", "(10,)"), data)),
                  {"truncated data", "[10]", "needs 40 data bytes", "holds only 36"});
  expect_rejected(write_file("nodata.npy", npy_bytes(dict("<f8", "(2, 3)"), {})),
                  {"truncated data", "needs 48 data bytes", "holds only 0"});
}

TEST_F(NpyTest, RejectsDataLongerThanShape) {
  const Bytes data = raw(std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});  // 44 bytes
  expect_rejected(write_file("long.npy", npy_bytes(dict("<f4", "(10,)"), data)),
                  {"does not match the header", "needs 40 data bytes", "holds 44", "4 extra"});
}

TEST_F(NpyTest, RejectsUnsupportedDtypes) {
  const Bytes data = raw(std::vector<std::int32_t>{1, 2});
  for (const std::string descr : {"<i4", "<u4", "<f2", "<c8", "<f16", "float32", "f4", "O"}) {
    expect_rejected(write_file("dtype.npy", npy_bytes(dict(descr, "(2,)"), data)),
                    {"unsupported dtype '" + descr + "'", "expected little-endian float32 '<f4'"});
  }
  expect_rejected(write_file("big_endian.npy", npy_bytes(dict(">f4", "(2,)"), data)),
                  {"unsupported dtype '>f4'", "big-endian"});
  // Structured dtype: descr is a list, not a string.
  expect_rejected(
      write_file(
          "struct.npy",
          npy_bytes("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", data)),
      {"malformed header", "'descr' must be a quoted dtype string", "[('a'"});
}

TEST_F(NpyTest, RejectsFortranOrder) {
  const Bytes data = raw(std::vector<float>{1, 2, 3, 4, 5, 6});
  expect_rejected(write_file("fortran.npy", npy_bytes(dict("<f4", "(2, 3)", true), data)),
                  {"fortran_order is True", "C-order"});
}

TEST_F(NpyTest, RejectsMalformedDict) {
  const Bytes data = raw(std::vector<float>{1, 2});
  struct Case {
    std::string header;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"'descr': '<f4', 'fortran_order': False, 'shape': (2,)", "expected '{'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), ", "'}' closing"},
      {"{'descr': '<f4', 'shape': (2,), }", "lacks the key(s) 'fortran_order'"},
      {"{'fortran_order': False}", "lacks the key(s) 'descr' 'shape'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'extra': 1}",
       "unexpected key 'extra'"},
      {"{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}",
       "'descr' appears twice"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': [2]}", "'(' opening the 'shape'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2)}", "'(n,)'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2.0,)}", "expected ',' or ')'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (two,)}", "must be integers"},
      {"{'descr': '<f4', 'fortran_order': 0, 'shape': (2,)}", "must be True or False"},
      {"{'descr': '<f4, 'fortran_order': False, 'shape': (2,)}", "expected ',' or '}'"},
      {"{'descr': '<f4' 'fortran_order': False, 'shape': (2,)}", "expected ',' or '}'"},
      {"{descr: '<f4', 'fortran_order': False, 'shape': (2,)}", "a quoted dict key"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} junk", "after the header dict"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x", "unterminated string"},
      {"", "expected '{'"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.header);
    expect_rejected(write_file("dict.npy", npy_bytes(c.header, data)),
                    {"malformed header", c.expect});
  }
}

TEST_F(NpyTest, RejectsHugeAndOverflowingShapesBeforeAllocating) {
  const Bytes data = raw(std::vector<float>{1, 2});
  // Product of dimensions overflows 64 bits.
  expect_rejected(write_file("ovf.npy", npy_bytes(dict("<f4", "(4294967296, 4294967296)"), data)),
                  {"[4294967296, 4294967296]", "overflows 64 bits"});
  // Element count fits, byte count (x 8) does not.
  expect_rejected(
      write_file("ovf_bytes.npy", npy_bytes(dict("<f8", "(4611686018427387904,)"), data)),
      {"more than 2^64 bytes"});
  // A dimension that does not fit in int64 at all.
  expect_rejected(
      write_file("ovf_dim.npy", npy_bytes(dict("<f4", "(99999999999999999999,)"), data)),
      {"shape[0]", "does not fit in 64 bits"});
  // Fits in 64 bits but is absurd (4 TiB): rejected against the file size, nothing allocated.
  expect_rejected(write_file("huge.npy", npy_bytes(dict("<f4", "(1024, 1024, 1024, 1024)"), data)),
                  {"truncated data", "needs 4398046511104 data bytes", "holds only 8"});
}

TEST_F(NpyTest, RejectsNegativeDimensions) {
  const Bytes data = raw(std::vector<float>{1, 2});
  expect_rejected(write_file("neg.npy", npy_bytes(dict("<f4", "(2, -1)"), data)),
                  {"shape[1] is negative (-1)", "must be >= 0"});
}

TEST_F(NpyTest, RejectsNonAsciiVersion1Header) {
  const Bytes data = raw(std::vector<float>{1, 2});
  expect_rejected(write_file("utf8.npy", npy_bytes(dict("<f4", "(2,)") + "\xc3\xa9", data)),
                  {"non-ASCII"});
}

TEST_F(NpyTest, OsErrorsAreIoErrors) {
  expect_rejected(path("does_not_exist.npy"), {"cannot open", "No such file"}, ErrorCode::io_error);
  fs::create_directory(path("sub.npy"));
  expect_rejected(path("sub.npy"), {"directory"}, ErrorCode::io_error);
}

// --- failed writes leave nothing --------------------------------------------------------------

TEST_F(NpyTest, FailedWriteLeavesNothing) {
  // Inconsistent arguments: rejected before any file is created.
  EXPECT_THROW(
      write_npy(path("bad.npy"), std::vector<std::int64_t>{2, 2}, std::vector<float>{1, 2, 3}),
      tokenmix::ArgumentError);
  EXPECT_THROW(write_npy(path("neg.npy"), std::vector<std::int64_t>{-1}, std::vector<float>{}),
               tokenmix::ArgumentError);
  EXPECT_TRUE(listing().empty());

  // Directory that does not exist: io_error naming the file, nothing created.
  const std::string missing_dir = path("nope/x.npy");
  try {
    write_npy(missing_dir, std::vector<std::int64_t>{1}, std::vector<float>{1});
    ADD_FAILURE() << "write into a missing directory succeeded";
  } catch (const FileError& e) {
    EXPECT_EQ(e.code(), ErrorCode::io_error);
    EXPECT_NE(std::string(e.what()).find(missing_dir), std::string::npos) << e.what();
  }
  EXPECT_TRUE(listing().empty());

  // Destination is a directory: rename fails, the temporary file is removed.
  fs::create_directory(path("dir.npy"));
  EXPECT_THROW(write_npy(path("dir.npy"), std::vector<std::int64_t>{1}, std::vector<float>{1}),
               FileError);
  EXPECT_EQ(listing(), std::vector<std::string>{"dir.npy"});

  // A directory we may not write into (skipped as root, who may write anywhere).
  if (::geteuid() != 0) {
    fs::create_directory(path("ro"));
    fs::permissions(path("ro"), fs::perms::owner_read | fs::perms::owner_exec);
    EXPECT_THROW(write_npy(path("ro/x.npy"), std::vector<std::int64_t>{1}, std::vector<float>{1}),
                 FileError);
    fs::permissions(path("ro"), fs::perms::owner_all);
    EXPECT_TRUE(fs::is_empty(path("ro")));
  }
}

}  // namespace
