// tools/cli/cli.cpp — the `tokenmix` command-line tool as a function, run_cli (cli.hpp): its
// main() is main.cpp, and the CLI fuzzer (fuzz/fuzz_cli.cpp) calls it in-process.
//
//   tokenmix run     attention on a Llama-3-8B-shaped layer (default) or on your .npy tensors
//   tokenmix check   built-in self-checks against the float64 oracle, one PASS/FAIL line each
//   tokenmix info    version, CPU, ISA features, kernel paths, threads
//   tokenmix bench   kernels vs the machine's ceilings measured in the same run
//
// Exit codes: 0 success (and --help), 1 a check failed or an error bound was exceeded, 2 any
// error — bad usage, bad input, or a tokenmix::Error — reported as exactly one stderr line
// "tokenmix: error: <message>". Nothing aborts: every exception is caught here.
#include "cli.hpp"

#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "common.hpp"

namespace {

/// Exactly one line on stderr, whatever the message contains.
int report_error(std::string message) {
  for (char& c : message)
    if (c == '\n' || c == '\r') c = ' ';
  while (!message.empty() && message.back() == ' ') message.pop_back();
  std::cerr << "tokenmix: error: " << message << std::endl;
  return tokenmix::cli::kExitError;
}

int run_main(int argc, char** argv, bool parse_only) {
  using namespace tokenmix::cli;
  CLI::App app{"tokenmix " + std::string(tokenmix::version()) +
                   " - exact causal self-attention (SPEC 4.1-4.8) on CPUs",
               "tokenmix"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(tokenmix::version()));
  app.footer(
      "Exit codes: 0 success, 1 a check failed, 2 an error (one line on stderr).\n"
      "Run 'tokenmix <command> --help' for the options of one command.\n");

  const std::vector<Command> commands = {add_run_command(app), add_check_command(app),
                                         add_info_command(app), add_bench_command(app)};
  if (argc > 1 && argv[1][0] != '-') {  // CLI11 would only say "A subcommand is required"
    bool known = false;
    for (const Command& c : commands) known = known || c.app->check_name(argv[1]);
    if (!known)
      return report_error("unknown command '" + std::string(argv[1]) +
                          "'; expected run, check, info or bench (see 'tokenmix --help')");
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help / --version: CLI11 prints them (stdout) and reports success.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    return report_error(std::string(e.what()) + " (see 'tokenmix --help')");
  }
  for (const Command& c : commands)
    if (c.app->parsed()) return parse_only ? tokenmix::cli::kExitOk : c.run();
  return report_error("no command given (see 'tokenmix --help')");
}

}  // namespace

int tokenmix::cli::run_cli(int argc, char** argv, bool parse_only) {
  try {
    return run_main(argc, argv, parse_only);
  } catch (const tokenmix::Error& e) {
    return report_error(e.what());
  } catch (const std::bad_alloc&) {
    return report_error("out of memory");
  } catch (const std::exception& e) {
    return report_error(e.what());
  } catch (...) {
    return report_error("unknown exception");
  }
}
