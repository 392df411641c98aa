// all_gather_bytes and broadcast_bytes: the small messages (verdicts, metadata) that ranks
// exchange around state dicts and checkpoints, over the group's own collectives.
#include <algorithm>
#include <cstring>

#include "dist/state.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace dist {

using detail::describe;
using fsdp::detail::msg;
using fsdp::detail::rank;

namespace {

// Byte exchanges are mostly verdicts (empty, or an error message) and small metadata, for which a
// collective's fixed cost is all there is (a few hundred microseconds over Gloo on loopback): each
// message travels in a fixed-size slot with its length up front, so one collective suffices, and
// only what does not fit follows in a second one, which every rank knows to run from the lengths
// it received. The slot is small because every rank holds W of them during the exchange, often
// while it holds a unit for a state-dict transfer that promises to hold about one unit more.
constexpr int64_t kBytesSlot = 128;
constexpr int64_t kSlotPayload = kBytesSlot - 8;

void put_length(char* slot, int64_t n) { std::memcpy(slot, &n, sizeof n); }
int64_t get_length(const char* slot, const std::string& op, int from) {
  int64_t n = 0;
  std::memcpy(&n, slot, sizeof n);
  // Every rank writes its own length, so this only fails on corrupted transport.
  if (n < 0 || n > (int64_t{1} << 40))
    throw DistError(msg(op, ": ", rank(from), " sent a length of ", n));
  return n;
}

}  // namespace

std::vector<std::string> ProcessGroup::all_gather_bytes(const std::string& bytes) {
  State& s = Internals::checked_state(*this, "all_gather_bytes");
  if (s.size == 1) return {bytes};
  const int64_t n = static_cast<int64_t>(bytes.size());
  // In place: this rank's slot is its own piece of the output, so the exchange holds W slots.
  at::Tensor all = at::zeros({kBytesSlot * s.size}, at::kByte);
  at::Tensor mine = all.narrow(0, kBytesSlot * s.rank, kBytesSlot);
  char* slot = static_cast<char*>(mine.data_ptr());
  put_length(slot, n);
  std::memcpy(slot + 8, bytes.data(), static_cast<size_t>(std::min(n, kSlotPayload)));
  all_gather_into_tensor(all, mine);
  const char* base = static_cast<const char*>(all.data_ptr());
  std::vector<std::string> out;
  std::vector<int64_t> lens;
  int64_t rest = 0;  // the longest remainder past a slot
  const std::string what = describe("all_gather_bytes", *this);
  for (int r = 0; r < s.size; ++r) {
    lens.push_back(get_length(base + r * kBytesSlot, what, r));
    out.emplace_back(base + r * kBytesSlot + 8,
                     static_cast<size_t>(std::min(lens[r], kSlotPayload)));
    rest = std::max(rest, lens[r] - kSlotPayload);
  }
  if (rest > 0) {
    at::Tensor all_more = at::zeros({rest * s.size}, at::kByte);
    at::Tensor more = all_more.narrow(0, rest * s.rank, rest);
    if (n > kSlotPayload)
      std::memcpy(more.data_ptr(), bytes.data() + kSlotPayload,
                  static_cast<size_t>(n - kSlotPayload));
    all_gather_into_tensor(all_more, more);
    const char* m = static_cast<const char*>(all_more.data_ptr());
    for (int r = 0; r < s.size; ++r) {
      if (lens[r] > kSlotPayload)
        out[r].append(m + r * rest, static_cast<size_t>(lens[r] - kSlotPayload));
    }
  }
  return out;
}

std::string ProcessGroup::broadcast_bytes(const std::string& bytes, int src) {
  State& s = Internals::checked_state(*this, "broadcast_bytes");
  if (s.size == 1) return bytes;
  at::Tensor buf = at::zeros({kBytesSlot}, at::kByte);
  char* slot = static_cast<char*>(buf.data_ptr());
  if (s.rank == src) {
    put_length(slot, static_cast<int64_t>(bytes.size()));
    std::memcpy(slot + 8, bytes.data(), std::min(bytes.size(), static_cast<size_t>(kSlotPayload)));
  }
  broadcast(buf, src);
  const int64_t n = get_length(slot, describe("broadcast_bytes", *this), src);
  std::string out(slot + 8, static_cast<size_t>(std::min(n, kSlotPayload)));
  if (n > kSlotPayload) {
    at::Tensor more = at::empty({n - kSlotPayload}, at::kByte);
    if (s.rank == src)
      std::memcpy(more.data_ptr(), bytes.data() + kSlotPayload,
                  static_cast<size_t>(n - kSlotPayload));
    broadcast(more, src);
    out.append(static_cast<const char*>(more.data_ptr()), static_cast<size_t>(n - kSlotPayload));
  }
  return out;
}

}  // namespace dist
}  // namespace fsdp
