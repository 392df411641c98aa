// The fuzz targets (see targets.h). Each reads from memory: the file-based readers get an
// in-memory file system (mem_fs.h) through the FileIO every reader accepts, so a run touches no
// disk and a campaign reaches thousands of executions a second.
#include "targets.h"

#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/dcp/manifest.h"
#include "checkpoint/dcp/metadata.h"
#include "checkpoint/dcp/reader.h"
#include "checkpoint/formats/pickle.h"
#include "checkpoint/formats/torch_archive.h"
#include "dir_targets.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/export.h"
#include "fsdp/checkpoint/file_io.h"
#include "fsdp/errors.h"

namespace fsdp {
namespace fuzz {

void finding(const char* target, const std::string& what) {
  std::fprintf(stderr, "fuzz target %s: %s\n", target, what.c_str());
  std::abort();
}

bool refused(const Error& e) {
  if (std::getenv("FSDP_FUZZ_VERBOSE")) std::fprintf(stderr, "refused: %s\n", e.what());
  return false;
}

namespace {

namespace ck = fsdp::checkpoint;

std::string bytes_of(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

// The globals of every reader together: torch.save's and DCP `.metadata`'s.
const std::set<std::pair<std::string, std::string>>& all_globals() {
  static const auto all = [] {
    auto s = ck::archive::pickle_globals();
    s.insert(ck::dcp::metadata_globals().begin(), ck::dcp::metadata_globals().end());
    return s;
  }();
  return all;
}

// The restricted unpickler, with every reader's globals and persistent ids allowed (wider than
// any one reader). What it accepts must survive the writer and read back.
bool run_pickle(const uint8_t* data, size_t size) {
  ck::pickle::ReadLimits limits;
  limits.persistent_ids = true;
  // Inputs stay under 4 KiB (a few thousand nodes made); the bound on the value's size as a tree
  // keeps the round trip below, which walks it as one, within the fuzzer's 1 s.
  limits.max_nodes = size_t{1} << 16;
  ck::pickle::NodePtr root;
  try {
    root = ck::pickle::read(bytes_of(data, size), all_globals(), limits);
  } catch (const Error& e) {
    return refused(e);
  }
  std::string again;
  try {
    again = ck::pickle::write(root);
  } catch (const Error&) {
    return true;  // the writer refuses bytes (protocol 2) and very deep trees: reading was safe
  }
  try {
    ck::pickle::read(again, all_globals(), limits);
  } catch (const Error& e) {
    finding("pickle", std::string("what the writer wrote does not read back: ") + e.what());
  }
  return true;
}

// DCP's `.metadata` (and the same model's wire form, exchanged between ranks): what parses must
// serialize and parse back to the same bytes.
bool run_dcp_metadata(const uint8_t* data, size_t size) {
  const std::string bytes = bytes_of(data, size);
  try {
    ck::dcp::decode_wire(bytes, "fuzz wire metadata");
  } catch (const Error&) {
  }
  ck::dcp::Metadata m;
  try {
    m = ck::dcp::parse_metadata(bytes, "fuzz/.metadata");
  } catch (const Error& e) {
    return refused(e);
  }
  std::string once;
  try {
    once = ck::dcp::serialize_metadata(m);
  } catch (const Error&) {
    return true;  // e.g. a structure the writer refuses to nest; reading it was still safe
  }
  try {
    const std::string twice = ck::dcp::serialize_metadata(ck::dcp::parse_metadata(once, "again"));
    if (twice != once) finding("dcp_metadata", "serialize(parse(serialize(m))) differs");
  } catch (const Error& e) {
    finding("dcp_metadata", std::string("serialized metadata does not parse: ") + e.what());
  }
  return true;
}

// The zip reader under `.distcp` items and `.pt` files: the directory, every record's CRC, and
// data.pkl unpickled (CRCs checked).
bool run_torch_archive(const uint8_t* data, size_t size) {
  const auto read = [&](int64_t offset, size_t n, char* dst) {
    if (offset < 0 || static_cast<uint64_t>(offset) > size || n > size - offset) {
      throw ValueError("fuzz archive: read past the end");
    }
    std::memcpy(dst, data + offset, n);
  };
  try {
    ck::archive::Directory dir(static_cast<int64_t>(size), read, "fuzz archive");
    for (const auto& [name, record] : dir.records()) {
      if (record.offset < 0 || record.size < 0 || record.offset > static_cast<int64_t>(size) ||
          record.size > static_cast<int64_t>(size) - record.offset) {
        finding("torch_archive", "record '" + name + "' lies outside the archive");
      }
      ck::archive::crc32(reinterpret_cast<const char*>(data) + record.offset,
                         static_cast<size_t>(record.size));
    }
    ck::archive::read_data_pkl(dir, read, true);
  } catch (const Error& e) {
    return refused(e);
  }
  return true;
}

bool run_manifest(const uint8_t* data, size_t size) {
  ck::manifest::Manifest m;
  try {
    m = ck::manifest::parse(bytes_of(data, size), "fuzz/.fsdp_manifest.json");
  } catch (const Error& e) {
    return refused(e);
  }
  try {
    ck::manifest::parse(ck::manifest::to_json(m), "again");
  } catch (const Error& e) {
    finding("manifest", std::string("to_json of a parsed manifest does not parse: ") + e.what());
  }
  return true;
}

// A reader of one file (load_safetensors, load_pt), given the input as that file.
bool run_file_reader(StateDict (*reader)(const std::string&, ck::FileIO*), const char* path,
                     const uint8_t* data, size_t size) {
  MemFS fs;
  fs.add(path, bytes_of(data, size));
  try {
    reader(path, &fs);
  } catch (const Error& e) {
    return refused(e);
  }
  return true;
}

bool run_safetensors(const uint8_t* data, size_t size) {
  return run_file_reader(ck::load_safetensors, "/fuzz/model.safetensors", data, size);
}

bool run_load_pt(const uint8_t* data, size_t size) {
  return run_file_reader(ck::load_pt, "/fuzz/model.pt", data, size);
}

// A whole checkpoint directory, its files cut out of the input (kFileSeparator), through
// verify, inspect, full_template and load, as `fsdp-ckpt verify` and `fsdp-train --resume` do.
// Accepted only if verify finds no problem (but a missing manifest) and the load succeeds.
// Every target qualifies for the load's direct read (normally from 256 KiB, which no input
// reaches): a tensor saved in one chunk is read straight into its target, one in several through
// the buffer, so both readers of an item see hostile bytes.
bool run_checkpoint(const uint8_t* data, size_t size) {
  static const char* const kNames[] = {".metadata", "__0_0.distcp", ck::manifest::kFileName};
  direct_reads_from_zero();
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const std::string_view sep(kFileSeparator);
  MemFS fs;
  size_t at = 0;
  for (const char* name : kNames) {
    if (at > in.size()) break;
    const size_t end = std::min(in.find(sep, at), in.size());
    fs.add(std::string("/fuzz/ckpt/") + name, std::string(in.substr(at, end - at)));
    at = end + sep.size();
  }
  const bool verified = verified_checkpoint("/fuzz/ckpt", fs);
  try {
    StateDict sd = ck::full_template(ck::inspect("/fuzz/ckpt", &fs));
    ck::load(sd, "/fuzz/ckpt", ck::LoadOptions().io(&fs));
  } catch (const Error& e) {
    return refused(e);
  }
  return verified;
}

}  // namespace

const std::vector<Target>& targets() {
  static const std::vector<Target> all = {
      {"pickle", "the restricted unpickler (torch.save globals, persistent ids)", run_pickle},
      {"dcp_metadata", "DCP .metadata and its wire form, with a round trip", run_dcp_metadata},
      {"torch_archive", "the zip/torch archive reader (.distcp items, .pt files)",
       run_torch_archive},
      {"manifest", "the checkpoint manifest (JSON), with a round trip", run_manifest},
      {"safetensors", "load_safetensors on one file", run_safetensors},
      {"load_pt", "load_pt on one file", run_load_pt},
      {"checkpoint", "a checkpoint directory through verify, inspect and load", run_checkpoint},
      {"checkpoint_files",
       "a checkpoint of named files (several data files): verify, inspect, a full load and a load "
       "into pieces, which must agree",
       run_checkpoint_files},
      {"safetensors_files",
       "a safetensors directory (shards and model.safetensors.index.json), read, written and read "
       "back",
       run_safetensors_files},
      {"assemble", "a node-local save's host directories assembled into one, which must load",
       run_assemble},
      {"fsdp_ckpt",
       "fsdp-ckpt's commands: inspect, verify, diff against itself, exports that must agree",
       run_fsdp_ckpt},
  };
  return all;
}

const Target* find_target(const std::string& name) {
  for (const Target& t : targets()) {
    if (name == t.name) return &t;
  }
  return nullptr;
}

}  // namespace fuzz
}  // namespace fsdp
