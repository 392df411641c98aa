// The node-local save protocol (save_run.h): each host writes its own directory on a disk only it
// sees (SaveOptions::node_local). The ranks find which of them share a directory from probe
// files; each host's lowest rank leads it as rank 0 leads a shared save; with replicas, every data
// file is also copied to other hosts (host_copies.h) so that a lost host's files survive; the
// commit is in two phases so that no host swaps in a step another host could not complete.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <random>

#include "checkpoint/save/host_copies.h"
#include "checkpoint/save/save_run.h"
#include "checkpoint/storage/files.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace save_run {
namespace {

// A fresh name for one save's probe files, so that a probe a killed save left behind is never
// taken for a peer's.
std::string probe_nonce() {
  std::random_device rd;
  const uint64_t x =
      (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

// The hosts from every rank's probe view (a '0'/'1' per rank: whose probe it sees, then '/' and
// its replicas): each a set of ranks that all see exactly that set. Computed alike on every rank,
// so all agree, or all throw the same error.
host_copies::Hosts hosts_of(const std::vector<std::string>& views, const std::string& parent) {
  const int world = static_cast<int>(views.size());
  host_copies::Hosts hosts;
  std::vector<bool> placed(views.size());
  for (int r = 0; r < world; ++r) {
    if (placed[static_cast<size_t>(r)]) continue;
    const std::string& view = views[static_cast<size_t>(r)];
    if (view[static_cast<size_t>(r)] != '1')
      throw IOError(
          detail::msg(kWhat, ": ", detail::rank(r), " cannot see its own probe in ", parent), 0);
    std::vector<int> host;
    for (int q = 0; q < world; ++q) {
      if (view[static_cast<size_t>(q)] != '1') continue;
      if (views[static_cast<size_t>(q)] != view || placed[static_cast<size_t>(q)])
        throw ValueError(detail::msg(kWhat, ": ranks ", r, " and ", q, " see different sets of ",
                                     "ranks sharing ", parent, ": a file system that is neither ",
                                     "shared nor node-local"));
      placed[static_cast<size_t>(q)] = true;
      host.push_back(q);
    }
    hosts.push_back(std::move(host));
  }
  return hosts;
}

class NodeLocalDirectories final : public Protocol {
 public:
  explicit NodeLocalDirectories(int replicas) : replicas_(replicas) {}

  // The ranks that see this rank's directory (its host), found by each leaving an empty probe
  // file beside `dir` and listing whose probes it sees. Every rank of a host must see exactly the
  // same ranks. The host's lowest rank leads it. Two small exchanges (three with the nonce's
  // broadcast).
  void find_leader(SaveState& s) override {
    const int world = s.group->size();
    const std::string parent = files::parent_of(s.dir);
    const std::string stem = "." + files::base_of(s.dir) + ".probe-" +
                             s.group->broadcast_bytes(s.rank == 0 ? probe_nonce() : "", 0) + "-";
    const std::string mine = files::join(parent, stem + std::to_string(s.rank));
    const dist::Verdict probed = dist::Verdict::of([&] {
      files::make_dirs(*s.io, parent, kWhat);
      files::write_file(*s.io, mine, "", kWhat);
      return std::string();
    });
    try {
      s.throw_first_failure(s.exchange(probed), "probing which ranks share ");
    } catch (...) {
      s.io->remove(mine);  // the save fails here: leave no probe behind
      throw;
    }
    const dist::Verdicts seen = s.exchange(dist::Verdict::of(
        [&] { return probes_seen(*s.io, parent, stem, world) + "/" + std::to_string(replicas_); }));
    s.io->remove(mine);  // every rank has listed: the probe has served (a failure leaves it to the
                         // next save's leader, which removes stale probes)
    s.throw_first_failure(seen, "probing which ranks share ");
    const std::vector<std::string> views = seen.payloads();
    // Every rank must plan the same copies (host_copies::receivers).
    const auto w = static_cast<size_t>(world);
    for (int r = 1; r < world; ++r)
      if (views[static_cast<size_t>(r)].substr(w) != views[0].substr(w))
        throw ValueError(detail::msg(
            kWhat, " of ", s.dir, ": ranks 0 and ", r, " pass different SaveOptions::replicas (",
            views[0].substr(w + 1), " and ", views[static_cast<size_t>(r)].substr(w + 1), ")"));
    hosts_ = hosts_of(views, parent);
    for (const auto& h : hosts_)
      if (std::find(h.begin(), h.end(), s.rank) != h.end()) host_ = h;
    s.leader = host_.front() == s.rank;
    this_save_ = stem;
  }

  // Probe files of earlier saves into this name that were killed before removing them.
  void clear_leftovers(const SaveState& s) override {
    const std::string parent = files::parent_of(s.dir);
    const std::string prefix = "." + files::base_of(s.dir) + ".probe-";
    std::vector<std::string> names;
    if (s.io->list_dir(parent, names) != 0) return;
    for (const auto& n : names)
      if (n.compare(0, prefix.size(), prefix) == 0 &&
          n.compare(0, this_save_.size(), this_save_) != 0)
        s.io->remove(files::join(parent, n));
  }

  // With replicas: every rank's file also goes to ranks of the next hosts (host_copies.h), so a
  // lost host's files are still somewhere. Ends in a verdict exchange.
  void after_write(SaveState& s) override {
    copies_to_ = host_copies::receivers(hosts_, s.group->size(), replicas_);
    if (std::all_of(copies_to_.begin(), copies_to_.end(), [](const auto& t) { return t.empty(); }))
      return;  // one host, or replicas(1)
    std::vector<std::string> names;
    std::vector<int64_t> sizes;
    for (const RankPart& p : s.parts()) {
      names.push_back(p.file);
      sizes.push_back(p.file_size);
    }
    const dist::Verdicts copied =
        s.exchange(host_copies::copy(*s.group, *s.io, s.partial, names, sizes, copies_to_));
    if (!copied.ok()) s.remove_partial_on_leader();
    s.throw_first_failure(copied, "nothing was committed: copying data files to other hosts, on ");
  }

  // In two phases so that no host swaps in a step another host could not complete: every leader
  // makes its directory complete and durable; only if all succeeded does each swap it in; only
  // once every host holds the new step does after_commit run (the `latest` pointer, keep_last's
  // removals), so no host drops an old step another host still needs.
  void commit(SaveState& s, const Annotations& annotations,
              const std::function<void()>& after_commit) override {
    const dist::Verdicts completed = s.exchange(s.on_leader([&] {
      std::vector<RankPart> all = s.parts();
      std::vector<std::string> local;  // none listed: one host holds every file
      if (hosts_.size() > 1)
        for (size_t r = 0; r < all.size(); ++r)
          if (on_this_host(static_cast<int>(r))) local.push_back(all[r].file);
      write_commit_files(*s.io, all, s.partial, annotations, std::move(local));
    }));
    if (!completed.ok()) s.remove_partial_on_leader();
    s.throw_first_failure(completed, "nothing was committed: completing the directory of ");
    s.throw_first_failure(s.exchange(s.on_leader([&] { install(*s.io, s.partial, s.dir); })),
                          "committed on some hosts only: swapping in the directory of ");
    s.throw_first_failure(s.exchange(s.on_leader([&] {
      if (after_commit) after_commit();
    })),
                          "committed, then failed on the host of ");
  }

 private:
  // Which ranks' probes (named `stem` + rank) this rank sees in `parent`: a '0'/'1' per rank.
  static std::string probes_seen(FileIO& io, const std::string& parent, const std::string& stem,
                                 int world) {
    std::string seen(static_cast<size_t>(world), '0');
    std::vector<std::string> names;
    if (io.list_dir(parent, names) != 0) {
      const int err = errno;  // before the message allocates
      files::io_error(kWhat, "listing", parent, err);
    }
    for (const auto& n : names) {
      if (n.compare(0, stem.size(), stem) != 0) continue;
      const std::string r = n.substr(stem.size());
      if (!r.empty() && r.size() < 8 && r.find_first_not_of("0123456789") == std::string::npos &&
          std::stoi(r) < world)
        seen[static_cast<size_t>(std::stoi(r))] = '1';
    }
    return seen;
  }

  // Whether this host's directory holds rank r's data file: r is one of its ranks, or sent a copy
  // to one of them.
  bool on_this_host(int r) const {
    auto here = [&](int q) { return std::find(host_.begin(), host_.end(), q) != host_.end(); };
    if (here(r)) return true;
    if (copies_to_.empty()) return false;
    const auto& to = copies_to_[static_cast<size_t>(r)];
    return std::any_of(to.begin(), to.end(), here);
  }

  const int replicas_;
  host_copies::Hosts hosts_;                 // every host's ranks
  std::vector<int> host_;                    // the ranks sharing this rank's directory
  std::vector<std::vector<int>> copies_to_;  // who holds a copy of each rank's file
  std::string this_save_;                    // this save's probe names' prefix (not stale)
};

}  // namespace

std::unique_ptr<Protocol> node_local_directories(int replicas) {
  return std::make_unique<NodeLocalDirectories>(replicas);
}

}  // namespace save_run
}  // namespace checkpoint
}  // namespace fsdp
