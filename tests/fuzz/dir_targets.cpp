// The fuzz targets that read several files at once (dir_targets.h): a checkpoint with several
// data files, a sharded safetensors export with its index, a node-local save's host directories,
// and fsdp-ckpt's own commands. Each input is a set of named files (targets.h), so that the
// fuzzer can change any file, drop one, or add one the seeds did not have.
//
// Besides "no crash, only fsdp::Error", each checks an invariant between two ways of reading the
// same bytes: a load into pieces equals the full load; what is read and written back reads the
// same; what assemble verified loads; two exports of one checkpoint agree.
#include "dir_targets.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string_view>
#include <vector>

#include "checkpoint/dcp/reader.h"
#include "ckpt_commands.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/export.h"
#include "fsdp/state_value.h"
#include "targets.h"

namespace fsdp {
namespace fuzz {
namespace {

namespace ck = fsdp::checkpoint;

bool valid_path(std::string_view p) {
  if (p.empty() || p.size() > 200 || p.front() == '/' || p.back() == '/') return false;
  for (const char c : p)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return false;
  size_t at = 0;
  while (at <= p.size()) {
    const size_t end = std::min(p.find('/', at), p.size());
    const std::string_view part = p.substr(at, end - at);
    if (part.empty() || part == "." || part == "..") return false;
    at = end + 1;
  }
  return true;
}

// Tensors equal bit for bit (NaNs with the same payload included): the invariants compare what
// two readers made of the same stored bytes, so nothing may round.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  // An empty tensor's data pointer may be null, which memcmp must not see even for 0 bytes.
  return x.nbytes() == 0 || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

// Tensor keys of two flat dicts: the same keys, each bit for bit; "" if so, else the first
// difference.
std::string compare_tensors(const StateDict& a, const StateDict& b) {
  if (a.size() != b.size()) {
    return std::to_string(a.size()) + " keys against " + std::to_string(b.size());
  }
  for (const auto& [k, v] : a) {
    if (!b.contains(k)) return "'" + k + "' is missing";
    if (v.is_tensor() != b.at(k).is_tensor()) return "'" + k + "' changed kind";
    if (v.is_tensor() && !same_bits(v.tensor(), b.at(k).tensor())) return "'" + k + "' differs";
  }
  return "";
}

// The part of a tensor of n elements that pieces_of gives a template: elements [n/3, n/3 + n/2).
struct PieceRange {
  int64_t start, count;
  explicit PieceRange(int64_t n) : start(n / 3), count(n / 2) {}
};

// A template of pieces for `full`'s tensors, as a model sharded over several ranks holds them:
// elements [n/3, n/3 + n/2) of each tensor's flattening (an uneven range, cut mid-row, so the
// pieces are boxes of several shapes), none for an empty tensor. Non-tensor values as they are.
StateDict pieces_of(const StateDict& full) {
  StateDict out;
  for (const auto& [k, v] : full) {
    if (!v.is_tensor()) {
      out.insert_or_assign(k, v);
      continue;
    }
    const at::Tensor& t = v.tensor();
    const PieceRange r(t.numel());
    out.insert_or_assign(
        k, sharded_from_flat_range(t.sizes().vec(), r.start, at::empty({r.count}, t.options()), 1));
  }
  return out;
}

}  // namespace

void direct_reads_from_zero() {
  static const bool done = (ck::dcp::set_direct_read_min_bytes(0), true);
  (void)done;
}

bool verified_checkpoint(const std::string& dir, MemFS& fs) {
  try {
    const ck::VerifyReport report = ck::verify(dir, &fs);
    const bool ok = report.ok() || (!report.has_manifest && report.problems.size() == 1);
    if (!ok && std::getenv("FSDP_FUZZ_VERBOSE")) {
      for (const auto& p : report.problems) std::fprintf(stderr, "verify: %s\n", p.c_str());
    }
    return ok;
  } catch (const Error& e) {
    return refused(e);
  }
}

int add_named_files(MemFS& fs, const std::string& root, const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const std::string_view sep(kFileSeparator);
  int added = 0, parts = 0;
  for (size_t at = 0; at <= in.size() && parts < 64; ++parts) {
    const size_t end = std::min(in.find(sep, at), in.size());
    const std::string_view part = in.substr(at, end - at);
    at = end + sep.size();
    const size_t nl = part.find('\n');
    if (nl == std::string_view::npos || !valid_path(part.substr(0, nl))) continue;
    const std::string path = root + std::string(part.substr(0, nl));
    // A file where an earlier part made a directory, or under an earlier part's file: dropped.
    bool clash = fs.is_dir(path) == 1;
    for (size_t slash = path.find('/', root.size()); !clash && slash != std::string::npos;
         slash = path.find('/', slash + 1)) {
      clash = fs.find(path.substr(0, slash)) != nullptr;
    }
    if (clash) continue;
    fs.add(path, std::string(part.substr(nl + 1)));
    ++added;
  }
  return added;
}

bool run_checkpoint_files(const uint8_t* data, size_t size) {
  direct_reads_from_zero();
  MemFS fs;
  add_named_files(fs, "/fuzz/", data, size);
  const std::string dir = "/fuzz/ckpt";
  const bool verified = verified_checkpoint(dir, fs);
  StateDict full;
  try {
    full = ck::full_template(ck::inspect(dir, &fs));
    ck::load(full, dir, ck::LoadOptions().io(&fs));
  } catch (const Error& e) {
    return refused(e);
  }
  // The same checkpoint into pieces: every chunk the full load decoded, read again through the
  // boxes' intersections, must give the same elements.
  StateDict pieces = pieces_of(full);
  try {
    ck::load(pieces, dir, ck::LoadOptions().io(&fs));
  } catch (const Error& e) {
    finding("checkpoint_files",
            std::string("the full load worked, the pieces' failed: ") + e.what());
  }
  for (const auto& [k, v] : full) {
    if (!v.is_tensor()) continue;
    const at::Tensor& t = v.tensor();
    const PieceRange r(t.numel());
    const at::Tensor got =
        pieces.at(k).sharded_tensor().flat_range(r.start, r.count, "'" + k + "'");
    if (!same_bits(got, t.reshape({-1}).narrow(0, r.start, r.count))) {
      finding("checkpoint_files", "'" + k + "' loaded into pieces differs from the full load");
    }
  }
  return verified;
}

bool run_safetensors_files(const uint8_t* data, size_t size) {
  MemFS fs;
  add_named_files(fs, "/fuzz/", data, size);
  StateDict sd;
  try {
    sd = ck::load_safetensors("/fuzz/st", &fs);
  } catch (const Error& e) {
    return refused(e);
  }
  MemFS out(true);
  try {
    ck::save_safetensors(sd, "/out", ck::ExportOptions().prefix("").max_shard_bytes(64).io(&out));
  } catch (const Error&) {
    return true;  // e.g. a key the writer will not put in a header: reading was still safe
  }
  try {
    const std::string diff = compare_tensors(sd, ck::load_safetensors("/out", &out));
    if (!diff.empty()) finding("safetensors_files", "written and read back: " + diff);
  } catch (const Error& e) {
    finding("safetensors_files", std::string("what the writer wrote does not read: ") + e.what());
  }
  return true;
}

bool run_assemble(const uint8_t* data, size_t size) {
  MemFS fs(true);
  add_named_files(fs, "/fuzz/", data, size);
  std::vector<std::string> hosts;
  if (fs.list_dir("/fuzz", hosts) != 0) return false;
  for (auto& h : hosts) h = "/fuzz/" + h;
  try {
    ck::assemble(hosts, "/assembled", &fs);
  } catch (const Error& e) {
    return refused(e);
  }
  // assemble verified what it wrote: a verified checkpoint must load.
  try {
    StateDict sd = ck::full_template(ck::inspect("/assembled", &fs));
    ck::load(sd, "/assembled", ck::LoadOptions().io(&fs));
  } catch (const Error& e) {
    finding("assemble",
            std::string("an assembled, verified checkpoint does not load: ") + e.what());
  }
  return true;
}

bool run_fsdp_ckpt(const uint8_t* data, size_t size) {
  direct_reads_from_zero();
  MemFS fs(true);
  add_named_files(fs, "/fuzz/", data, size);
  // The checkpoint or export: the directory "a", else the first file (a .pt, a .safetensors).
  std::vector<std::string> names;
  if (fs.list_dir("/fuzz", names) != 0 || names.empty()) return false;
  const std::string a = fs.is_dir("/fuzz/a") == 1 ? "/fuzz/a" : "/fuzz/" + names.front();
  std::ostringstream out, err;
  const fsdp_ckpt::Output o{out, err, false};
  bool read_whole = false;
  try {
    fsdp_ckpt::inspect(a, fs, o);
  } catch (const Error& e) {
    refused(e);
  }
  try {
    fsdp_ckpt::verify(a, fs, o);
  } catch (const Error& e) {
    refused(e);
  }
  try {
    if (fsdp_ckpt::diff(a, a, 0, 0, "", "", fs, o) != 0) {
      finding("fsdp_ckpt", "diff of a checkpoint against itself finds differences: " + out.str());
    }
    read_whole = true;
  } catch (const Error& e) {
    refused(e);
  }
  // Two exports of the same checkpoint, and the safetensors one back into a checkpoint: the
  // tool's round trips, which must agree with each other whatever the input was.
  try {
    fsdp_ckpt::convert(a, "/out_st", "safetensors", std::nullopt, 128, fs, o);
    fsdp_ckpt::convert(a, "/out.pt", "pt", std::nullopt, 0, fs, o);
  } catch (const Error& e) {
    return refused(e) || read_whole;
  }
  try {
    if (fsdp_ckpt::diff("/out_st", "/out.pt", 0, 0, "", "", fs, o) != 0) {
      finding("fsdp_ckpt", "the safetensors and .pt exports differ: " + out.str());
    }
    fsdp_ckpt::convert("/out_st", "/out_dcp", "dcp", std::string(), 0, fs, o);
    if (fsdp_ckpt::diff("/out_st", "/out_dcp", 0, 0, "", "", fs, o) != 0) {
      finding("fsdp_ckpt", "a safetensors export converted back differs: " + out.str());
    }
  } catch (const Error& e) {
    finding("fsdp_ckpt", std::string("an export does not read back: ") + e.what());
  }
  return read_whole;
}

}  // namespace fuzz
}  // namespace fsdp
