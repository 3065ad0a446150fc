// fuzz/fuzz_cli.cpp — libFuzzer target for the argument parsing of the `tokenmix` tool.
//
// The input is a command line: arguments separated by NUL or newline bytes (at most 24). It is
// parsed by the real tool (tools/cli's run_cli, linked without its main()) in parse-only mode:
// a command line that parses returns 0 without running the command (no attention, no files, no
// benchmarks). The contract: exit code 0 (parsed, or --help/--version) or 2 (one-line error),
// never a crash, an escaping exception or a sanitizer report. Run with -close_fd_mask=3: the
// tool's --help text and error lines would otherwise flood the log.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "cli.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> args{"tokenmix"};
  std::string current;
  for (std::size_t i = 0; i < size && args.size() < 24; ++i) {
    const char c = static_cast<char>(data[i]);
    if (c == '\0' || c == '\n') {
      args.push_back(current);
      current.clear();
    } else {
      current.push_back(c);
    }
  }
  if (!current.empty() && args.size() < 24) args.push_back(current);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int rc = tokenmix::cli::run_cli(static_cast<int>(args.size()), argv.data(), true);
  if (rc != 0 && rc != 2) std::abort();
  return 0;
}
