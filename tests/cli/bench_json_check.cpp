// tests/cli/bench_json_check.cpp — helper of the CLI tests (tests/cli/tests.cmake): runs
// `tokenmix bench ... --json` and checks the JSON lines it prints against each other, from
// their own fields (the figures themselves are timings and are not checked).
//
//   bench_json_check TOOL [--lines N] [--values KEY=V1,V2,...]... [--lengths equal|mixed]
//                    [--runs R] -- ARGS...
//
// Runs `TOOL ARGS` R times (default 1; each must exit 0) and checks every run's stdout:
//   --lines N      exactly N JSON lines (one per case);
//   --values K=…   the values of key K over the lines are exactly the set V1, V2, … (e.g. the
//                  entries of a comma-separated list option, one case each);
//   every decode line: the keys of issue 16 are present and consistent (a relative tolerance of
//   1e-5 covers the 6 significant digits the JSON prints):
//     ratio = gbps / ceiling_gbps, gbps = kv_bytes / seconds, gflops = flops / seconds,
//     ratio_gflops = gflops / ceiling_gflops, tokens_per_s = batch · tq / seconds,
//     roofline_ms = 1e3 · max(kv_bytes / ceiling_gbps, flops / ceiling_gflops) (GB/s, GFLOP/s),
//     ratio_roofline = roofline_ms / (1e3 · seconds), ceiling_kind is forward's sgemm,
//     0 < seconds_min ≤ seconds ≤ seconds_max (the median between the fastest and slowest call);
//     without a window and with an unquantized cache: kv_bytes = 2 · Σ L_b · H_kv · d_h ·
//     sizeof(cache dtype) (SPEC "Useful-work counts", decode bytes); with T_new = 1 and no
//     window: flops = 4 · d_h · H_q · Σ L_b; with equal lengths and no window: flops =
//     4 · d_h · H_q · B · (T_new · T_k − T_new (T_new − 1) / 2) (bottom-right causal pairs);
//   --lengths equal: every decode line says "equal" and Σ L_b = B · T_k, min = max = T_k;
//   --lengths mixed: every line says "mixed", min ≥ T_k − ⌊T_k/2⌋, max ≤ T_k + ⌊T_k/2⌋,
//                  min ≤ max, and for B > 1: min < max and Σ L_b ≠ B · T_k;
//   --runs R > 1:  the lengths (lengths, cache_tokens_total/min/max) and the case keys are
//                  identical in every run (the mixed draw is deterministic).
// Exit 0 if every check holds, 1 otherwise (each failure printed), 2 on a usage error.
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using Object = std::map<std::string, std::string>;  // key → raw value (strings unquoted)

int failures = 0;

void fail(const std::string& what) {
  std::printf("FAIL: %s\n", what.c_str());
  ++failures;
}

// One flat JSON object per line: string, number, true/false/null, or an array of numbers (kept
// as its raw text).
Object parse_line(const std::string& line) {
  Object obj;
  std::size_t i = 0;
  const auto skip = [&] {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
  };
  const auto expect = [&](char c) {
    skip();
    if (i >= line.size() || line[i] != c)
      throw std::runtime_error("expected '" + std::string(1, c) + "' at column " +
                               std::to_string(i) + " of: " + line);
    ++i;
  };
  const auto string = [&] {
    expect('"');
    std::string s;
    while (i < line.size() && line[i] != '"') {
      if (line[i] == '\\' && i + 1 < line.size()) ++i;
      s += line[i++];
    }
    expect('"');
    return s;
  };
  expect('{');
  skip();
  if (i < line.size() && line[i] == '}') return obj;
  for (;;) {
    const std::string key = string();
    expect(':');
    skip();
    std::string value;
    if (i < line.size() && line[i] == '"') {
      value = string();
    } else if (i < line.size() && line[i] == '[') {
      const std::size_t end = line.find(']', i);
      if (end == std::string::npos) throw std::runtime_error("unterminated array in: " + line);
      value = line.substr(i, end + 1 - i);
      i = end + 1;
    } else {
      const std::size_t start = i;
      while (i < line.size() && line[i] != ',' && line[i] != '}') ++i;
      value = line.substr(start, i - start);
      while (!value.empty() && value.back() == ' ') value.pop_back();
    }
    if (obj.count(key)) throw std::runtime_error("duplicate key '" + key + "' in: " + line);
    obj[key] = value;
    skip();
    if (i < line.size() && line[i] == ',') {
      ++i;
      continue;
    }
    expect('}');
    return obj;
  }
}

std::string run_tool(const std::vector<std::string>& argv) {
  std::string cmd;
  for (const std::string& a : argv) {
    std::string q = "'";
    for (char c : a) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    cmd += q + "' ";
  }
  std::printf("$ %s\n", cmd.c_str());
  std::fflush(stdout);
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) throw std::runtime_error("cannot run " + cmd);
  std::string out;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error("the command did not exit 0 (status " + std::to_string(status) + ")");
  std::printf("%s", out.c_str());
  return out;
}

