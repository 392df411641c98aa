// Copies of a node-local save's data files on other hosts (host_copies.h).
//
// Each rank's file is read back from its host's partial directory in pieces (the page cache or
// tmpfs holds it: it was just written) and sent with one all_to_all_single per round; receivers
// append each piece to a file of the same name in their own host's partial directory. Every rank
// knows every size (the save's write reports), so each round's splits are computed alike on all
// ranks and nothing else needs to be exchanged until the checksums at the end.
#include "checkpoint/save/host_copies.h"
#include "checkpoint/save/save_run.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>

#include "checkpoint/storage/files.h"
#include "dist/agreement.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace host_copies {
namespace {

// The piece of a file of `size` bytes that round `round` carries: [begin, begin + length).
struct Piece {
  int64_t begin = 0, length = 0;
};
Piece piece(int64_t size, int64_t round, int64_t round_bytes) {
  const int64_t begin = std::min(size, round * round_bytes);
  return {begin, std::min(size, begin + round_bytes) - begin};
}

// XXH3 of the `size` bytes of `path`, read in pieces of at most `piece_bytes`.
std::string hash_file(FileIO& io, const std::string& path, int64_t size, int64_t piece_bytes) {
  const int64_t on_disk = io.file_size(path);
  if (on_disk != size)
    throw CorruptionError(detail::msg(save_run::kWhat, ": the copy ", path, " has ", on_disk,
                                      " bytes instead of ", size));
  files::Xxh3Stream hash;
  std::vector<char> buf(static_cast<size_t>(std::min(size, piece_bytes)));
  for (int64_t at = 0; at < size; at += piece_bytes) {
    const int64_t n = std::min(piece_bytes, size - at);
    files::pread_all(io, path, at, n, buf.data(), save_run::kWhat);
    hash.update(buf.data(), static_cast<size_t>(n));
  }
  return hash.hex();
}

}  // namespace

std::vector<std::vector<int>> receivers(const Hosts& hosts, int world, int replicas) {
  std::vector<std::vector<int>> to(static_cast<size_t>(world));
  const int h = static_cast<int>(hosts.size());
  const int copies = std::min(std::max(replicas, 1), h) - 1;
  for (int own = 0; own < h; ++own) {
    const std::vector<int>& ranks = hosts[static_cast<size_t>(own)];
    for (size_t i = 0; i < ranks.size(); ++i)
      for (int k = 1; k <= copies; ++k) {
        const std::vector<int>& other = hosts[static_cast<size_t>((own + k) % h)];
        to[static_cast<size_t>(ranks[i])].push_back(other[i % other.size()]);
      }
  }
  return to;
}

namespace {

// One copy() on one rank: the senders it receives from, the files it appends to, and its first
// failure (its verdict), after which it goes on exchanging without reading or writing.
class Copier {
 public:
  Copier(dist::ProcessGroup& g, FileIO& io, const std::string& dir,
         const std::vector<std::string>& files, const std::vector<int64_t>& sizes,
         const std::vector<std::vector<int>>& to, int64_t round_bytes)
      : g_(g),
        io_(io),
        dir_(dir),
        files_(files),
        sizes_(sizes),
        me_(g.rank()),
        receivers_(to[static_cast<size_t>(g.rank())]) {
    // The most copies one rank sends or receives, alike on every rank: each round's piece per
    // pair is the budget divided by it, so no rank sends or receives more than the budget.
    std::vector<size_t> fan_in(static_cast<size_t>(g.size()));
    size_t fan = 1;
    for (const auto& theirs : to) {
      fan = std::max(fan, theirs.size());
      for (int q : theirs) fan = std::max(fan, ++fan_in[static_cast<size_t>(q)]);
    }
    // No larger than the largest file sent either: the buffers are allocated (and zeroed) at
    // every save, and a small checkpoint saved every step (fsdp-train --mem-dir) would otherwise
    // fault in 64 MiB per rank each time for a few kilobytes.
    int64_t largest = 1;
    for (int r = 0; r < g.size(); ++r)
      if (!to[static_cast<size_t>(r)].empty()) largest = std::max(largest, size_of(r));
    piece_bytes_ = std::max<int64_t>(1, std::min(largest, round_bytes / static_cast<int64_t>(fan)));
    for (int r = 0; r < g.size(); ++r) {
      const auto& theirs = to[static_cast<size_t>(r)];
      if (theirs.empty()) continue;
      rounds_ = std::max(rounds_, (size_of(r) + piece_bytes_ - 1) / piece_bytes_);
      if (std::find(theirs.begin(), theirs.end(), me_) != theirs.end()) senders_.push_back(r);
    }
    outs_.resize(senders_.size());
  }

  dist::Verdict run() {
    if (!prepare()) return verdict_;  // this rank's error, or none: the failed rank reports its own
    for (int64_t round = 0; round < rounds_; ++round) exchange(round);
    attempt([&] {
      for (auto& o : outs_) o->finish();
    });
    check();
    return verdict_;
  }

