// fsdp/errors.h: the exceptions fsdp-cpp throws.
//
// Policy (borrowed from gloo's docs/errors.md): bad input from a caller and failures of a peer are
// reported by throwing one of the types below, never by aborting the process. Every message names
// what it is about: the parameter or key, the rank, the shape or the file. Broken internal
// invariants throw InternalError; seeing one is a bug in fsdp-cpp.
#pragma once

#include <stdexcept>
#include <string>

namespace fsdp {

/// Base of every exception fsdp-cpp throws itself.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The caller passed something unusable (PyTorch raises ValueError for these): parameters of mixed
/// dtypes, a shape that does not match, ranks that disagree on a model's layout. Not retryable
/// without changing the input.
class ValueError : public Error {
 public:
  using Error::Error;
};

/// A collective failed or timed out, usually because a peer died or disagreed. The message names
/// the operation, the group and this rank. The process group should be considered unusable.
class DistError : public Error {
 public:
  using Error::Error;
};

/// An operation was called in a state that does not allow it (e.g. reducing gradients of a handle
/// that is not unsharded where that is required). A usage error, not a data error.
class StateError : public Error {
 public:
  using Error::Error;
};

/// An invariant of fsdp-cpp itself does not hold. A bug; please report it.
class InternalError : public Error {
 public:
  using Error::Error;
};

}  // namespace fsdp
