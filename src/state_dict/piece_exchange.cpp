// Moving pieces of sharded tensors to the ranks that need them (see piece_exchange.h).
//
// A SHARDED dict holds each tensor as pieces (dim-0 chunks, or any boxes) that do not line up
// with flat-parameter shards: a rank usually needs elements held by other ranks, even at the
// world size that saved. Each rank describes its pieces once (one all-gather of text), then,
// request by request, the ranks run one all_to_all_single in which each sends every other rank
// only the part of each piece inside that rank's range.
#include "state_dict/piece_exchange.h"

#include <algorithm>
#include <sstream>

#include "fsdp/errors.h"
#include "util/message.h"
#include "util/tensor_utils.h"  // dim_outside

namespace fsdp {
namespace detail {
namespace {

// A box's elements as runs contiguous in both the global row-major order and the box's own.
struct Run {
  int64_t global_start;  // flat index in the tensor
  int64_t local_start;   // flat index in the box
  int64_t len;
};

std::vector<Run> box_runs(const std::vector<int64_t>& shape, const ShardMetadata& b) {
  const size_t nd = shape.size();
  if (b.numel() == 0) return {};
  if (nd == 0) return {Run{0, 0, 1}};
  // Trailing dims the box covers fully merge into one contiguous run.
  size_t k = nd - 1;  // the run spans dims k..nd-1
  int64_t run = b.sizes[nd - 1];
  while (k > 0 && b.sizes[k] == shape[k] && b.offsets[k] == 0) {
    --k;
    run *= b.sizes[k];
  }
  std::vector<int64_t> stride(nd, 1);
  for (size_t d = nd - 1; d > 0; --d) stride[d - 1] = stride[d] * shape[d];
  std::vector<Run> out;
  std::vector<int64_t> idx(k, 0);  // position in the box along dims 0..k-1
  int64_t local = 0;
  for (;;) {
    int64_t g = 0;
    for (size_t d = 0; d < k; ++d) g += (b.offsets[d] + idx[d]) * stride[d];
    g += b.offsets[k] * stride[k];
    out.push_back(Run{g, local, run});
    local += run;
    size_t d = k;
    while (d > 0) {
      --d;
      if (++idx[d] < b.sizes[d]) break;
      idx[d] = 0;
      if (d == 0) return out;
    }
    if (k == 0) return out;
  }
}

struct RankMeta {
  bool valid = true;
  std::string error;
  bool have = false;  // the rank holds the tensor as a ShardedTensor
  int dtype = -1;
  std::vector<ShardMetadata> boxes;
  int64_t need_lo = 0, need_n = 0;  // the rank's range
};

bool known_dtype(int dt) {
  if (dt < 0 || dt >= static_cast<int>(at::ScalarType::NumOptions)) return false;
  switch (static_cast<at::ScalarType>(dt)) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
    case at::kBool:
      return true;
    default:
      return false;
  }
}

// Parses one rank's metadata line for a request and checks it against the tensor's shape.
RankMeta parse_meta(const std::string& line, const std::vector<int64_t>& shape) {
  RankMeta m;
  std::istringstream is(line);
  auto bad = [&](const std::string& why) {
    m.valid = false;
    m.error = why;
    return m;
  };
  std::string tag;
  if (!(is >> tag)) return bad("empty metadata");
  if (tag == "!") {
    std::string rest;
    std::getline(is >> std::ws, rest);  // the text after "! ", without its leading blank
    return bad(rest);
  }
  int64_t lo = 0, n = 0, total = 1;
  for (auto d : shape) total *= d;
  if (!(is >> lo >> n) || lo < 0 || n < 0 || lo > total || n > total - lo) return bad("bad range");
  m.need_lo = lo;
  m.need_n = n;
  if (tag == "-") return m;
  if (tag != "+") return bad("bad tag");
  size_t nd = 0, nb = 0;
  if (!(is >> m.dtype >> nd >> nb) || !known_dtype(m.dtype)) return bad("bad dtype");
  if (nd != shape.size()) {
    return bad(msg("pieces have ", nd, " dims, the tensor ", shape.size()));
  }
  if (nb > 1000000) return bad("too many pieces");
  m.have = true;
  for (size_t i = 0; i < nb; ++i) {
    ShardMetadata b;
    b.offsets.resize(nd);
    b.sizes.resize(nd);
    for (auto& o : b.offsets)
      if (!(is >> o)) return bad("truncated piece");
    for (auto& z : b.sizes)
      if (!(is >> z)) return bad("truncated piece");
    if (detail::dim_outside(b.offsets, b.sizes, shape) >= 0) {
      return bad(msg("piece at ", detail::shape(b.offsets), " of size ", detail::shape(b.sizes),
                     " lies outside the shape ", detail::shape(shape)));
    }
    m.boxes.push_back(std::move(b));
  }
  return m;
}

// This rank's metadata line for one request, and its pieces flattened (in the tensor's dtype).
std::string describe_pieces(const RangeRequest& q, std::vector<at::Tensor>& flat_pieces) {
  std::ostringstream line;
  if (!q.pieces) {
    line << "- " << q.lo << " " << q.n;
    return line.str();
  }
  const ShardedTensor& t = *q.pieces;
  line << "+ " << q.lo << " " << q.n << " " << static_cast<int>(t.dtype()) << " " << t.size().size()
       << " " << t.local_shards().size();
  for (const auto& piece : t.local_shards()) {
    if (piece.tensor.numel() != piece.metadata.numel() ||
        piece.metadata.offsets.size() != t.size().size() ||
        piece.metadata.sizes.size() != t.size().size()) {
      flat_pieces.clear();
      return msg("! a piece of ", q.name, " does not match its metadata");
    }
    for (auto o : piece.metadata.offsets) line << " " << o;
    for (auto z : piece.metadata.sizes) line << " " << z;
    flat_pieces.push_back(piece.tensor.reshape({-1}).to(at::kCPU).to(t.dtype()));
  }
  return line.str();
}

// Whether some rank misses an element it needs. Where none does, `out` holds every rank's
// ranges, assembled from its own pieces alone. One all_reduce, so that every rank decides alike.
bool needs_exchange(dist::ProcessGroup& pg, const std::vector<RangeRequest>& requests,
                    std::vector<at::Tensor>& out) {
  bool covered = true;
  for (size_t i = 0; i < requests.size() && covered; ++i) {
    const RangeRequest& q = requests[i];
    if (!q.pieces) continue;
    try {
      out[i] = q.pieces->flat_range(q.lo, q.n, q.name);
    } catch (...) {  // not covered, or anything else: exchange (every rank must decide alike)
      covered = false;
    }
  }
  at::Tensor flag = at::full({1}, covered ? 0 : 1, at::kInt);
  pg.all_reduce(flag, dist::ReduceOp::MAX);
  return flag.item<int>() != 0;
}

// One metadata exchange: per request, a line "<tag> lo n [dtype ndim npieces offs.. sizes..]"
// (tag + has pieces, - holds none, ! this rank's own pieces are malformed). Returns every rank's
// lines; `my_pieces` gets this rank's pieces of each request, flattened.
std::vector<std::vector<std::string>> exchange_metadata(
    dist::ProcessGroup& pg, const std::vector<RangeRequest>& requests,
    std::vector<std::vector<at::Tensor>>& my_pieces) {
  std::ostringstream meta;
  for (size_t i = 0; i < requests.size(); ++i) {
    meta << describe_pieces(requests[i], my_pieces[i]) << "\n";
  }
  const auto metas = pg.all_gather_bytes(meta.str());
  std::vector<std::vector<std::string>> lines(metas.size());
  for (size_t r = 0; r < metas.size(); ++r) {
    std::istringstream is(metas[r]);
    for (std::string l; std::getline(is, l);) lines[r].push_back(l);
  }
  return lines;
}

// A part of a run of a box, sent by rank `src` to one receiver.
struct Seg {
  int src;
  size_t box;
  int64_t local, len, dst;  // into the source box / into the receiver's range
};

// What every rank concluded of one request from the gathered metadata alone: the same on every
// rank.
struct Route {
  std::vector<RankMeta> ms;          // each rank's parsed metadata
  std::string problem;               // why the request cannot be served ("" if it can)
  int dtype = -1;                    // of the pieces; -1 where no rank holds any
  bool anyone = false;               // some rank holds the tensor
  std::vector<std::vector<Seg>> to;  // to[d]: segments for receiver d, in sender order
};

// Parses and validates every rank's view of request `ki`; the same verdict on every rank.
void parse_views(const std::vector<std::vector<std::string>>& lines, size_t ki,
                 const RangeRequest& q, Route& route) {
  const int W = static_cast<int>(route.ms.size());
  for (int r = 0; r < W; ++r) {
    RankMeta& m = route.ms[r];
    if (ki < lines[r].size()) {
      m = parse_meta(lines[r][ki], q.shape);
    } else {
      m.valid = false;
      m.error = "no metadata";
    }
    if (!m.valid) {
      if (route.problem.empty())
        route.problem = msg(rank(r), "'s pieces of ", q.name, " are invalid: ", m.error);
      continue;
    }
    route.anyone |= m.have;
    if (!m.have || m.boxes.empty()) continue;
    if (route.dtype >= 0 && m.dtype != route.dtype && route.problem.empty()) {
      route.problem = msg("ranks hold pieces of ", q.name, " in different dtypes");
    }
    route.dtype = m.dtype;
  }
}

// Who sends what: each distinct box once (its lowest-ranked holder), the part of each of its
// runs inside the receiver's range.
void route_segments(const RangeRequest& q, Route& route) {
  const int W = static_cast<int>(route.ms.size());
  const std::vector<RankMeta>& ms = route.ms;
  std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> seen;
  for (int r = 0; r < W; ++r) {
    for (size_t bi = 0; bi < ms[r].boxes.size(); ++bi) {
      const ShardMetadata& b = ms[r].boxes[bi];
      auto id = std::make_pair(b.offsets, b.sizes);
      if (std::find(seen.begin(), seen.end(), id) != seen.end()) continue;
      seen.push_back(id);
      for (const Run& run : box_runs(q.shape, b)) {
        for (int d = 0; d < W; ++d) {
          const int64_t lo = std::max(run.global_start, ms[d].need_lo);
          const int64_t hi = std::min(run.global_start + run.len, ms[d].need_lo + ms[d].need_n);
          if (lo >= hi) continue;
          route.to[d].push_back(
              Seg{r, bi, run.local_start + (lo - run.global_start), hi - lo, lo - ms[d].need_lo});
        }
      }
    }
  }
}

// Every rank's range must be covered: the problem names the first rank whose range is not.
void check_coverage(const RangeRequest& q, Route& route) {
  const int W = static_cast<int>(route.ms.size());
  for (int d = 0; d < W && route.problem.empty(); ++d) {
    const RankMeta& m = route.ms[d];
    if (m.need_n == 0) continue;
    std::vector<std::pair<int64_t, int64_t>> iv;
    for (const auto& sg : route.to[d]) iv.emplace_back(sg.dst, sg.dst + sg.len);
    std::sort(iv.begin(), iv.end());
    int64_t reach = 0;
    for (const auto& [a, b] : iv) {
      if (a > reach) break;
      reach = std::max(reach, b);
    }
    if (reach < m.need_n) {
      route.problem = msg("no rank holds elements [", m.need_lo + reach, ", ", m.need_lo + m.need_n,
                          ") of ", q.name, " (flattened), which ", rank(d), " needs");
    }
  }
}

// Request `ki` as every rank sees it; `route.to` is filled only where nothing is wrong and some
// rank holds the tensor.
Route plan_route(const std::vector<std::vector<std::string>>& lines, size_t ki,
                 const RangeRequest& q, int W) {
  Route route;
  route.ms.resize(W);
  route.to.resize(W);
  parse_views(lines, ki, q, route);
  if (!route.problem.empty() || !route.anyone) return route;
  route_segments(q, route);
  check_coverage(q, route);
  return route;
}

// Runs the route's all_to_all_single (if anything moves at all) and returns this rank's range:
// `pieces` are this rank's flattened pieces of the request.
at::Tensor move_segments(dist::ProcessGroup& pg, const Route& route,
                         const std::vector<at::Tensor>& pieces) {
  const int me = pg.rank();
  const int W = pg.size();
  const at::ScalarType dt =
      route.dtype >= 0 ? static_cast<at::ScalarType>(route.dtype) : at::kFloat;
  // Send buffer: for each receiver in rank order, my segments to it.
  std::vector<int64_t> in_splits(W, 0), out_splits(W, 0);
  std::vector<at::Tensor> send;
  for (int d = 0; d < W; ++d) {
    for (const auto& sg : route.to[d]) {
      if (sg.src == me) {
        send.push_back(pieces[sg.box].narrow(0, sg.local, sg.len));
        in_splits[d] += sg.len;
      }
    }
  }
  for (const auto& sg : route.to[me]) out_splits[sg.src] += sg.len;
  int64_t traffic = 0;  // elements moved for this request, all ranks together (same everywhere)
  for (int d = 0; d < W; ++d)
    for (const auto& sg : route.to[d]) traffic += sg.len;
  at::Tensor mine = at::empty({route.ms[me].need_n}, at::TensorOptions().dtype(dt));
  if (traffic > 0) {
    at::Tensor in = send.empty() ? at::empty({0}, mine.options()) : at::cat(send);
    send.clear();
    int64_t recv_n = 0;
    for (auto n : out_splits) recv_n += n;
    at::Tensor recv = at::empty({recv_n}, mine.options());
    pg.all_to_all_single(recv, in, out_splits, in_splits);
    // Segments from each sender arrive in the order the sender listed them for me.
    std::vector<int64_t> pos(W, 0);
    for (int r = 1; r < W; ++r) pos[r] = pos[r - 1] + out_splits[r - 1];
    for (const auto& sg : route.to[me]) {
      mine.narrow(0, sg.dst, sg.len).copy_(recv.narrow(0, pos[sg.src], sg.len));
      pos[sg.src] += sg.len;
    }
  }
  return mine;
}

}  // namespace

std::vector<at::Tensor> exchange_ranges(dist::ProcessGroup& pg,
                                        const std::vector<RangeRequest>& requests,
                                        std::string& error) {
  const int me = pg.rank();
  std::vector<at::Tensor> out(requests.size());
  // Does any rank miss an element it needs? If not, each assembles its ranges alone.
  if (!needs_exchange(pg, requests, out)) return out;
  out.assign(requests.size(), at::Tensor());
  std::vector<std::vector<at::Tensor>> my_pieces(requests.size());
  const auto lines = exchange_metadata(pg, requests, my_pieces);
  for (size_t ki = 0; ki < requests.size(); ++ki) {
    const Route route = plan_route(lines, ki, requests[ki], pg.size());
    if (route.problem.empty() && !route.anyone) continue;  // the caller reports it missing
    if (!route.problem.empty()) {
      if (error.empty()) error = msg(route.problem, " (seen by ", rank(me), ")");
      continue;  // every rank skips this request alike
    }
    at::Tensor mine = move_segments(pg, route, my_pieces[ki]);
    if (route.ms[me].have) out[ki] = mine;  // a rank without the key reports it as missing
  }
  return out;
}

}  // namespace detail
}  // namespace fsdp
