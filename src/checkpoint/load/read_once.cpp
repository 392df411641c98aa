// The collective load (read_once.h): every stored item read once across the group, by one rank
// that can read it, and sent to the others that need it.
//
//   1. `.metadata` and the manifest: the lowest rank whose directory has them reads them and
//      broadcasts them, so a rank with an empty disk still loads (and nobody reads them twice).
//   2. Every rank plans its fill (CheckpointReader::plan: keys, shapes and coverage checked) and
//      stats the data files: the exchange tells everyone who needs which item and who can read
//      which file (or which rank's plan failed, and then every rank throws).
//   3. Each needed item gets a reader, computed alike on every rank: a rank that needs it and can
//      read it if there is one, else any rank that can read it; the least loaded in bytes.
//   4. Items only their reader needs are read as a local load reads them (large chunks straight
//      into their targets).
//   5. The rest travel in rounds bounded in bytes per rank: readers read and check their items,
//      a verdict exchange (so a failed read fails every rank), one all_to_all_single of bytes,
//      and the receivers decode. A last verdict exchange ends the load.
// Every step that can fail on one rank ends in an exchange, so all ranks throw together and no
// rank waits for a collective its peers have left.
#include "checkpoint/load/read_once.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "checkpoint/dcp/manifest.h"
#include "checkpoint/dcp/reader.h"
#include "checkpoint/storage/files.h"
#include "dist/agreement.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace read_once {
namespace {

using detail::msg;
using detail::quote;

// This rank's failure, if any, on its way to every rank (dist/agreement.h). Each exchange
// carries either a payload or the failure; once one rank has failed, every rank throws from the
// same exchange: its own error if it has one (as it was raised), else the lowest failing rank's,
// naming that rank.
class Steps {
 public:
  explicit Steps(dist::ProcessGroup& g) : g_(g) {}

  template <class F>
  void attempt(F&& f) {
    if (!mine_.ok()) return;  // after a failure nothing more is tried, only exchanged
    mine_ = dist::Verdict::of([&] {
      f();
      return std::string();
    });
  }

  std::vector<std::string> exchange(const std::string& payload) {
    return dist::agree(&g_, mine_.ok() ? dist::Verdict(payload) : mine_,
                       [](int r, const std::string& e) { return msg("rank ", r, ": ", e); });
  }

