// python/src/native_entry.hpp — the table of library entry points that the extension
// tokenmix._tokenmix hands to the optional PyTorch autograd node (python/src/torch_node.cpp,
// library libtokenmix_torch.so).
//
// The node is a separate shared library (it links libtorch; the extension must not, so that
// tokenmix imports without PyTorch). It does not link the C++ library either: it calls the
// extension's copy through this table, so there is one copy of the library's state (kernel
// registry, TOKENMIX_ISA / TOKENMIX_CPU_CAP resolution, per-thread scratch) in the process.
// Both sides are compiled from this header by the same build; `abi` guards against a node from
// another build.
#pragma once

#include <cstdint>
#include <string>

#include "tokenmix/attention.hpp"

namespace tokenmix_py {

// Each entry point calls the library function of the same name and returns true, or catches
// what it throws and returns false with *error = "tokenmix-native[<Python class>:<ErrorCode
// name>] <message>" (the node turns that into a C++ exception that PyTorch raises as a
// RuntimeError, and tokenmix._native turns it back into the tokenmix exception type). The node
// never sees the library's exception types.
struct NativeEntryPoints {
  static constexpr std::uint32_t kAbi = 1;  // bump when this struct or the signatures change
  std::uint32_t abi = kAbi;
  bool (*forward)(tokenmix::ConstTensorView q, tokenmix::ConstTensorView k,
                  tokenmix::ConstTensorView v, tokenmix::TensorView out, tokenmix::TensorView lse,
                  const tokenmix::AttentionOptions& options, std::string* error) = nullptr;
  bool (*backward)(tokenmix::ConstTensorView q, tokenmix::ConstTensorView k,
                   tokenmix::ConstTensorView v, tokenmix::ConstTensorView out,
                   tokenmix::ConstTensorView lse, tokenmix::ConstTensorView dout,
                   tokenmix::TensorView dq, tokenmix::TensorView dk, tokenmix::TensorView dv,
                   const tokenmix::AttentionOptions& options, std::string* error) = nullptr;
};

/// The extension's table (python/src/attention.cpp).
const NativeEntryPoints& native_entry_points();

}  // namespace tokenmix_py
