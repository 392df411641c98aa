// Imports of safetensors and `.pt` files (fsdp/checkpoint/export.h). Every size and offset in a
// file is checked against the file before anything is allocated for it; `.pt` pickles go through
// the restricted reader, so nothing in them runs.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <tuple>

#include "checkpoint/formats/json_text.h"
#include "checkpoint/formats/pickle.h"
#include "checkpoint/formats/tensor_formats.h"
#include "checkpoint/formats/torch_archive.h"
#include "checkpoint/storage/files.h"
#include "fsdp/checkpoint/export.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace {

using detail::msg;
using detail::quote;

constexpr int64_t kMaxHeader = int64_t{100} << 20;  // the reference reader's limit

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw ValueError(msg("safetensors ", path, ": ", what));
}

nlohmann::json parse_json(const std::string& text, const std::string& path) {
  if (const std::string why = json_text_problem(text); !why.empty()) {
    bad(path, msg("the header is not valid JSON: ", why));
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    bad(path, msg("the header is not valid JSON: ", e.what()));
  }
}

// One tensor of a safetensors header: its place in the data, relative to the data's start.
struct Spec {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t begin, end;
};

// The length of the JSON header, read from the file's first 8 bytes and checked against the limit
// and the file's `size`.
int64_t header_length(FileIO& io, const std::string& path, int64_t size) {
  if (size < 0) bad(path, msg("cannot open it: ", std::strerror(errno)));
  if (size < 8) bad(path, "shorter than its 8-byte header length");
  const std::string len_bytes = files::read_range(io, path, 0, 8, "safetensors");
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | static_cast<unsigned char>(len_bytes[k]);
  if (n > static_cast<uint64_t>(kMaxHeader) || static_cast<int64_t>(n) > size - 8)
    bad(path, msg("header length ", n, " exceeds the limit or the file (", size, " bytes)"));
  return static_cast<int64_t>(n);
}

// The header's entry `t` for tensor `name`, checked: a known dtype, a shape, and data_offsets
// holding exactly its bytes inside the `data_size`-byte data.
Spec parse_spec(const std::string& name, const nlohmann::json& t, int64_t data_size,
                const std::string& path) {
  const std::string what = msg("tensor ", quote(name));
  if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") || !t.contains("data_offsets"))
    bad(path, msg(what, " lacks dtype, shape or data_offsets"));
  if (!t["dtype"].is_string()) bad(path, msg(what, ": dtype is not a string"));
  const std::string dtype = t["dtype"].get<std::string>();
  Spec s{name, at::kFloat, {}, 0, 0};
  bool known = false;
  for (const auto& d : formats::dtype_names())
    if (dtype == d.safetensors) {
      s.dtype = d.dtype;
      known = true;
    }
  if (!known) bad(path, msg(what, ": unsupported dtype ", quote(dtype)));
  if (!t["shape"].is_array() || t["shape"].size() > 64) bad(path, msg(what, ": bad shape"));
  for (const auto& d : t["shape"]) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0) bad(path, msg(what, ": bad shape"));
    s.shape.push_back(d.get<int64_t>());
  }
  const auto& off = t["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_integer() ||
      !off[1].is_number_integer())
    bad(path, msg(what, ": data_offsets must be two integers"));
  s.begin = off[0].get<int64_t>();
  s.end = off[1].get<int64_t>();
  const int64_t nbytes =
      formats::checked_nbytes(s.shape, s.dtype, msg("safetensors ", path, ": ", what));
  if (s.begin < 0 || s.end < s.begin || s.end > data_size || s.end - s.begin != nbytes)
    bad(path, msg(what, ": data_offsets [", s.begin, ", ", s.end, "] do not hold its ", nbytes,
                  " bytes inside the ", data_size, "-byte data"));
  return s;
}

// As the reference reader: tensors tile the data exactly, without overlaps or gaps. Ordered by
// (begin, end), as it orders them: an empty tensor at [k, k] comes before the one starting at k,
// whatever the names (Python's save_file puts a shard's empty tensor at [0, 0] beside one at
// [0, n]; ordered by begin alone, that file was refused when the other name sorted first).
void check_tiling(const std::vector<Spec>& specs, int64_t data_size, const std::string& path) {
  std::vector<const Spec*> order;
  for (const auto& s : specs) order.push_back(&s);
  std::sort(order.begin(), order.end(), [](const Spec* a, const Spec* b) {
    return std::tie(a->begin, a->end) < std::tie(b->begin, b->end);
  });
  int64_t at = 0;
  for (const Spec* s : order) {
    if (s->begin != at)
      bad(path, msg("tensor ", quote(s->name), " overlaps another or leaves a gap"));
    at = s->end;
  }
  if (at != data_size) bad(path, "the data has bytes no tensor covers");
}