 private:
  dist::ProcessGroup& g_;
  dist::Verdict mine_;
};

std::string bitset(const std::vector<bool>& bits) {
  std::string out((bits.size() + 7) / 8, '\0');
  for (size_t i = 0; i < bits.size(); ++i)
    if (bits[i]) out[i / 8] = static_cast<char>(out[i / 8] | (1 << (i % 8)));
  return out;
}

bool bit(const std::string& set, size_t offset, size_t i) {
  return (static_cast<unsigned char>(set[offset + i / 8]) >> (i % 8)) & 1;
}

// `.metadata` and the manifest of the lowest rank whose directory has them (step 1). Payload:
// "<metadata length> <manifest flag> " then the bytes of both.
CheckpointReader::Files shared_files(FileIO& io, const std::string& dir, dist::ProcessGroup& g) {
  const std::string meta_path = files::join(dir, ".metadata");
  const std::vector<std::string> has = g.all_gather_bytes(io.file_size(meta_path) >= 0 ? "1" : "0");
  const auto first = std::find(has.begin(), has.end(), "1");
  if (first == has.end()) {
    (void)CheckpointReader::read_files(io, dir, kWhat);  // throws the local load's error
    throw ValueError(msg(kWhat, ": ", meta_path, " does not exist"));  // it appeared meanwhile
  }
  const int src = static_cast<int>(first - has.begin());
  dist::Verdict mine;
  if (g.rank() == src) {
    mine = dist::Verdict::of([&] {
      const CheckpointReader::Files f = CheckpointReader::read_files(io, dir, kWhat);
      return msg(f.metadata.size(), " ", f.manifest ? 1 : 0, " ") + f.metadata +
             f.manifest.value_or("");
    });
  }
  const dist::Verdict read = dist::broadcast_verdict(&g, mine, src);
  if (!read.ok()) read.raise(msg("rank ", src, ": ", read.message()));
  const std::string& got = read.payload();
  size_t meta_len = 0;
  int has_mf = 0;
  int used = 0;
  if (std::sscanf(got.c_str(), "%zu %d %n", &meta_len, &has_mf, &used) != 2 ||
      static_cast<size_t>(used) + meta_len > got.size())
    throw InternalError(msg(kWhat, ": a malformed metadata message from rank ", src));
  const size_t at = static_cast<size_t>(used);
  CheckpointReader::Files f;
  f.metadata = got.substr(at, meta_len);
  if (has_mf) f.manifest = got.substr(at + meta_len);
  return f;
}

// Who needs which item and who reads it (steps 2 and 3), alike on every rank.
struct Assignment {
  std::vector<const dcp::StorageInfo*> infos;  // by item index: .metadata's storage_data order
  std::vector<std::string> keys;
  std::vector<std::vector<int>> needers;  // ascending ranks
  std::vector<int> reader;                // -1: nobody needs it
};

using Plan = CheckpointReader::FillPlan;

// The data files `.metadata` names, in the order of their first item, each with the bytes its
// items reach, and each item's file (storage_data order).
struct DataFiles {
  std::vector<std::string> names;
  std::vector<int64_t> end;
  std::vector<size_t> of_item;
};
DataFiles data_files(const dcp::Metadata& m) {
  DataFiles df;
  std::map<std::string, size_t> index;
  for (const auto& [idx, info] : m.storage_data) {
    auto [f, fresh] = index.emplace(info.relative_path, df.names.size());
    if (fresh) {
      df.names.push_back(info.relative_path);
      df.end.push_back(0);
    }
    df.end[f->second] = std::max(df.end[f->second], info.offset + info.length);
    df.of_item.push_back(f->second);
  }
  return df;
}

// Which of the data files this rank's `dir` holds, long enough for their items (stat only).
std::vector<bool> readable(const DataFiles& df, FileIO& io, const std::string& dir) {
  std::vector<bool> can(df.names.size());
  for (size_t f = 0; f < df.names.size(); ++f)
    can[f] = io.file_size(files::join(dir, df.names[f])) >= df.end[f];
  return can;
}

Assignment assign(const CheckpointReader& reader, const Plan& plan, FileIO& io,
                  const std::string& dir, dist::ProcessGroup& g, Steps& v) {
  Assignment a;
  std::map<const dcp::StorageInfo*, size_t> index;
  const DataFiles df = data_files(reader.metadata());
  const std::vector<std::string>& file_names = df.names;
  const std::vector<int64_t>& file_end = df.end;
  const std::vector<size_t>& file_of = df.of_item;
  for (const auto& [idx, info] : reader.metadata().storage_data) {
    index[&info] = a.infos.size();
    a.infos.push_back(&info);
    a.keys.push_back(idx.fqn);
  }
  const size_t n = a.infos.size();
  std::vector<bool> need(n);
  const std::vector<bool> can = readable(df, io, dir);
  for (const auto& [info, read] : plan.reads) need[index.at(info)] = true;
  for (const auto& val : plan.values) need[index.at(val.info)] = true;
  const std::vector<std::string> all = v.exchange(bitset(can) + bitset(need));

  const size_t need_at = (file_names.size() + 7) / 8;
  const int world = g.size();
  for (const auto& m : all)
    if (m.size() != need_at + (n + 7) / 8)
      throw InternalError(msg(kWhat, ": ranks disagree on the checkpoint's items"));
  a.needers.resize(n);
  a.reader.assign(n, -1);
  std::vector<int64_t> load(static_cast<size_t>(world), 0);
  for (size_t i = 0; i < n; ++i) {
    for (int r = 0; r < world; ++r)
      if (bit(all[static_cast<size_t>(r)], need_at, i)) a.needers[i].push_back(r);
    if (a.needers[i].empty()) continue;
    auto least = [&](auto&& ok) {
      int best = -1;
      for (int r = 0; r < world; ++r)
        if (bit(all[static_cast<size_t>(r)], 0, file_of[i]) && ok(r) &&
            (best < 0 || load[static_cast<size_t>(r)] < load[static_cast<size_t>(best)]))
          best = r;
      return best;
    };
    const auto& needers = a.needers[i];
    int r = least([&](int q) { return std::binary_search(needers.begin(), needers.end(), q); });
    if (r < 0) r = least([](int) { return true; });
    if (r < 0)
      throw ValueError(msg(kWhat, ": no rank can read ", quote(file_names[file_of[i]]),
                           " (holding ", quote(a.keys[i]), ", needed by rank ", needers.front(),
                           "): it is missing, or shorter than the ", file_end[file_of[i]],
                           " bytes its items reach, in every rank's checkpoint directory (rank ",
                           g.rank(), "'s is ", dir, ")"));
    a.reader[i] = r;
    load[static_cast<size_t>(r)] += a.infos[i]->length;
  }
  return a;
}

// Items that travel (read by one rank, needed by another), split into rounds in which no rank
// sends or receives more than `budget` bytes unless a single item is larger.
std::vector<std::vector<size_t>> rounds(const Assignment& a, int world, int64_t budget) {
  std::vector<std::vector<size_t>> out(1);
  std::vector<int64_t> sent(static_cast<size_t>(world)), got(static_cast<size_t>(world));
  for (size_t i = 0; i < a.reader.size(); ++i) {
    const int src = a.reader[i];
    const auto& to = a.needers[i];
    if (src < 0 || (to.size() == 1 && to[0] == src)) continue;
    const int64_t len = a.infos[i]->length;
    const int64_t fan =
        static_cast<int64_t>(to.size()) - (std::binary_search(to.begin(), to.end(), src) ? 1 : 0);
    bool fits = sent[static_cast<size_t>(src)] + len * fan <= budget;
    for (int q : to) fits = fits && (q == src || got[static_cast<size_t>(q)] + len <= budget);
    if (!fits && !out.back().empty()) {
      out.emplace_back();
      std::fill(sent.begin(), sent.end(), 0);
      std::fill(got.begin(), got.end(), 0);
    }
    out.back().push_back(i);
    sent[static_cast<size_t>(src)] += len * fan;
    for (int q : to)
      if (q != src) got[static_cast<size_t>(q)] += len;
  }
  if (out.back().empty()) out.pop_back();
  return out;
}

// Applies an item this rank needs from its checked bytes.
void apply_item(const CheckpointReader& reader, Plan& plan,
                const std::map<const dcp::StorageInfo*, const Plan::Value*>& values,
                const dcp::StorageInfo* info, std::string_view raw) {
  auto r = plan.reads.find(info);
  if (r != plan.reads.end()) {
    reader.apply_chunk(r->second, *info, raw);
  } else {
    reader.apply_value(*values.at(info), raw);
  }
}

// One round (step 5).
void exchange_round(const CheckpointReader& reader, Plan& plan,
                    const std::map<const dcp::StorageInfo*, const Plan::Value*>& values,
                    const Assignment& a, const std::vector<size_t>& items, dist::ProcessGroup& g,
                    Steps& v, CheckpointReader::Buffer& buf) {
  const int me = g.rank();
  const auto world = static_cast<size_t>(g.size());
  auto needs = [&](size_t i, int q) {
    return std::binary_search(a.needers[i].begin(), a.needers[i].end(), q);
  };
  std::vector<int64_t> send_splits(world), recv_splits(world);
  for (size_t i : items) {
    const int64_t len = a.infos[i]->length;
    if (a.reader[i] == me) {
      for (int q : a.needers[i])
        if (q != me) send_splits[static_cast<size_t>(q)] += len;
    } else if (needs(i, me)) {
      recv_splits[static_cast<size_t>(a.reader[i])] += len;
    }
  }
  auto offsets = [](const std::vector<int64_t>& splits) {
    std::vector<int64_t> at(splits.size());
    for (size_t q = 1; q < splits.size(); ++q) at[q] = at[q - 1] + splits[q - 1];
    return at;
  };
  std::vector<int64_t> send_at = offsets(send_splits), recv_at = offsets(recv_splits);
  const at::Tensor send = at::empty({send_at.back() + send_splits.back()}, at::kByte);
  const at::Tensor recv = at::empty({recv_at.back() + recv_splits.back()}, at::kByte);
  v.attempt([&] {
    auto* out = static_cast<char*>(send.data_ptr());
    for (size_t i : items) {
      if (a.reader[i] != me) continue;
      const std::string_view raw = reader.read_item(a.keys[i], *a.infos[i], buf);
      for (int q : a.needers[i]) {
        if (q == me) continue;
        std::memcpy(out + send_at[static_cast<size_t>(q)], raw.data(), raw.size());
        send_at[static_cast<size_t>(q)] += static_cast<int64_t>(raw.size());
      }
      if (needs(i, me)) apply_item(reader, plan, values, a.infos[i], raw);
    }
  });
  v.exchange("");
  g.all_to_all_single(recv, send, recv_splits, send_splits);
  v.attempt([&] {
    const auto* in = static_cast<const char*>(recv.data_ptr());
    for (size_t i : items) {
      if (a.reader[i] == me || !needs(i, me)) continue;
      int64_t& at = recv_at[static_cast<size_t>(a.reader[i])];
      const auto len = static_cast<size_t>(a.infos[i]->length);
      apply_item(reader, plan, values, a.infos[i], std::string_view(in + at, len));
      at += static_cast<int64_t>(len);
    }
  });
}

}  // namespace

