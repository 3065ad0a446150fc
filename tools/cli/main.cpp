// tools/cli/main.cpp — the `tokenmix` command-line tool's entry point; the tool itself is
// run_cli (cli.cpp), which the CLI fuzzer (fuzz/fuzz_cli.cpp) links without this file.
#include "cli.hpp"

int main(int argc, char** argv) {
  return tokenmix::cli::run_cli(argc, argv);
}
