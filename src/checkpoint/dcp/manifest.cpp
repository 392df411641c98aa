// `.fsdp_manifest.json`: writing and validating parsing (manifest.h), through nlohmann::json.
#include "checkpoint/dcp/manifest.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <tuple>

#include "checkpoint/formats/json_text.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace manifest {
namespace {

using detail::msg;
using detail::quote;
using nlohmann::json;

bool item_less(const Item& a, const Item& b) {
  return std::tie(a.file, a.offset) < std::tie(b.file, b.offset);
}

bool plain_name(const std::string& s) {
  return !s.empty() && s != "." && s != ".." && s.find('/') == std::string::npos &&
         s.find('\0') == std::string::npos;
}

bool hex16(const std::string& s) {
  return s.size() == 16 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

// A value of the file, for an error message. A string or number as it is written; an array or
// an object by its kind only: nlohmann's dump() recurses once per level, and a hostile manifest
// nests hundreds of thousands of levels in a few hundred KiB (it overflowed the stack).
std::string brief(const json& v) {
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return v.dump();
}

// Typed field access that names the manifest and the field in its error.
struct Reader {
  const std::string& path;
  [[noreturn]] void fail(const std::string& what) const {
    throw CorruptionError(msg("checkpoint manifest ", path, ": ", what));
  }
  const json& field(const json& obj, const char* name) const {
    if (!obj.is_object()) fail(msg("expected an object holding ", quote(name)));
    auto it = obj.find(name);
    if (it == obj.end()) fail(msg(quote(name), " is missing"));
    return *it;
  }
  int64_t integer(const json& obj, const char* name, int64_t lo) const {
    const json& v = field(obj, name);
    if (!v.is_number_integer()) fail(msg(quote(name), " is not an integer"));
    const int64_t x = v.get<int64_t>();
    if (x < lo || (v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX))
      fail(msg(quote(name), " is out of range: ", brief(v)));
    return x;
  }
  std::string string(const json& obj, const char* name) const {
    const json& v = field(obj, name);
    if (!v.is_string()) fail(msg(quote(name), " is not a string"));
    return v.get<std::string>();
  }
};

}  // namespace

const Item* Manifest::find(const std::string& file, int64_t offset) const {
  Item probe;
  probe.file = file;
  probe.offset = offset;
  auto it = std::lower_bound(items.begin(), items.end(), probe, item_less);
  return it != items.end() && it->file == file && it->offset == offset ? &*it : nullptr;
}

std::string to_json(const Manifest& m) {
  json items = json::array();
  std::vector<Item> sorted = m.items;
  std::sort(sorted.begin(), sorted.end(), item_less);
  for (const Item& i : sorted)
    items.push_back({{"key", i.key},
                     {"file", i.file},
                     {"offset", i.offset},
                     {"length", i.length},
                     {"xxh3", i.xxh3}});
  json j = {{"format", "fsdp-cpp DCP checkpoint"},
            {"format_version", m.format_version},
            {"library_version", m.library_version},
            {"torch_version", m.torch_version},
            {"world_size", m.world_size},
            {"created_unix", m.created_unix},
            {"annotations", m.annotations},
            {"hash", "xxh3-64"},
            {"metadata_xxh3", m.metadata_xxh3},
            {"files", m.files},
            {"items", items}};
  if (!m.local_files.empty()) j["local_files"] = m.local_files;
  return j.dump(1) + "\n";
}

bool Manifest::holds(const std::string& file) const {
  return local_files.empty() || std::binary_search(local_files.begin(), local_files.end(), file);
}

Manifest parse(const std::string& bytes, const std::string& path) {
  Reader r{path};
  json j;
  if (const std::string why = json_text_problem(bytes); !why.empty()) {
    r.fail(msg("not valid JSON: ", why));
  }
  try {
    j = json::parse(bytes);
  } catch (const json::exception& e) {
    r.fail(msg("not valid JSON: ", e.what()));
  }
  Manifest m;
  m.format_version =
      static_cast<int>(std::min<int64_t>(r.integer(j, "format_version", 1), 1 << 30));
  if (m.format_version > kFormatVersion)
    r.fail(msg("format version ", m.format_version,
               " was written by a newer fsdp-cpp; this build reads up to version ",
               kFormatVersion));
  if (r.string(j, "hash") != "xxh3-64") r.fail(msg("unknown hash ", quote(r.string(j, "hash"))));
  m.library_version = r.string(j, "library_version");
  m.torch_version = r.string(j, "torch_version");
  m.world_size = static_cast<int>(std::min<int64_t>(r.integer(j, "world_size", 1), 1 << 30));
  m.created_unix = r.integer(j, "created_unix", 0);
  m.metadata_xxh3 = r.string(j, "metadata_xxh3");
  if (!hex16(m.metadata_xxh3)) r.fail("metadata_xxh3 is not 16 hex digits");
  const json& ann = r.field(j, "annotations");
  if (!ann.is_object()) r.fail("'annotations' is not an object");
  for (auto it = ann.begin(); it != ann.end(); ++it) {
    if (!it->is_string()) r.fail(msg("annotation ", quote(it.key()), " is not a string"));
    m.annotations[it.key()] = it->get<std::string>();
  }
  const json& files = r.field(j, "files");
  if (!files.is_object()) r.fail("'files' is not an object");
  for (auto it = files.begin(); it != files.end(); ++it) {
    if (!plain_name(it.key()))
      r.fail(msg("file name ", quote(it.key()), " is not a plain file name"));
    if (!it->is_number_integer() || it->get<int64_t>() < 0)
      r.fail(msg("the size of ", quote(it.key()), " is not a non-negative integer"));
    m.files[it.key()] = it->get<int64_t>();
  }
  if (j.contains("local_files")) {  // optional: node-local saves only
    const json& local = j["local_files"];
    if (!local.is_array() || local.empty()) r.fail("'local_files' is not a non-empty array");
    for (const json& f : local) {
      if (!f.is_string() || !m.files.count(f.get<std::string>()))
        r.fail(msg("'local_files' names ", brief(f), ", which 'files' does not list"));
      m.local_files.push_back(f.get<std::string>());
    }
    std::sort(m.local_files.begin(), m.local_files.end());
    if (std::adjacent_find(m.local_files.begin(), m.local_files.end()) != m.local_files.end())
      r.fail("'local_files' names a file twice");
  }
  const json& items = r.field(j, "items");
  if (!items.is_array()) r.fail("'items' is not an array");
  m.items.reserve(items.size());
  for (const json& x : items) {
    Item i;
    i.key = r.string(x, "key");
    i.file = r.string(x, "file");
    i.offset = r.integer(x, "offset", 0);
    i.length = r.integer(x, "length", 0);
    i.xxh3 = r.string(x, "xxh3");
    auto size = m.files.find(i.file);
    if (size == m.files.end())
      r.fail(msg("item ", quote(i.key), " is in ", quote(i.file), ", which 'files' does not list"));
    if (i.offset > size->second || i.length > size->second - i.offset)
      r.fail(msg("item ", quote(i.key), " at ", i.offset, " + ", i.length, " lies outside ",
                 quote(i.file), " (", size->second, " bytes)"));
    if (!hex16(i.xxh3)) r.fail(msg("the checksum of item ", quote(i.key), " is not 16 hex digits"));
    m.items.push_back(std::move(i));
  }
  std::sort(m.items.begin(), m.items.end(), item_less);
  for (size_t k = 1; k < m.items.size(); ++k)
    if (m.items[k].file == m.items[k - 1].file && m.items[k].offset == m.items[k - 1].offset)
      r.fail(msg("two items at offset ", m.items[k].offset, " of ", quote(m.items[k].file)));
  return m;
}

}  // namespace manifest
}  // namespace checkpoint
}  // namespace fsdp
