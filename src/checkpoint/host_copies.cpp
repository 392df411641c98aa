// Copies of a node-local save's data files on other hosts (host_copies.h).
//
// Each rank's file is read back from its host's partial directory in pieces (the page cache or
// tmpfs holds it: it was just written) and sent with one all_to_all_single per round; receivers
// append each piece to a file of the same name in their own host's partial directory. Every rank
// knows every size (the save's write reports), so each round's splits are computed alike on all
// ranks and nothing else needs to be exchanged until the checksums at the end.
#include "checkpoint/host_copies.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>

#include "checkpoint/files.h"
#include "checkpoint/wire_error.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace host_copies {
namespace {

constexpr const char* kWhat = "checkpoint save";

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
    throw CorruptionError(
        detail::msg(kWhat, ": the copy ", path, " has ", on_disk, " bytes instead of ", size));
  files::Xxh3Stream hash;
  std::vector<char> buf(static_cast<size_t>(std::min(size, piece_bytes)));
  for (int64_t at = 0; at < size; at += piece_bytes) {
    const int64_t n = std::min(piece_bytes, size - at);
    files::pread_all(io, path, at, n, buf.data(), kWhat);
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

std::string copy(dist::ProcessGroup& g, FileIO& io, const std::string& dir,
                 const std::vector<std::string>& files, const std::vector<int64_t>& sizes,
                 const std::vector<std::vector<int>>& to, int64_t round_bytes) {
  const int world = g.size(), me = g.rank();
  const auto w = static_cast<size_t>(world);
  std::vector<int> senders;  // to this rank, ascending
  int64_t rounds = 0;
  for (int r = 0; r < world; ++r) {
    const auto& mine = to[static_cast<size_t>(r)];
    if (mine.empty()) continue;
    rounds = std::max(rounds, (sizes[static_cast<size_t>(r)] + round_bytes - 1) / round_bytes);
    if (std::find(mine.begin(), mine.end(), me) != mine.end()) senders.push_back(r);
  }
  const std::vector<int>& receivers = to[static_cast<size_t>(me)];
  std::string error;  // this rank's first failure, wire-encoded; the exchanges go on regardless
  auto attempt = [&](auto&& f) {
    if (!error.empty()) return;
    try {
      f();
    } catch (const std::exception& e) {
      error = wire::encode(e);
    }
  };
  const std::string own_path = files::join(dir, files[static_cast<size_t>(me)]);
  std::vector<std::unique_ptr<files::OutFile>> outs(senders.size());
  attempt([&] {
    for (size_t s = 0; s < senders.size(); ++s)
      outs[s] = std::make_unique<files::OutFile>(
          io, files::join(dir, files[static_cast<size_t>(senders[s])]), kWhat);
  });
  files::Xxh3Stream sent;
  const int64_t own_size = sizes[static_cast<size_t>(me)];
  for (int64_t round = 0; round < rounds; ++round) {
    const Piece out = receivers.empty() ? Piece{} : piece(own_size, round, round_bytes);
    std::vector<int64_t> send_splits(w), recv_splits(w);
    for (int q : receivers) send_splits[static_cast<size_t>(q)] = out.length;
    for (int s : senders)
      recv_splits[static_cast<size_t>(s)] =
          piece(sizes[static_cast<size_t>(s)], round, round_bytes).length;
    // The piece once, then a copy per further receiver (a receiver is a distinct rank per copy).
    const at::Tensor send =
        at::zeros({out.length * static_cast<int64_t>(receivers.size())}, at::kByte);
    int64_t recv_total = 0;
    for (int64_t n : recv_splits) recv_total += n;
    const at::Tensor recv = at::empty({recv_total}, at::kByte);
    auto* send_bytes = static_cast<char*>(send.data_ptr());
    attempt([&] {
      if (out.length == 0) return;
      files::pread_all(io, own_path, out.begin, out.length, send_bytes, kWhat);
      sent.update(send_bytes, static_cast<size_t>(out.length));
    });
    for (size_t i = 1; i < receivers.size(); ++i)
      std::memcpy(send_bytes + i * static_cast<size_t>(out.length), send_bytes,
                  static_cast<size_t>(out.length));
    // Splits are in rank order and the receivers of one sender are distinct ranks: laying the
    // copies out in rank order matches the splits.
    g.all_to_all_single(recv, send, recv_splits, send_splits);
    attempt([&] {
      const auto* in = static_cast<const char*>(recv.data_ptr());
      int64_t at = 0;
      for (int q = 0; q < world; ++q) {
        const int64_t n = recv_splits[static_cast<size_t>(q)];
        if (n == 0) continue;
        const size_t s =
            static_cast<size_t>(std::find(senders.begin(), senders.end(), q) - senders.begin());
        outs[s]->append(in + at, static_cast<size_t>(n));
        at += n;
      }
    });
  }
  attempt([&] {
    for (auto& o : outs) o->finish();
  });
  // What each sender read, against what its receivers read back from their disks once the copies
  // were fsynced: a match means the copy holds what the sender's host holds.
  const std::vector<std::string> hashes =
      g.all_gather_bytes(receivers.empty() || !error.empty() ? std::string() : sent.hex());
  attempt([&] {
    for (size_t s = 0; s < senders.size(); ++s) {
      const auto r = static_cast<size_t>(senders[s]);
      if (hashes[r].empty()) continue;  // the sender failed, and reports that itself
      if (hashes[r] != hash_file(io, files::join(dir, files[r]), sizes[r], round_bytes))
        throw CorruptionError(detail::msg(kWhat, ": the copy of ", files[r], " received from ",
                                          detail::rank(senders[s]), " differs from what it sent"));
    }
  });
  return error;
}

}  // namespace host_copies
}  // namespace checkpoint
}  // namespace fsdp