 private:
  int64_t size_of(int r) const { return sizes_[static_cast<size_t>(r)]; }
  std::string path_of(int r) const { return files::join(dir_, files_[static_cast<size_t>(r)]); }

  template <class F>
  void attempt(F&& f) {
    if (!verdict_.ok()) return;
    verdict_ = dist::Verdict::of([&] {
      f();
      return std::string();
    });
  }

  // The files this rank receives and the buffers of every round, allocated once; an exchange of
  // verdicts follows, so that a rank that cannot get them stops every rank here rather than
  // leaving its peers in the first round's exchange. Whether every rank is ready.
  bool prepare() {
    attempt([&] {
      for (size_t s = 0; s < senders_.size(); ++s)
        outs_[s] = std::make_unique<files::OutFile>(io_, path_of(senders_[s]), save_run::kWhat);
      send_ = at::zeros({piece_bytes_ * static_cast<int64_t>(receivers_.size())}, at::kByte);
      recv_ = at::empty({piece_bytes_ * static_cast<int64_t>(senders_.size())}, at::kByte);
    });
    return dist::exchange_verdicts(&g_, verdict_).ok();
  }

  // One round: this rank's piece to each of its receivers, its senders' pieces appended.
  void exchange(int64_t round) {
    const size_t w = static_cast<size_t>(g_.size());
    const Piece out = receivers_.empty() ? Piece{} : piece(size_of(me_), round, piece_bytes_);
    std::vector<int64_t> send_splits(w), recv_splits(w);
    for (int q : receivers_) send_splits[static_cast<size_t>(q)] = out.length;
    int64_t recv_total = 0;
    for (int s : senders_) {
      recv_splits[static_cast<size_t>(s)] = piece(size_of(s), round, piece_bytes_).length;
      recv_total += recv_splits[static_cast<size_t>(s)];
    }
    // The piece once per receiver: identical bytes, so their order in `send` cannot matter.
    const at::Tensor send =
        send_.narrow(0, 0, out.length * static_cast<int64_t>(receivers_.size()));
    const at::Tensor recv = recv_.narrow(0, 0, recv_total);
    auto* bytes = static_cast<char*>(send_.data_ptr());
    const auto n = static_cast<size_t>(out.length);
    if (n > 0) {
      attempt([&] {
        files::pread_all(io_, path_of(me_), out.begin, out.length, bytes, save_run::kWhat);
        sent_.update(bytes, n);
      });
      for (size_t i = 1; i < receivers_.size(); ++i) std::memcpy(bytes + i * n, bytes, n);
    }
    g_.all_to_all_single(recv, send, recv_splits, send_splits);
    attempt([&] {
      const auto* in = static_cast<const char*>(recv.data_ptr());
      int64_t at = 0;
      for (size_t s = 0; s < senders_.size(); ++s) {  // ascending, as the splits are laid out
        const int64_t len = recv_splits[static_cast<size_t>(senders_[s])];
        outs_[s]->append(in + at, static_cast<size_t>(len));
        at += len;
      }
    });
  }

  // What each sender read, against what its receivers read back from their disks once the copies
  // were fsynced: a match means the copy holds what the sender's host holds.
  void check() {
    const std::vector<std::string> hashes =
        g_.all_gather_bytes(receivers_.empty() || !verdict_.ok() ? std::string() : sent_.hex());
    attempt([&] {
      for (int r : senders_) {
        const std::string& theirs = hashes[static_cast<size_t>(r)];
        if (theirs.empty()) continue;  // the sender failed, and reports that itself
        if (theirs != hash_file(io_, path_of(r), size_of(r), piece_bytes_))
          throw CorruptionError(detail::msg(save_run::kWhat, ": the copy of ",
                                            files_[static_cast<size_t>(r)], " received from ",
                                            detail::rank(r), " differs from what it sent"));
      }
    });
  }

  dist::ProcessGroup& g_;
  FileIO& io_;
  const std::string& dir_;
  const std::vector<std::string>& files_;
  const std::vector<int64_t>& sizes_;
  int64_t piece_bytes_ = 1;  // per pair and round
  const int me_;
  const std::vector<int>& receivers_;
  std::vector<int> senders_;  // to this rank, ascending
  int64_t rounds_ = 0;
  std::vector<std::unique_ptr<files::OutFile>> outs_;  // by sender
  at::Tensor send_, recv_;                             // of a whole round
  files::Xxh3Stream sent_;                             // of this rank's file, as read
  dist::Verdict verdict_;
};

}  // namespace

dist::Verdict copy(dist::ProcessGroup& g, FileIO& io, const std::string& dir,
                   const std::vector<std::string>& files, const std::vector<int64_t>& sizes,
                   const std::vector<std::vector<int>>& to, int64_t round_bytes) {
  return Copier(g, io, dir, files, sizes, to, round_bytes).run();
}

}  // namespace host_copies
}  // namespace checkpoint
}  // namespace fsdp
