// fsdp/errors.h: the exceptions fsdp-cpp throws.
//
// Policy (gloo's, for errors): bad input from a caller and failures of a peer are
// reported by throwing one of the types below, never by aborting the process. Every message names
// what it is about: the parameter or key, the rank, the shape or the file. Broken internal
// invariants throw InternalError; seeing one is a bug in fsdp-cpp.
//
// What a caller may do about each:
//   ValueError       fix the input (a dict, an option, a path); retrying the same call fails again
//   CorruptionError  (a ValueError) the file's bytes are damaged: restore it or load an older one
//   IOError          the system refused a file operation: retry once the cause is fixed
//   DistError        a peer died, hung or disagreed: the group is unusable; restart the job
//   StateError       the call is not allowed now (e.g. during backward): call it later
//   InternalError    a bug in fsdp-cpp: report it
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

/// The bytes of a file (or a message) are not what they claim to be: a checksum or CRC that does
/// not match, a file shorter than its metadata says, metadata, a manifest or an archive directory
/// that does not parse. The message names the file and, where known, the key. A kind of
/// ValueError (bad input), so handlers of that keep catching it. Retrying reads the same bytes:
/// restore the file or fall back to an earlier checkpoint.
class CorruptionError : public ValueError {
 public:
  using ValueError::ValueError;
};

/// The operating system refused a file operation (open, write, fsync, rename, mkdir): the
/// message names the operation and the path, error_code() is the errno. The operation left the
/// last committed checkpoint as it was; retrying may succeed once the cause (a full disk,
/// permissions, a network filesystem's hiccup) is gone.
class IOError : public Error {
 public:
  explicit IOError(const std::string& what, int error_code = 0)
      : Error(what), error_code_(error_code) {}
  /// The errno of the failed call; 0 if none was reported.
  int error_code() const noexcept { return error_code_; }

 private:
  int error_code_;
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
