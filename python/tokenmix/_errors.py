"""The exception types of tokenmix.

They are created by the native extension (python/src/errors.cpp), which raises them for errors
of the C++ library, each with the library's message and an attribute ``code``, the name of the
tokenmix ErrorCode (``"shape_mismatch"``, ``"aliasing"``, ``"invalid_argument"``, ...):

- :class:`ArgumentError` (a ``ValueError``): invalid arguments — shapes, values, strides,
  pointers, aliasing, overflowing sizes, a thread count outside [0, 2**31 − 1];
- :class:`UnsupportedError` (a ``NotImplementedError``): a valid request this build or CPU cannot
  serve (e.g. a forced ISA the CPU lacks);
- :class:`FileError` (an ``OSError``): a malformed or unreadable file.

Arrays of a dtype other than native-endian float32 raise ``TypeError`` (no silent conversion).
"""

from ._tokenmix import ArgumentError, FileError, UnsupportedError

__all__ = ["ArgumentError", "UnsupportedError", "FileError"]
