// python/src/errors.cpp — tokenmix's exception types in Python and the C++ → Python translator.
//
//   tokenmix::ArgumentError    → tokenmix.ArgumentError    (a ValueError)
//   tokenmix::UnsupportedError → tokenmix.UnsupportedError (a NotImplementedError)
//   tokenmix::FileError        → tokenmix.FileError        (an OSError)
//   tokenmix::ResourceError    → tokenmix.ResourceError    (a MemoryError)
// each with the C++ message and an attribute `code`, the ErrorCode name ("shape_mismatch", ...).
#include <exception>
#include <string>

#include "bindings.hpp"

namespace tokenmix_py {
namespace {

PyObject* g_argument_error = nullptr;
PyObject* g_unsupported_error = nullptr;
PyObject* g_file_error = nullptr;
PyObject* g_resource_error = nullptr;

void raise_with_code(PyObject* type, const tmx::Error& e) {
  PyObject* exc = PyObject_CallFunction(type, "s", e.what());
  if (exc == nullptr) return;  // the failed call left its own Python error set
  PyObject* code = PyUnicode_FromString(tmx::to_string(e.code()));
  if (code != nullptr) {
    PyObject_SetAttrString(exc, "code", code);
    Py_DECREF(code);
  }
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const tmx::UnsupportedError& e) {
    raise_with_code(g_unsupported_error, e);
  } catch (const tmx::ArgumentError& e) {
    raise_with_code(g_argument_error, e);
  } catch (const tmx::FileError& e) {
    raise_with_code(g_file_error, e);
  } catch (const tmx::ResourceError& e) {
    raise_with_code(g_resource_error, e);
  } catch (const tmx::Error& e) {
    raise_with_code(g_argument_error, e);
  }
  // Anything else propagates to nanobind's own translators.
}

}  // namespace

void bind_errors(nb::module_& m) {
  g_argument_error = PyErr_NewExceptionWithDoc(
      "tokenmix.ArgumentError",
      "Invalid arguments (shapes, values, strides, pointers, aliasing, overflow). Attribute "
      "`code` names the tokenmix ErrorCode.",
      PyExc_ValueError, nullptr);
  g_unsupported_error = PyErr_NewExceptionWithDoc(
      "tokenmix.UnsupportedError",
      "A valid request this build or CPU cannot serve (e.g. a forced ISA). Attribute `code`.",
      PyExc_NotImplementedError, nullptr);
  g_file_error = PyErr_NewExceptionWithDoc("tokenmix.FileError",
                                           "A malformed or unreadable file. Attribute `code`.",
                                           PyExc_OSError, nullptr);
  g_resource_error = PyErr_NewExceptionWithDoc(
      "tokenmix.ResourceError",
      "Memory a call needs (e.g. kernel scratch) could not be allocated (code 'out_of_memory'), "
      "or its size overflows 64-bit arithmetic (code 'overflow'). Attribute `code`.",
      PyExc_MemoryError, nullptr);
  if (g_argument_error == nullptr || g_unsupported_error == nullptr || g_file_error == nullptr ||
      g_resource_error == nullptr) {
    throw nb::python_error();
  }
  m.attr("ArgumentError") = nb::handle(g_argument_error);
  m.attr("UnsupportedError") = nb::handle(g_unsupported_error);
  m.attr("FileError") = nb::handle(g_file_error);
  m.attr("ResourceError") = nb::handle(g_resource_error);
  nb::register_exception_translator(translate);
}

void type_error(const std::string& msg) {
  throw nb::type_error(msg.c_str());
}
void value_error(const std::string& msg) {
  throw nb::value_error(msg.c_str());
}
void argument_error(tmx::ErrorCode code, const std::string& msg) {
  throw tmx::ArgumentError(code, msg);
}

}  // namespace tokenmix_py
