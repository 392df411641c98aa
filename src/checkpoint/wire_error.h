// Internal: an exception as it travels between ranks in a collective save, as text: its kind
// (and an IOError's errno) survive, so a disk that fills up on one rank is an IOError on every
// rank, and a corrupt file a CorruptionError, not a bare Error.
#pragma once

#include <exception>
#include <string>

#include "fsdp/errors.h"

namespace fsdp {
namespace checkpoint {
namespace wire {

/// "I<errno>;", "C", "V", "D", "S", "N" or "E" (by kind), then the message.
inline std::string encode(const std::exception& e) {
  if (const auto* io = dynamic_cast<const IOError*>(&e))
    return "I" + std::to_string(io->error_code()) + ";" + e.what();
  const char kind = dynamic_cast<const CorruptionError*>(&e) ? 'C'
                    : dynamic_cast<const ValueError*>(&e)    ? 'V'
                    : dynamic_cast<const DistError*>(&e)     ? 'D'
                    : dynamic_cast<const StateError*>(&e)    ? 'S'
                    : dynamic_cast<const InternalError*>(&e) ? 'N'
                                                             : 'E';
  return kind + std::string(e.what());
}

/// The message of an encoded error.
inline std::string message(const std::string& encoded) {
  if (encoded.empty()) return encoded;
  if (encoded[0] != 'I') return encoded.substr(1);
  const size_t semi = encoded.find(';');
  return semi == std::string::npos ? encoded.substr(1) : encoded.substr(semi + 1);
}

/// Throws `text` as the kind `encoded` was encoded with.
[[noreturn]] inline void rethrow(const std::string& encoded, const std::string& text) {
  switch (encoded.empty() ? 'E' : encoded[0]) {
    case 'I': {
      int err = 0;
      try {
        err = std::stoi(encoded.substr(1));
      } catch (const std::exception&) {
      }
      throw IOError(text, err);
    }
    case 'C':
      throw CorruptionError(text);
    case 'V':
      throw ValueError(text);
    case 'D':
      throw DistError(text);
    case 'S':
      throw StateError(text);
    case 'N':
      throw InternalError(text);
    default:  // a code no sender writes: our own message does not parse
      throw InternalError(text);
  }
}

}  // namespace wire
}  // namespace checkpoint
}  // namespace fsdp