struct Line {
  Object obj;
  std::string text;
  const std::string& at(const std::string& key) const {
    const auto it = obj.find(key);
    if (it == obj.end()) throw std::runtime_error("key '" + key + "' missing in: " + text);
    return it->second;
  }
  double num(const std::string& key) const {
    const std::string& v = at(key);
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0')
      throw std::runtime_error("key '" + key + "' is not a number ('" + v + "') in: " + text);
    return x;
  }
};

void check_close(const Line& l, const char* what, double got, double want, double rel = 1e-5) {
  if (!(std::fabs(got - want) <= rel * std::max(std::fabs(want), 1e-300))) {
    std::ostringstream os;
    os.precision(10);
    os << what << ": " << got << ", recomputed " << want << " (line: " << l.text << ")";
    fail(os.str());
  }
}

std::size_t size_of(const std::string& dtype) {
  if (dtype == "f32") return 4;
  if (dtype == "bf16" || dtype == "f16") return 2;
  return 0;  // quantized: elements plus scales, not recomputed here
}

// The ceilings' kinds the tool's arguments ask for (tokenmix bench --gemm-n, --read-mib; their
// defaults otherwise).
struct CeilingKinds {
  std::string gemm = "openblas_sgemm_2048", read = "stream_read_1GiB";
};
CeilingKinds g_kinds;