void load(StateDict& state_dict, const std::string& dir, FileIO& io, bool verify,
          dist::ProcessGroup& g, int64_t round_bytes) {
  if (round_bytes <= 0)
    throw ValueError(msg(kWhat, ": round_bytes must be positive, not ", round_bytes));
  // The same bytes on every rank: parsing fails alike everywhere, with no exchange needed.
  const CheckpointReader reader(io, dir, shared_files(io, dir, g), verify, kWhat);
  if (!reader.manifest() && g.rank() == 0)
    TORCH_WARN("fsdp checkpoint: ", reader.dir(), " has no ", manifest::kFileName,
               " (written by PyTorch?): its items are checked only by their zip CRC-32s");
  Steps v(g);
  Plan plan;
  v.attempt([&] { plan = reader.plan(state_dict); });
  const Assignment a = assign(reader, plan, io, dir, g, v);
  std::map<const dcp::StorageInfo*, const Plan::Value*> values;
  for (const auto& val : plan.values) values[val.info] = &val;

  // Step 4: what only this rank needs and reads, as a local load would.
  const int me = g.rank();
  std::map<const dcp::StorageInfo*, size_t> index;
  for (size_t i = 0; i < a.infos.size(); ++i) index[a.infos[i]] = i;
  auto own = [&](const dcp::StorageInfo* info) {
    const size_t i = index.at(info);
    return a.reader[i] == me && a.needers[i].size() == 1;
  };
  Plan mine;
  for (auto it = plan.reads.begin(); it != plan.reads.end();) {
    const auto at = it++;
    if (own(at->first)) mine.reads.insert(plan.reads.extract(at));
  }
  for (const auto& val : plan.values)
    if (own(val.info)) mine.values.push_back(val);
  CheckpointReader::Buffer buf;
  v.attempt([&] { reader.apply(mine, buf); });

  for (const auto& items : rounds(a, g.size(), round_bytes))
    exchange_round(reader, plan, values, a, items, g, v, buf);
  v.exchange("");
}

std::vector<std::string> unreadable_files(const std::string& dir, FileIO& io,
                                          dist::ProcessGroup& g) {
  const CheckpointReader reader(io, dir, shared_files(io, dir, g), false, kWhat);
  const DataFiles df = data_files(reader.metadata());
  const std::vector<std::string> all = g.all_gather_bytes(bitset(readable(df, io, dir)));
  std::vector<std::string> missing;
  for (size_t f = 0; f < df.names.size(); ++f) {
    bool anyone = false;
    for (const auto& m : all) anyone = anyone || (m.size() * 8 > f && bit(m, 0, f));
    if (!anyone) missing.push_back(df.names[f]);
  }
  return missing;
}

}  // namespace read_once

std::vector<std::string> missing_files(const std::string& dir, dist::ProcessGroup& group,
                                       FileIO* io) {
  return read_once::unreadable_files(dir, io ? *io : default_file_io(), group);
}

}  // namespace checkpoint
}  // namespace fsdp