void read_safetensors_file(FileIO& io, const std::string& path, StateDict& out) {
  const int64_t size = io.file_size(path);
  const int64_t n = header_length(io, path, size);
  const nlohmann::json h = parse_json(files::read_range(io, path, 8, n, "safetensors"), path);
  if (!h.is_object()) bad(path, "the header is not a JSON object");
  const int64_t data_start = 8 + n;
  const int64_t data_size = size - data_start;
  std::vector<Spec> specs;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) bad(path, "__metadata__ is not an object");
      for (const auto& v : *it)
        if (!v.is_string()) bad(path, "__metadata__ values must be strings");
      continue;
    }
    Spec s = parse_spec(it.key(), *it, data_size, path);
    if (out.contains(s.name)) bad(path, msg("tensor ", quote(s.name), " appears twice"));
    specs.push_back(std::move(s));
  }
  check_tiling(specs, data_size, path);
  for (const Spec& s : specs) {
    at::Tensor t = at::empty(s.shape, at::TensorOptions().dtype(s.dtype));
    if (s.end > s.begin)
      files::read_into(io, path, data_start + s.begin, s.end - s.begin, t.data_ptr(),
                       "safetensors");
    out.insert_or_assign(s.name, t);
  }
}

}  // namespace

StateDict load_safetensors(const std::string& path_in, FileIO* io_in) {
  FileIO& io = io_in ? *io_in : default_file_io();
  std::string path = files::normalize(path_in);
  if (io.is_dir(path) == 1) {
    const std::string index = files::join(path, "model.safetensors.index.json");
    path = io.file_size(index) >= 0 ? index : files::join(path, "model.safetensors");
  }
  StateDict out;
  const std::string suffix = ".index.json";
  if (path.size() > suffix.size() &&
      path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0) {
    const nlohmann::json index =
        parse_json(files::read_file(io, path, kMaxHeader, "safetensors"), path);
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      bad(path, "the index has no weight_map object");
    std::map<std::string, std::vector<std::string>> by_file;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      if (!it->is_string())
        bad(path, msg("weight_map[", quote(files::printable(it.key())), "] is not a file name"));
      const std::string f = it->get<std::string>();
      if (!files::plain_file_name(f))
        bad(path,
            msg("weight_map names ", quote(files::printable(f)), ", not a file beside the index"));
      by_file[f].push_back(it.key());
    }
    const std::string dir = files::parent_of(path);
    for (const auto& [f, names] : by_file) {
      StateDict part;
      read_safetensors_file(io, files::join(dir, f), part);
      for (const auto& name : names)
        if (!part.contains(name))
          bad(path, msg("the index puts ", quote(name), " in ", f, ", which does not hold it"));
      for (auto& [k, v] : part) {
        if (out.contains(k)) bad(path, msg(quote(k), " is in two files"));
        out.insert_or_assign(k, v);
      }
    }
    return out;
  }
  read_safetensors_file(io, path, out);
  return out;
}

StateDict load_pt(const std::string& path, FileIO* io_in) {
  FileIO& io = io_in ? *io_in : default_file_io();
  const int64_t size = io.file_size(path);
  if (size < 0) throw ValueError(msg("load_pt: cannot open ", path, ": ", std::strerror(errno)));
  const std::string where = msg("load_pt ", path);
  const archive::ReadFn read = [&](int64_t offset, size_t n, char* dst) {
    files::read_into(io, path, offset, static_cast<int64_t>(n), dst, "load_pt");
  };
  const archive::Directory dir(size, read, where);
  const pickle::NodePtr root = archive::read_data_pkl(dir, read, /*check_crc=*/true);
  if (!root->is(pickle::Node::Kind::DICT))
    throw ValueError(
        msg(where, ": the file holds a ", pickle::to_string(root->kind), ", not a dict"));
  // Each storage is read straight into its tensor and checked against its CRC-32 (a .pt file
  // has no other checksum); tensors sharing a storage (tied weights) share it here too.
  archive::Values values(
      [&](const std::string& key, at::ScalarType dtype, int64_t numel) {
        const archive::Record& r = archive::storage_record(dir, key, dtype, numel);
        at::Tensor t = at::empty({numel}, at::TensorOptions().dtype(dtype));
        char* p = static_cast<char*>(t.data_ptr());
        read(r.offset, static_cast<size_t>(r.size), p);
        if (archive::crc32(p, static_cast<size_t>(r.size)) != r.crc32)
          throw CorruptionError(
              msg(where, ": storage ", key, " fails its CRC-32: the file is corrupt"));
        return t;
      },
      size, where);
  return values.value(root, "").dict();
}

}  // namespace checkpoint
}  // namespace fsdp