void check_decode(const Line& l, const std::string& lengths) {
  // Every key of the decode JSON, old and new.
  for (const char* key : {"batch",
                          "tq",
                          "tk",
                          "hq",
                          "hkv",
                          "dh",
                          "seconds",
                          "gflops",
                          "ceiling_gflops",
                          "ratio",
                          "max_rel_err",
                          "extra_bytes",
                          "gbps",
                          "ceiling_gbps",
                          "tokens_per_s",
                          "err_vs_unquantized",
                          "kv_outlier",
                          "ratio_gflops",
                          "kv_bytes",
                          "flops",
                          "roofline_ms",
                          "ratio_roofline",
                          "seconds_min",
                          "seconds_max",
                          "cache_tokens_total",
                          "cache_tokens_min",
                          "cache_tokens_max"})
    (void)l.num(key);
  if (l.at("kv_profile") != "normal" && l.at("kv_profile") != "real")
    fail("kv_profile is '" + l.at("kv_profile") + "', expected normal or real");
  if (l.at("ceiling_kind") != g_kinds.gemm)
    fail("ceiling_kind is '" + l.at("ceiling_kind") + "', expected forward's " + g_kinds.gemm);
  if (l.at("ceiling_gbps_kind") != g_kinds.read)
    fail("ceiling_gbps_kind is '" + l.at("ceiling_gbps_kind") + "', expected " + g_kinds.read);
  const double s = l.num("seconds"), bytes = l.num("kv_bytes"), flops = l.num("flops");
  const double gbps_c = l.num("ceiling_gbps"), gflops_c = l.num("ceiling_gflops");
  if (!(s > 0 && gbps_c > 0 && gflops_c > 0 && bytes > 0 && flops > 0))
    fail("seconds, ceilings, kv_bytes and flops must be > 0: " + l.text);
  check_close(l, "gbps", l.num("gbps"), bytes / s * 1e-9);
  check_close(l, "gflops", l.num("gflops"), flops / s * 1e-9);
  check_close(l, "ratio", l.num("ratio"), l.num("gbps") / gbps_c, 2e-5);
  check_close(l, "ratio_gflops", l.num("ratio_gflops"), l.num("gflops") / gflops_c, 2e-5);
  check_close(l, "tokens_per_s", l.num("tokens_per_s"), l.num("batch") * l.num("tq") / s);
  const double roof = 1e3 * std::max(bytes / (gbps_c * 1e9), flops / (gflops_c * 1e9));
  check_close(l, "roofline_ms", l.num("roofline_ms"), roof);
  check_close(l, "ratio_roofline", l.num("ratio_roofline"), l.num("roofline_ms") / (s * 1e3), 2e-5);
  // The median lies between the fastest and the slowest call (6 significant digits each).
  const double s_min = l.num("seconds_min"), s_max = l.num("seconds_max");
  if (!(s_min > 0 && s_min <= s * (1 + 1e-5) && s <= s_max * (1 + 1e-5)))
    fail("seconds_min <= seconds <= seconds_max, all > 0, does not hold: " + l.text);

  const double B = l.num("batch"), Tn = l.num("tq"), Tk = l.num("tk"), H_q = l.num("hq"),
               H_kv = l.num("hkv"), D = l.num("dh"), total = l.num("cache_tokens_total"),
               lo = l.num("cache_tokens_min"), hi = l.num("cache_tokens_max");
  const bool windowed = l.at("window") != "null";
  const std::size_t elem = size_of(l.at("cache_dtype"));
  if (!windowed && elem != 0) check_close(l, "kv_bytes", bytes, 2 * total * H_kv * D * elem, 0);
  if (!windowed && Tn == 1) check_close(l, "flops", flops, 4 * D * H_q * total, 0);
  if (l.at("lengths") != lengths)
    fail("lengths is '" + l.at("lengths") + "', expected '" + lengths + "'");
  const double h = std::floor(Tk / 2);
  if (lengths == "equal") {
    check_close(l, "cache_tokens_total", total, B * Tk, 0);
    check_close(l, "cache_tokens_min", lo, Tk, 0);
    check_close(l, "cache_tokens_max", hi, Tk, 0);
    if (!windowed && Tn <= Tk)
      check_close(l, "flops", flops, 4 * D * H_q * B * (Tn * Tk - Tn * (Tn - 1) / 2), 0);
  } else {
    if (!(lo >= Tk - h && hi <= Tk + h && lo <= hi && total >= B * lo && total <= B * hi))
      fail("mixed lengths outside [T_k - T_k/2, T_k + T_k/2]: " + l.text);
    if (B > 1 && !(lo < hi)) fail("mixed lengths are all equal: " + l.text);
    if (B > 1 && total == B * Tk) fail("mixed lengths total B * T_k: " + l.text);
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 3) throw std::invalid_argument("usage: bench_json_check TOOL [options] -- ARGS");
    std::vector<std::string> tool_argv{argv[1]};
    long lines = -1, runs = 1;
    std::string lengths;
    std::vector<std::pair<std::string, std::set<std::string>>> values;
    int i = 2;
    for (; i < argc && std::string(argv[i]) != "--"; ++i) {
      const std::string a = argv[i];
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      const std::string v = argv[++i];
      if (a == "--lines") {
        lines = std::stol(v);
      } else if (a == "--runs") {
        runs = std::stol(v);
      } else if (a == "--lengths") {
        lengths = v;
      } else if (a == "--values") {
        const std::size_t eq = v.find('=');
        if (eq == std::string::npos) throw std::invalid_argument("--values needs KEY=V1,V2,...");
        std::set<std::string> set;
        std::stringstream ss(v.substr(eq + 1));
        for (std::string item; std::getline(ss, item, ',');) set.insert(item);
        values.emplace_back(v.substr(0, eq), set);
      } else {
        throw std::invalid_argument("unknown option " + a);
      }
    }
    if (i >= argc) throw std::invalid_argument("missing -- ARGS");
    for (++i; i < argc; ++i) tool_argv.push_back(argv[i]);
    for (std::size_t k = 1; k + 1 < tool_argv.size(); ++k) {
      const long n = tool_argv[k] == "--gemm-n" || tool_argv[k] == "--read-mib"
                         ? std::stol(tool_argv[k + 1])
                         : 0;
      if (tool_argv[k] == "--gemm-n") g_kinds.gemm = "openblas_sgemm_" + std::to_string(n);
      if (tool_argv[k] == "--read-mib") {
        g_kinds.read = "stream_read_" + (n % 1024 == 0 ? std::to_string(n / 1024) + "GiB"
                                                       : std::to_string(n) + "MiB");
      }
    }

    std::vector<std::vector<Line>> all;
    for (long r = 0; r < runs; ++r) {
      std::vector<Line> parsed;
      std::stringstream out(run_tool(tool_argv));
      for (std::string text; std::getline(out, text);)
        if (!text.empty() && text[0] == '{') parsed.push_back({parse_line(text), text});
      if (lines >= 0 && static_cast<long>(parsed.size()) != lines)
        fail("run " + std::to_string(r) + ": " + std::to_string(parsed.size()) +
             " JSON lines, expected " + std::to_string(lines));
      for (const auto& [key, want] : values) {
        std::set<std::string> got;
        for (const Line& l : parsed) got.insert(l.at(key));
        if (got != want) {
          std::string g;
          for (const std::string& x : got) g += x + " ";
          fail("values of " + key + " are { " + g + "}");
        }
      }
      for (const Line& l : parsed)
        if (l.at("op") == "decode") check_decode(l, lengths.empty() ? "equal" : lengths);
      all.push_back(std::move(parsed));
    }
    for (std::size_t r = 1; r < all.size(); ++r) {
      if (all[r].size() != all[0].size()) {
        fail("runs printed different numbers of lines");
        continue;
      }
      for (std::size_t k = 0; k < all[r].size(); ++k)
        for (const char* key :
             {"op", "batch", "tq", "tk", "cache_dtype", "lengths", "cache_tokens_total",
              "cache_tokens_min", "cache_tokens_max", "kv_bytes", "flops"}) {
          const auto a = all[0][k].obj.find(key), b = all[r][k].obj.find(key);
          const std::string va = a == all[0][k].obj.end() ? "(none)" : a->second;
          const std::string vb = b == all[r][k].obj.end() ? "(none)" : b->second;
          if (va != vb)
            fail("run " + std::to_string(r) + " line " + std::to_string(k) + ": " + key + " " + vb +
                 " differs from run 0's " + va);
        }
    }
    std::printf(failures ? "%d check(s) failed\n" : "all checks passed\n", failures);
    return failures ? 1 : 0;
  } catch (const std::invalid_argument& e) {
    std::printf("bench_json_check: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
}
