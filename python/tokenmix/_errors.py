"""The exception types of tokenmix.

They are created by the native extension (python/src/errors.cpp), which raises them for errors
of the C++ library, each with the library's message and an attribute ``code``, the name of the
tokenmix ErrorCode (``"shape_mismatch"``, ``"aliasing"``, ``"invalid_argument"``, ...):

- :class:`ArgumentError` (a ``ValueError``): invalid arguments — shapes, values, strides,
  pointers, aliasing, overflowing sizes, a thread count outside [0, 2**31 − 1];
- :class:`UnsupportedError` (a ``NotImplementedError``): a valid request this build or CPU cannot
  serve (e.g. a forced ISA the CPU lacks);
- :class:`FileError` (an ``OSError``): a malformed or unreadable file;
- :class:`ResourceError` (a ``MemoryError``): memory a call needs (e.g. a kernel's scratch for
  a huge head width) could not be allocated (``code == "out_of_memory"``), or its size overflows
  64-bit arithmetic (``"overflow"``); nothing has been written to any output. (Counts that
  overflow — ``visible_pairs`` beyond 2**63 − 1 — are an ArgumentError with code ``"overflow"``.)

Arrays of a dtype other than native-endian float32 raise ``TypeError`` (no silent conversion).
"""

from ._tokenmix import ArgumentError, FileError, ResourceError, UnsupportedError

__all__ = ["ArgumentError", "UnsupportedError", "FileError", "ResourceError"]
