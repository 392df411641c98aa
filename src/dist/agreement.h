// Internal: "every rank agrees or every rank throws", the one way the library's collective steps
// end. Each rank runs its local part of a step (check a dict, write a file, read a header), which
// may fail; the ranks then exchange verdicts, and either every rank goes on, knowing what every
// other rank said, or every rank throws. Without the exchange a rank that failed alone would leave
// the others waiting in a collective it never joins, until the timeout.
//
// A failure keeps its kind across ranks: a disk that fills up on rank 2 is an IOError with its
// errno on every rank, a corrupt file a CorruptionError, a malformed dict a ValueError. The text
// every rank throws names the failing rank; the caller says what failed (`Verdicts::throw_first`).
//
// Exported to the layers above dist/ (docs/layers.md): runtime/ (wrap_deferred), state_dict/ and
// checkpoint/ use it.
#pragma once

#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace fsdp {
namespace dist {

class ProcessGroup;

/// One rank's outcome of its part of a collective step: fine, with a payload for the other ranks
/// (often empty), or failed, with the kind, errno and message of what it threw.
class Verdict {
 public:
  /// Fine, telling the other ranks `payload`.
  explicit Verdict(std::string payload = {});
  /// Failed with `e`, whose kind (fsdp/errors.h; any other exception counts as an InternalError
  /// elsewhere) and an IOError's errno travel with its message. The rank that made this verdict
  /// rethrows `e` itself (`rethrow_own`).
  static Verdict failed(const std::exception& e);
  /// Runs `step`: fine with what it returns, or failed with what it throws.
  static Verdict of(const std::function<std::string()>& step);

  bool ok() const { return ok_; }
  /// What a fine verdict tells the others (empty for a failed one).
  const std::string& payload() const { return ok_ ? text_ : empty(); }
  /// A failed verdict's message (empty for a fine one).
  const std::string& message() const { return ok_ ? empty() : text_; }

  /// Throws `text` as this failure's kind. Requires !ok().
  [[noreturn]] void raise(const std::string& text) const;
  /// On the rank that made it from an exception: that exception, as it was thrown; elsewhere as
  /// raise(message()). Requires !ok().
  [[noreturn]] void rethrow_own() const;

  /// One encoding for every exchange: "K" and the payload, or "E", the kind's letter, an IOError's
  /// errno and ';', and the message. decode() reads every string encode() writes; anything else is
  /// a failure (an InternalError) saying so.
  std::string encode() const;
  static Verdict decode(const std::string& bytes);

 private:
  static const std::string& empty();
  bool ok_ = true;
  char kind_ = 0;  // of a failure: 'V', 'C', 'I', 'D', 'S', 'N'
  int errno_ = 0;
  std::string text_;
  std::exception_ptr own_;  // not sent: only the rank that failed has it
};

/// Every rank's verdict of one exchange, indexed by rank in the group.
class Verdicts {
 public:
  explicit Verdicts(std::vector<Verdict> all) : all_(std::move(all)) {}

  size_t size() const { return all_.size(); }
  const Verdict& operator[](size_t r) const { return all_[r]; }
  bool ok() const { return first_failed() < 0; }
  /// The lowest rank whose verdict failed, or -1.
  int first_failed() const;
  /// Every rank's payload, by rank. Requires ok().
  std::vector<std::string> payloads() const;
  /// "rank 1: <message>; rank 3: <message>" over the failed ranks (with `name_ranks` false and a
  /// single verdict, just its message).
  std::string failures(bool name_ranks = true) const;

  /// What a rank throws when `rank` failed with `message`.
  using Describe = std::function<std::string(int rank, const std::string& message)>;
  /// If any rank failed, throws on every rank alike: the lowest failing rank's kind, with the
  /// text `describe` gives it. Returns if every rank is fine.
  void throw_first(const Describe& describe) const;
  /// As throw_first, except that a rank that failed itself rethrows its own error as it was
  /// thrown (`mine`: its verdict).
  void throw_own_or_first(const Verdict& mine, const Describe& describe) const;

 private:
  std::vector<Verdict> all_;
};

/// Every rank of `group` learns every rank's verdict: one all_gather_bytes. Without a group
/// (nullptr), or in a group of one, `mine` alone. Collective.
Verdicts exchange_verdicts(ProcessGroup* group, const Verdict& mine);

/// Rank `src`'s verdict, on every rank of `group` (one broadcast_bytes): where one rank decides for
/// all (a commit, a file only it reads). Without a group, `mine`. Collective.
Verdict broadcast_verdict(ProcessGroup* group, const Verdict& mine, int src);

/// The common case: exchange, then throw_own_or_first(mine, describe); every rank's payload if
/// every rank is fine.
std::vector<std::string> agree(ProcessGroup* group, const Verdict& mine,
                               const Verdicts::Describe& describe);

}  // namespace dist
}  // namespace fsdp
