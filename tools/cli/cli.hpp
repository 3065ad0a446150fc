// tools/cli/cli.hpp — the whole `tokenmix` tool as a function (cli.cpp), so the CLI fuzzer
// (fuzz/fuzz_cli.cpp) can drive its argument parsing in-process.
#pragma once

namespace tokenmix::cli {

/// Parses argv and runs the chosen command; returns the exit code (0, 1 or 2). Never throws:
/// every error is reported as one "tokenmix: error: ..." line on stderr. With parse_only, a
/// command line that parses returns 0 without running the command.
int run_cli(int argc, char** argv, bool parse_only = false);

}  // namespace tokenmix::cli
