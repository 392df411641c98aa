// Verdicts and their exchange (agreement.h).
#include "dist/agreement.h"

#include <cstdlib>

#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace dist {

using fsdp::detail::msg;
using fsdp::detail::rank;

namespace {

// The letter of `e`'s kind; the most derived first (CorruptionError is a ValueError).
char kind_of(const std::exception& e) {
  if (dynamic_cast<const IOError*>(&e)) return 'I';
  if (dynamic_cast<const CorruptionError*>(&e)) return 'C';
  if (dynamic_cast<const ValueError*>(&e)) return 'V';
  if (dynamic_cast<const DistError*>(&e)) return 'D';
  if (dynamic_cast<const StateError*>(&e)) return 'S';
  return 'N';  // InternalError, the base Error, LibTorch's and the standard library's
}

bool known_kind(char k) { return std::string("ICVDSN").find(k) != std::string::npos; }

}  // namespace

Verdict::Verdict(std::string payload) : text_(std::move(payload)) {}

const std::string& Verdict::empty() {
  static const std::string none;
  return none;
}

Verdict Verdict::failed(const std::exception& e) {
  Verdict v;
  v.ok_ = false;
  v.kind_ = kind_of(e);
  if (const auto* io = dynamic_cast<const IOError*>(&e)) v.errno_ = io->error_code();
  v.text_ = e.what();
  return v;
}

Verdict Verdict::of(const std::function<std::string()>& step) {
  try {
    return Verdict(step());
  } catch (const std::exception& e) {
    Verdict v = failed(e);
    v.own_ = std::current_exception();
    return v;
  }
}

void Verdict::raise(const std::string& text) const {
  switch (kind_) {
    case 'I':
      throw IOError(text, errno_);
    case 'C':
      throw CorruptionError(text);
    case 'V':
      throw ValueError(text);
    case 'D':
      throw DistError(text);
    case 'S':
      throw StateError(text);
    default:
      throw InternalError(text);
  }
}

void Verdict::rethrow_own() const {
  if (own_) std::rethrow_exception(own_);
  raise(text_);
}

std::string Verdict::encode() const {
  if (ok_) return "K" + text_;
  std::string out = {'E', kind_};
  if (kind_ == 'I') out += std::to_string(errno_) + ";";
  return out + text_;
}

Verdict Verdict::decode(const std::string& bytes) {
  if (!bytes.empty() && bytes[0] == 'K') return Verdict(bytes.substr(1));
  Verdict v;
  v.ok_ = false;
  v.kind_ = 'N';
  if (bytes.size() < 2 || bytes[0] != 'E' || !known_kind(bytes[1])) {
    v.text_ = msg("a verdict that does not parse (", bytes.size(), " bytes)");
    return v;
  }
  v.kind_ = bytes[1];
  size_t at = 2;
  if (v.kind_ == 'I') {
    const size_t semi = bytes.find(';', at);
    if (semi == std::string::npos) {
      v.kind_ = 'N';
      v.text_ = "an IOError verdict without its errno";
      return v;
    }
    v.errno_ = std::atoi(bytes.substr(at, semi - at).c_str());
    at = semi + 1;
  }
  v.text_ = bytes.substr(at);
  return v;
}

int Verdicts::first_failed() const {
  for (size_t r = 0; r < all_.size(); ++r)
    if (!all_[r].ok()) return static_cast<int>(r);
  return -1;
}

std::vector<std::string> Verdicts::payloads() const {
  std::vector<std::string> out;
  out.reserve(all_.size());
  for (const Verdict& v : all_) out.push_back(v.payload());
  return out;
}

std::string Verdicts::failures(bool name_ranks) const {
  std::string out;
  for (size_t r = 0; r < all_.size(); ++r) {
    if (all_[r].ok()) continue;
    const bool named = name_ranks || all_.size() > 1;
    out += msg(out.empty() ? "" : "; ", named ? msg(rank(static_cast<int>(r)), ": ") : "",
               all_[r].message());
  }
  return out;
}

void Verdicts::throw_first(const Describe& describe) const {
  const int r = first_failed();
  if (r < 0) return;
  const Verdict& v = all_[static_cast<size_t>(r)];
  v.raise(describe(r, v.message()));
}

void Verdicts::throw_own_or_first(const Verdict& mine, const Describe& describe) const {
  if (!mine.ok()) mine.rethrow_own();
  throw_first(describe);
}

Verdicts exchange_verdicts(ProcessGroup* group, const Verdict& mine) {
  if (!group || group->size() == 1) return Verdicts({mine});
  const std::vector<std::string> bytes = group->all_gather_bytes(mine.encode());
  std::vector<Verdict> all;
  all.reserve(bytes.size());
  for (size_t r = 0; r < bytes.size(); ++r)
    all.push_back(static_cast<int>(r) == group->rank() ? mine : Verdict::decode(bytes[r]));
  return Verdicts(std::move(all));
}

Verdict broadcast_verdict(ProcessGroup* group, const Verdict& mine, int src) {
  if (!group || group->size() == 1) return mine;
  const std::string bytes = group->broadcast_bytes(group->rank() == src ? mine.encode() : "", src);
  return group->rank() == src ? mine : Verdict::decode(bytes);
}

std::vector<std::string> agree(ProcessGroup* group, const Verdict& mine,
                               const Verdicts::Describe& describe) {
  const Verdicts all = exchange_verdicts(group, mine);
  all.throw_own_or_first(mine, describe);
  return all.payloads();
}

}  // namespace dist
}  // namespace fsdp
