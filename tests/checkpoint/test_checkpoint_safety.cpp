// Checkpoints that are atomic, verified and safe to open (issue 11): the manifest and its
// checksums, a flipped byte in any data file, a table of hostile files, injected I/O faults on
// any rank, a rank killed half way through a save, and step directories with `latest` and
// keep_last.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <functional>
#include <iterator>

#include "checkpoint/dcp/manifest.h"
#include "checkpoint/dcp/metadata.h"
#include "checkpoint/storage/files.h"
#include "dcp_testing.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/export.h"
#include "fsdp/errors.h"
#include "fuzz/targets.h"
#include "fuzz_regressions.h"
#include "memory_watch.h"
#include "multi_rank.h"
#include "state_dict_testing.h"

namespace ckpt = fsdp::checkpoint;
namespace dcp = fsdp::checkpoint::dcp;
using fsdp::ShardedTensor;
using fsdp::ShardMetadata;
using fsdp::StateDict;
using fsdp::StateValue;
using fsdp::dist::ProcessGroup;
using fsdp::testing::error_of;
using fsdp::testing::run_ranks;
using fsdp::testing::RunOptions;
using fsdp::testing::TempDir;
using namespace fsdp::testing;  // dcp_testing.h

namespace {

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& x : v) out += x + "\n";
  return out;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// ---- the manifest and checksums ----

// The manifest's checksums are XXH3-64 as xxHash defines it, whichever build computes them (the
// portable one, the AVX2 one where the CPU has it), in one piece or streamed in uneven pieces.
// The digests were computed by Debian's libxxhash (a separate build of the reference code) for
// sizes on each side of XXH3's internal boundaries (16, 128, 240 bytes, 1 KB blocks).
TEST(Xxh3, EveryBuildComputesTheReferenceDigest) {
  const std::vector<std::pair<size_t, std::string>> reference = {
      {0, "2d06800538d394c2"},      {1, "4c5cca45d0f4811f"},    {3, "6e3e2670e61106ac"},
      {16, "86abf6baccea0858"},     {17, "b58bf5dc5022d071"},   {128, "10d17f72c0ccba41"},
      {129, "1648bdc3db49d1a2"},    {240, "b6cfaf343fab81e6"},  {241, "956cae592c67279e"},
      {1024, "9fb9947417c15b80"},   {1025, "fe1b47100b1d79d8"}, {65543, "b3b117903157eaa7"},
      {1000003, "3b34f5bc1d444bbc"}};
  std::vector<ckpt::files::Xxh3Build> builds = {ckpt::files::Xxh3Build::BEST,
                                                ckpt::files::Xxh3Build::PORTABLE};
  if (ckpt::files::xxh3_avx2_available())
    builds.push_back(ckpt::files::Xxh3Build::AVX2);
  else
    std::printf("note: no AVX2 build or CPU here; only the portable build is checked\n");
  for (const auto& [n, digest] : reference) {
    std::string bytes(n, '\0');
    for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<char>(((i * 131 + 7) ^ (i >> 8)) & 0xff);
    for (const auto build : builds) {
      SCOPED_TRACE("build " + std::to_string(static_cast<int>(build)) + ", " + std::to_string(n) +
                   " bytes");
      EXPECT_EQ(ckpt::files::xxh3_hex(bytes.data(), n, build), digest);
      // Streamed in pieces from 1 byte to past a 1 KB block, so that pieces end inside stripes.
      ckpt::files::Xxh3Stream stream(build);
      size_t at = 0;
      for (size_t k = 0; at < n; ++k) {
        const size_t piece = std::min(n - at, (k * 7919 + 1) % 1500 + 1);
        stream.update(bytes.data() + at, piece);
        at += piece;
      }
      EXPECT_EQ(stream.hex(), digest);
    }
  }
}

TEST(CheckpointSafety, ManifestRecordsEveryItemAndVerifies) {
  TempDir tmp;
  run_ranks(2, [&](ProcessGroup& pg) {
    ckpt::save(sharded_sample(pg.rank(), 2, 1.0), tmp.file("c"),
               ckpt::SaveOptions().annotations({{"sharding_strategy", "FULL_SHARD"}}));
  });
  const std::string dir = tmp.file("c");
  const auto mf = ckpt::manifest::parse(read_bytes(dir + "/.fsdp_manifest.json"), "manifest");
  EXPECT_EQ(mf.format_version, ckpt::manifest::kFormatVersion);
  EXPECT_EQ(mf.world_size, 2);
  EXPECT_EQ(mf.annotations.at("sharding_strategy"), "FULL_SHARD");
  EXPECT_EQ(mf.files.size(), 2u);
  EXPECT_EQ(mf.files.at("__1_0.distcp"),
            static_cast<int64_t>(read_bytes(dir + "/__1_0.distcp").size()));
  const dcp::Metadata md = dcp::parse_metadata(read_bytes(dir + "/.metadata"));
  EXPECT_EQ(mf.items.size(), md.storage_data.size());
  EXPECT_EQ(mf.metadata_xxh3, ckpt::files::xxh3_hex(read_bytes(dir + "/.metadata")));
  const ckpt::VerifyReport rep = ckpt::verify(dir);
  EXPECT_TRUE(rep.ok()) << joined(rep.problems);
  EXPECT_EQ(rep.items, static_cast<int64_t>(md.storage_data.size()));
  EXPECT_EQ(rep.world_size, 2);
  EXPECT_TRUE(at::equal(load_full_sharded(dir), at::arange(30, at::kFloat).reshape({6, 5})));
  // No leftovers next to it.
  EXPECT_FALSE(exists(tmp.file(".c.partial")));
  // Without the manifest (a checkpoint Python wrote) it loads, and verify says it cannot check.
  ::unlink((dir + "/.fsdp_manifest.json").c_str());
  EXPECT_TRUE(at::equal(load_full_sharded(dir), at::arange(30, at::kFloat).reshape({6, 5})));
  const ckpt::VerifyReport bare = ckpt::verify(dir);
  EXPECT_FALSE(bare.has_manifest);
  ASSERT_EQ(bare.problems.size(), 1u);
  EXPECT_TRUE(contains(bare.problems[0], "has no .fsdp_manifest.json")) << bare.problems[0];
}

// One flipped byte anywhere in any data file is caught by load (when it reads that item) and by
// verify, naming the file and the key. The negative control: with verification off, a flip inside
// tensor data goes unnoticed and the values are wrong.
TEST(CheckpointSafety, FlippedByteInAnyDataFileIsNamed) {
  TempDir tmp;
  run_ranks(
      2, [&](ProcessGroup& pg) { ckpt::save(sharded_sample(pg.rank(), 2, 1.0), tmp.file("c")); });
  const std::string dir = tmp.file("c");
  const auto mf = ckpt::manifest::parse(read_bytes(dir + "/.fsdp_manifest.json"), "manifest");
  int flips = 0;
  for (const auto& item : mf.items) {
    const std::string path = dir + "/" + item.file;
    const std::string good = read_bytes(path);
    // The first, middle and last byte of the item.
    for (int64_t at : {item.offset, item.offset + item.length / 2, item.offset + item.length - 1}) {
      std::string bad = good;
      bad[static_cast<size_t>(at)] ^= 0x10;
      write_bytes(path, bad);
      const ckpt::VerifyReport rep = ckpt::verify(dir);
      ASSERT_EQ(rep.problems.size(), 1u) << item.key << " @" << at << ": " << joined(rep.problems);
      EXPECT_TRUE(contains(rep.problems[0], "checksum mismatch")) << rep.problems[0];
      EXPECT_TRUE(contains(rep.problems[0], "'" + item.key + "'")) << rep.problems[0];
      EXPECT_TRUE(contains(rep.problems[0], item.file)) << rep.problems[0];
      StateDict t = blank(StateValue(sample())).dict();
      t.at("model").dict().insert_or_assign("sharded", at::full({6, 5}, -1.0));
      // A CorruptionError (a ValueError): the bytes are wrong, retrying reads them again.
      const std::string err =
          fsdp::testing::error_of_kind<fsdp::CorruptionError>([&] { ckpt::load(t, dir); });
      EXPECT_FALSE(contains(err, "(not the expected kind)")) << err;
      EXPECT_TRUE(contains(err, "checksum mismatch") && contains(err, "'" + item.key + "'") &&
                  contains(err, item.file))
          << item.key << " @" << at << ": " << err;
      ++flips;
    }
    write_bytes(path, good);
  }
  EXPECT_EQ(flips, 3 * static_cast<int>(mf.items.size()));
  EXPECT_TRUE(ckpt::verify(dir).ok());
  // Negative control: the last byte of a float item's storage record is tensor data, which no
  // decoder checks; without the checksum the flip loads silently as a different value.
  const auto* w = [&]() -> const ckpt::manifest::Item* {
    for (const auto& i : mf.items)
      if (i.key == "model.sharded") return &i;
    return nullptr;
  }();
  ASSERT_NE(w, nullptr);
  const std::string path = dir + "/" + w->file;
  const std::string good = read_bytes(path);
  const std::string item_bytes =
      good.substr(static_cast<size_t>(w->offset), static_cast<size_t>(w->length));
  // The float data of a 3x5 chunk of 0..29 lies in the record; find the float 7.0's bytes.
  const float seven = 7.0f;
  const std::string needle(reinterpret_cast<const char*>(&seven), sizeof seven);
  const size_t pos = item_bytes.find(needle);
  ASSERT_NE(pos, std::string::npos);
  std::string bad = good;
  bad[static_cast<size_t>(w->offset) + pos + 3] ^= 0x01;
  write_bytes(path, bad);
  EXPECT_FALSE(
      at::equal(load_tensor(dir, "model.sharded", {6, 5}, ckpt::LoadOptions().verify(false)),
                at::arange(30, at::kFloat).reshape({6, 5})));
  EXPECT_TRUE(contains(error_of([&] { load_full_sharded(dir); }), "checksum mismatch"));
  // Without the manifest (as a checkpoint Python wrote), the item's own zip CRC-32 catches it.
  ASSERT_EQ(::unlink((dir + "/.fsdp_manifest.json").c_str()), 0);
  const std::string crc_err = error_of([&] { load_full_sharded(dir); });
  EXPECT_TRUE(contains(crc_err, "fails its CRC-32") && contains(crc_err, "model.sharded"))
      << crc_err;
  EXPECT_FALSE(ckpt::verify(dir).ok());
}

// ---- hostile files ----

// Copies the files of checkpoint `from` into a fresh directory `to`.
void copy_dir(const std::string& from, const std::string& to) {
  ::mkdir(to.c_str(), 0755);
  for (const char* f : {".metadata", ".fsdp_manifest.json", "__0_0.distcp"})
    write_bytes(to + "/" + f, read_bytes(from + "/" + f));
}

// Replaces `.metadata` with `m` and points the manifest's checksum at it, so that the parser
// (not the checksum) is what must reject a bad value.
void set_metadata(const std::string& dir, const std::string& bytes) {
  const std::string old_hash = ckpt::files::xxh3_hex(read_bytes(dir + "/.metadata"));
  write_bytes(dir + "/.metadata", bytes);
  std::string mf = read_bytes(dir + "/.fsdp_manifest.json");
  const size_t at = mf.find(old_hash);
  ASSERT_NE(at, std::string::npos);
  mf.replace(at, old_hash.size(), ckpt::files::xxh3_hex(bytes));
  write_bytes(dir + "/.fsdp_manifest.json", mf);
}

void edit_metadata(const std::string& dir, const std::function<void(dcp::Metadata&)>& edit) {
  dcp::Metadata m = dcp::parse_metadata(read_bytes(dir + "/.metadata"));
  edit(m);
  set_metadata(dir, dcp::serialize_metadata(m));
}

void edit_manifest(const std::string& dir, const std::string& from, const std::string& to) {
  std::string mf = read_bytes(dir + "/.fsdp_manifest.json");
  const size_t at = mf.find(from);
  ASSERT_NE(at, std::string::npos) << from;
  mf.replace(at, from.size(), to);
  write_bytes(dir + "/.fsdp_manifest.json", mf);
}

dcp::StorageInfo& storage_of(dcp::Metadata& m, const std::string& key) {
  for (auto& [idx, info] : m.storage_data)
    if (idx.fqn == key) return info;
  throw std::runtime_error("no storage for " + key);
}

struct Hostile {
  const char* name;
  std::function<void(const std::string& dir)> damage;
  const char* expected;  // part of the error
};

// Each file is rejected with a clear error (an fsdp::Error naming what is wrong), by load and by
// verify, before any large allocation: the counting allocator sees less than 64 KiB of tensors
// (the checkpoint holds under 1 KiB of tensor data, the hostile sizes claim up to exabytes).
TEST(CheckpointSafety, HostileFilesAreRejectedBeforeLargeAllocations) {
  TempDir tmp;
  run_ranks(1, [&](ProcessGroup&) {
    const std::string good = tmp.file("good");
    ckpt::save(sample(), good);
    const std::string data = read_bytes(good + "/__0_0.distcp");
    const std::string meta = read_bytes(good + "/.metadata");
    const std::vector<Hostile> table = {
        {"metadata truncated", [&](auto d) { set_metadata(d, meta.substr(0, meta.size() / 2)); },
         ".metadata"},
        {"metadata empty", [&](auto d) { set_metadata(d, ""); }, ".metadata"},
        {"metadata garbage",
         [&](auto d) {
           std::string g(200, '\0');
           for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<char>(i * 131 + 7);
           set_metadata(d, g);
         },
         ".metadata"},
        {"metadata calls os.system",
         [&](auto d) {
           set_metadata(d, std::string("\x80\x02"
                                       "cos\nsystem\nX\x02\x00\x00\x00"
                                       "id\x85R.",
                                       23));
         },
         "os.system"},
        {"metadata over the size limit",
         [&](auto d) {
           ASSERT_EQ(::truncate((d + "/.metadata").c_str(), (int64_t{64} << 20) + 1), 0);
         },
         "accepted"},
        {"metadata swapped, manifest unchanged",
         [&](auto d) { write_bytes(d + "/.metadata", meta + "."); }, "checksum"},
        {"path outside the directory",
         [&](auto d) {
           edit_metadata(d,
                         [](dcp::Metadata& m) { storage_of(m, "model.w").relative_path = "../x"; });
         },
         "not a plain file name"},
        {"negative offset",
         [&](auto d) {
           edit_metadata(d, [](dcp::Metadata& m) { storage_of(m, "model.w").offset = -8; });
         },
         "negative"},
        {"length past the end",
         [&](auto d) {
           edit_metadata(
               d, [](dcp::Metadata& m) { storage_of(m, "model.w").length = int64_t{1} << 50; });
         },
         "bytes asked for"},
        {"offset + length overflows",
         [&](auto d) {
           edit_metadata(d, [](dcp::Metadata& m) {
             storage_of(m, "model.w").offset = INT64_MAX - 4;
             storage_of(m, "model.w").length = 1000;
           });
         },
         "bytes asked for"},
        {"chunk outside its tensor",
         [&](auto d) {
           edit_metadata(d, [](dcp::Metadata& m) {
             for (auto& [k, it] : m.state_dict_metadata)
               if (k == "model.w") it.tensor.chunks[0].sizes = {30, 4};
           });
         },
         "model.w"},
        {"chunk smaller than its tensor",
         [&](auto d) {
           edit_metadata(d, [](dcp::Metadata& m) {
             for (auto& [k, it] : m.state_dict_metadata)
               if (k == "model.w") it.tensor.chunks[0].sizes = {3, 2};
           });
         },
         "are in no chunk"},
        {"unknown dtype",
         [&](auto d) {
           std::string m = meta;
           const size_t at = m.find("float32");
           ASSERT_NE(at, std::string::npos);
           m.replace(at, 7, "float99");
           set_metadata(d, m);
         },
         "float99"},
        {"chunk stored twice",
         [&](auto d) {
           edit_metadata(d, [](dcp::Metadata& m) {
             for (size_t i = 0; i < m.storage_data.size(); ++i)
               if (m.storage_data[i].first.fqn == "model.w") {
                 m.storage_data.push_back(m.storage_data[i]);
                 break;
               }
           });
         },
         "stored twice"},
        {"200000 open marks",
         [&](auto d) { set_metadata(d, "\x80\x02" + std::string(200000, '(') + "."); },
         ".metadata"},
        {"data file truncated",
         [&](auto d) { write_bytes(d + "/__0_0.distcp", data.substr(0, data.size() / 3)); },
         "__0_0.distcp"},
        {"data file missing", [&](auto d) { ::unlink((d + "/__0_0.distcp").c_str()); },
         "__0_0.distcp"},
        {"data file garbage, no manifest",
         [&](auto d) {
           std::string g = data;
           for (size_t i = 0; i < g.size(); i += 5) g[i] = static_cast<char>(i * 17);
           write_bytes(d + "/__0_0.distcp", g);
           ::unlink((d + "/.fsdp_manifest.json").c_str());
         },
         "__0_0.distcp"},
        {"data items swapped, no manifest",
         [&](auto d) {
           // Two tensors' storage entries exchanged: each decodes, to the wrong dtype or shape.
           edit_metadata(d, [](dcp::Metadata& m) {
             std::swap(storage_of(m, "model.w"), storage_of(m, "model.i"));
           });
           ::unlink((d + "/.fsdp_manifest.json").c_str());
         },
         "the metadata says"},
        {"manifest not JSON", [&](auto d) { write_bytes(d + "/.fsdp_manifest.json", "{\"format"); },
         "not valid JSON"},
        {"manifest from the future",
         [&](auto d) { edit_manifest(d, "\"format_version\": 1", "\"format_version\": 99"); },
         "newer fsdp-cpp"},
        {"manifest names a file outside",
         [&](auto d) { edit_manifest(d, "\"__0_0.distcp\": ", "\"../__0_0.distcp\": "); },
         "plain file name"},
        {"manifest item past its file",
         [&](auto d) { edit_manifest(d, "\"offset\": 0", "\"offset\": 999999999"); }, "outside"},
        // A list nested a million deep (a million EMPTY_LISTs, then APPENDs): within every limit
        // of the reader, and it used to overflow the stack when the parsed tree was destroyed
        // (issue 39).
        {"metadata nested a million deep",
         [&](auto d) {
           const size_t n = 1000000;
           set_metadata(d, "\x80\x02" + std::string(n, ']') + std::string(n - 1, 'a') + ".");
         },
         ".metadata"},
        // One byte of a str made 0xff: Python's dcp.load raises UnicodeDecodeError on it, so we
        // must not approve it either (issue 39; we used to accept it).
        {"metadata with a str that is not UTF-8",
         [&](auto d) {
           std::string m = meta;
           const size_t at = m.find("planner_data");
           ASSERT_NE(at, std::string::npos);
           m[at] = '\xff';
           set_metadata(d, m);
         },
         "not UTF-8"},
        // nlohmann's parser stops at a NUL: without our check this manifest parsed (issue 39).
        {"manifest with a NUL and garbage after it",
         [&](auto d) {
           const std::string mf = read_bytes(d + "/.fsdp_manifest.json");
           write_bytes(d + "/.fsdp_manifest.json", mf + std::string("\0{garbage", 9));
         },
         "a NUL byte at offset"},
        {"manifest deeply nested",
         [&](auto d) { write_bytes(d + "/.fsdp_manifest.json", std::string(100000, '[')); },
         "not valid JSON"},
        // Closed this time, inside a field whose bad value the error message names: printing
        // the value must not recurse through 200,000 levels (issue 62's deep-nesting class).
        {"manifest with local_files nested deep",
         [&](auto d) {
           const size_t n = 200000;
           edit_manifest(
               d, "\"files\": ",
               "\"local_files\": [" + std::string(n, '[') + std::string(n, ']') + "], \"files\": ");
         },
         "'local_files' names"},
        {"manifest over the size limit",
         [&](auto d) {
           ASSERT_EQ(::truncate((d + "/.fsdp_manifest.json").c_str(), (int64_t{256} << 20) + 1), 0);
         },
         "accepted"},
        {"metadata is a directory",
         [&](auto d) {
           ::unlink((d + "/.metadata").c_str());
           ::mkdir((d + "/.metadata").c_str(), 0755);
         },
         ".metadata"},
    };
    ASSERT_GE(table.size(), 20u);
    int n = 0;
    for (const Hostile& h : table) {
      const std::string dir = tmp.file("h" + std::to_string(n++));
      copy_dir(good, dir);
      h.damage(dir);
      fsdp::testing::keep_as_fuzz_regression(
          "checkpoint_files", h.name,
          fsdp::testing::pack_named_files(dir, "ckpt/", fsdp::fuzz::kFileSeparator));
      StateDict t = blank(StateValue(sample())).dict();
      std::string err;
      int64_t peak = 0;
      {
        fsdp::testing::MemoryWatch watch;
        err = error_of([&] { ckpt::load(t, dir); });
        peak = watch.peak();
      }
      EXPECT_TRUE(contains(err, h.expected)) << h.name << ": " << err;
      EXPECT_NE(err, "(no error)") << h.name;
      EXPECT_LT(peak, 64 << 10) << h.name;
      const ckpt::VerifyReport rep = ckpt::verify(dir);
      EXPECT_FALSE(rep.ok()) << h.name;
      // The undamaged original still loads: the table's damage is what fails.
    }
    StateDict t = blank(StateValue(sample())).dict();
    EXPECT_EQ(error_of([&] { ckpt::load(t, good); }), "(no error)");
    EXPECT_TRUE(ckpt::verify(good).ok());
  });
}

// ---- I/O faults ----

// Fails the n-th call of one operation on one rank (optionally only on paths containing a part),
// or kills the process there.
struct FaultIO : ckpt::FileIO {
  std::string op;
  int nth = 1;
  int err = EIO;
  std::string path_part;
  bool kill = false;
  int calls = 0;
  std::map<int, std::string> fd_paths;

  bool hit(const std::string& o, const std::string& path) {
    if (o != op || !contains(path, path_part) || ++calls != nth) return false;
    if (kill) ::kill(::getpid(), SIGKILL);
    errno = err;
    return true;
  }
  int open(const std::string& path, int flags, int mode) override {
    if (hit("open", path)) return -1;
    const int fd = FileIO::open(path, flags, mode);
    if (fd >= 0) fd_paths[fd] = path;
    return fd;
  }
  int64_t write(int fd, const void* data, size_t n) override {
    if (hit("write", fd_paths[fd])) return -1;
    if (hit("write0", fd_paths[fd])) return 0;
    return FileIO::write(fd, data, n);
  }
  int fsync(int fd) override { return hit("fsync", fd_paths[fd]) ? -1 : FileIO::fsync(fd); }
  int rename(const std::string& a, const std::string& b) override {
    return hit("rename", a) ? -1 : FileIO::rename(a, b);
  }
  int exchange(const std::string& a, const std::string& b) override {
    return hit("exchange", a) ? -1 : FileIO::exchange(a, b);
  }
  int mkdir(const std::string& path, int mode) override {
    return hit("mkdir", path) ? -1 : FileIO::mkdir(path, mode);
  }
};

// A FileIO whose writes take at most 7 bytes a call (POSIX allows it; callers must loop).
struct ChunkyIO : ckpt::FileIO {
  int64_t write(int fd, const void* data, size_t n) override {
    return FileIO::write(fd, data, std::min<size_t>(n, 7));
  }
};

// verify's coverage checks against hostile metadata (issue 39): element counts that overflow an
// int64 used to pass (they wrapped to the chunks' volume), and beyond 4096 chunks, where pairs are
// not tested, an overlap plus a hole of the same size passed too. 5000 chunks that do tile are the
// negative control.
TEST(CheckpointSafety, VerifyFindsChunksThatDoNotTileTheirTensor) {
  TempDir tmp;
  run_ranks(1, [&](ProcessGroup&) {
    const std::string good = tmp.file("good");
    ckpt::save(sample(), good);
    // verify's problems once model.w's entry in .metadata is edited.
    auto verify_with = [&](const std::string& name,
                           const std::function<void(dcp::TensorMeta&)>& edit) {
      const std::string d = tmp.file(name);
      copy_dir(good, d);
      edit_metadata(d, [&](dcp::Metadata& m) {
        for (auto& [key, item] : m.state_dict_metadata)
          if (key == "model.w") edit(item.tensor);
      });
      return ckpt::verify(d).problems;
    };
    auto mentions = [](const std::vector<std::string>& problems, const std::string& part) {
      for (const auto& p : problems)
        if (p.find(part) != std::string::npos) return true;
      return false;
    };
    auto first = [](const std::vector<std::string>& problems) {
      return problems.empty() ? std::string("(no problem)") : problems.front();
    };
    auto reshape = [](dcp::TensorMeta& t, std::vector<int64_t> size) {
      t.size = std::move(size);
      t.chunks.clear();
    };
    // 2^32 x 2^32 elements and no chunk: the count wrapped to 0, the chunks' volume.
    auto p = verify_with("wrap0", [&](dcp::TensorMeta& t) {
      reshape(t, {int64_t{1} << 32, int64_t{1} << 32});
    });
    EXPECT_TRUE(mentions(p, "more elements than an int64 counts")) << first(p);
    // (2^62 + 1) x 4 with one 1 x 4 chunk: the count wrapped to 4.
    p = verify_with("wrap4", [&](dcp::TensorMeta& t) {
      reshape(t, {(int64_t{1} << 62) + 1, 4});
      t.chunks.push_back({{0, 0}, {1, 4}});
    });
    EXPECT_TRUE(mentions(p, "more elements than an int64 counts")) << first(p);
    // 5000 one-element chunks of a 1 x 5000 tensor tile it: no overlap, the volumes add up.
    auto tiles = [&](dcp::TensorMeta& t) {
      reshape(t, {1, 5000});
      for (int64_t i = 0; i < 5000; ++i) t.chunks.push_back({{0, i}, {1, 1}});
    };
    p = verify_with("tiles", tiles);
    EXPECT_FALSE(mentions(p, "overlapping")) << first(p);
    EXPECT_FALSE(mentions(p, "elements, the tensor")) << first(p);
    // The second chunk moved onto the first: an overlap and a hole of the same size.
    p = verify_with("overlap", [&](dcp::TensorMeta& t) {
      tiles(t);
      t.chunks[1].offsets = {0, 0};
    });
    EXPECT_TRUE(mentions(p, "'model.w' has overlapping chunks at [0, 0] and [0, 0]")) << first(p);
    EXPECT_FALSE(mentions(p, "elements, the tensor")) << "the volumes still add up";
  });
}

// An export, or a full template for diff and convert, allocates each tensor whole. A tensor that
// claims more bytes than its key stores (here 1 GiB, which would fit in memory, against the
// 48 bytes of its one chunk) is refused before any allocation: it used to be allocated, and only
// the chunks' coverage check failed afterwards (issue 39).
TEST(CheckpointSafety, ExportRefusesATensorItsChunksCannotHold) {
  TempDir tmp;
  run_ranks(1, [&](ProcessGroup&) {
    const std::string good = tmp.file("good"), bad = tmp.file("bad");
    ckpt::save(sample(), good);
    copy_dir(good, bad);
    edit_metadata(bad, [&](dcp::Metadata& m) {
      for (auto& [key, item] : m.state_dict_metadata)
        if (key == "model.w") item.tensor.size = {int64_t{1} << 16, int64_t{1} << 12};
    });
    for (const bool template_only : {false, true}) {
      std::string err;
      int64_t peak = 0;
      {
        fsdp::testing::MemoryWatch watch;
        try {
          if (template_only) {
            ckpt::full_template(ckpt::inspect(bad));
          } else {
            ckpt::export_safetensors(bad, tmp.file("st"));
          }
        } catch (const fsdp::CorruptionError& e) {
          err = e.what();
        }
        peak = watch.peak();
      }
      EXPECT_NE(err.find("'model.w' claims 1073741824 bytes"), std::string::npos) << err;
      EXPECT_LT(peak, 64 << 10) << template_only;
    }
    // The negative control: the checkpoint as saved exports.
    EXPECT_NO_THROW(ckpt::export_safetensors(good, tmp.file("good_st")));
  });
}

TEST(CheckpointSafety, ShortWritesAreCompleted) {
  TempDir tmp;
  run_ranks(2, [&](ProcessGroup& pg) {
    ChunkyIO io;
    ckpt::save(sharded_sample(pg.rank(), 2, 1.0), tmp.file("c"), ckpt::SaveOptions().io(&io));
    if (pg.rank() == 0) {
      EXPECT_TRUE(ckpt::verify(tmp.file("c")).ok());
    }
  });
  EXPECT_TRUE(
      at::equal(load_full_sharded(tmp.file("c")), at::arange(30, at::kFloat).reshape({6, 5})));
}

struct Fault {
  const char* name;
  int rank;
  const char* op;
  int nth;
  int err;
  const char* path_part;
  const char* expected;
};

// Each injected fault fails the save on every rank with a clear error naming the rank and the
// cause, commits nothing (the earlier step stays `latest` and loads), and the next save succeeds
// and clears the leftovers. Two targets: a new step directory, and overwriting an existing one.
TEST(CheckpointSafety, InjectedFaultsFailEveryRankAndCommitNothing) {
  const std::vector<Fault> faults = {
      {"ENOSPC writing data", 1, "write", 1, ENOSPC, "distcp", "No space left on device"},
      {"write makes no progress", 0, "write0", 2, 0, "distcp", "No space left on device"},
      {"fsync of a data file", 1, "fsync", 1, EIO, "distcp", "Input/output error"},
      {"fsync of .metadata", 0, "fsync", 1, EIO, ".metadata", "Input/output error"},
      {"opening a data file", 1, "open", 1, EMFILE, "distcp", "Too many open files"},
      {"creating the partial directory", 0, "mkdir", 1, EACCES, ".partial", "Permission denied"},
      {"the commit rename", 0, "rename", 1, EIO, ".partial", "Input/output error"},
      {"the commit swap", 0, "exchange", 1, EIO, ".partial", "Input/output error"},
  };
  for (const Fault& f : faults) {
    SCOPED_TRACE(f.name);
    TempDir tmp;
    const std::string root = tmp.file("ckpt");
    const bool overwrite = std::string(f.op) == "exchange";
    run_ranks(2, [&](ProcessGroup& pg) {
      ckpt::save_step(sharded_sample(pg.rank(), 2, 1.0), root, 1);
      FaultIO io;
      if (pg.rank() == f.rank) {
        io.op = f.op;
        io.nth = f.nth;
        io.err = f.err;
        io.path_part = f.path_part;
      }
      const int64_t step = overwrite ? 1 : 2;
      // An IOError on every rank, the faulting one's errno with it (ENOSPC for a write that
      // makes no progress), whichever rank and stage it came from.
      std::string err = "(no error)";
      int code = -1;
      try {
        ckpt::save_step(sharded_sample(pg.rank(), 2, 2.0), root, step, ckpt::SaveOptions().io(&io));
      } catch (const fsdp::IOError& e) {
        err = e.what();
        code = e.error_code();
      } catch (const std::exception& e) {
        err = std::string("(not an IOError) ") + e.what();
      }
      EXPECT_TRUE(contains(err, f.expected)) << "rank " << pg.rank() << ": " << err;
      EXPECT_EQ(code, f.err != 0 ? f.err : ENOSPC) << "rank " << pg.rank() << ": " << err;
      if (pg.rank() != f.rank || f.rank != 0) {
        EXPECT_TRUE(contains(err, "rank " + std::to_string(f.rank)))
            << "rank " << pg.rank() << ": " << err;
      }
      pg.barrier();
      if (pg.rank() == 0) {
        EXPECT_EQ(ckpt::latest_checkpoint(root), ckpt::step_dir(root, 1));
        EXPECT_EQ(ckpt::list_steps(root), std::vector<int64_t>{1});
        EXPECT_DOUBLE_EQ(saved_scale(ckpt::step_dir(root, 1)), 1.0);
        EXPECT_TRUE(ckpt::verify(ckpt::step_dir(root, 1)).ok());
      }
      pg.barrier();
      // The next save goes through and leaves nothing behind.
      ckpt::save_step(sharded_sample(pg.rank(), 2, 3.0), root, 2);
      if (pg.rank() == 0) {
        EXPECT_DOUBLE_EQ(saved_scale(ckpt::step_dir(root, 2)), 3.0);
        EXPECT_FALSE(exists(root + "/.step_2.partial"));
        EXPECT_FALSE(exists(root + "/.step_1.partial"));
      }
    });
  }
}

// Exports write through LibTorch's zip writer, which calls back into our file code from C: a
// write error there must come back as the export's error (not terminate the process), and leave
// no file behind.
TEST(CheckpointSafety, ExportWriteErrorsAreReportedAndLeaveNoFile) {
  TempDir tmp;
  const std::string dir = tmp.file("c");
  run_ranks(2, [&](ProcessGroup& pg) { ckpt::save(sharded_sample(pg.rank(), 2, 1.0), dir); });
  for (const char* op : {"write", "write0"}) {
    SCOPED_TRACE(op);
    for (int nth : {1, 3}) {
      FaultIO io;
      io.op = op;
      io.nth = nth;
      io.err = ENOSPC;
      io.path_part = "model.pt";
      const std::string out = tmp.file("model.pt");
      const std::string err = fsdp::testing::error_of_kind<fsdp::IOError>(
          [&] { ckpt::export_pt(dir, out, ckpt::ExportOptions().io(&io)); });
      EXPECT_TRUE(contains(err, "No space left on device")) << err;
      EXPECT_FALSE(contains(err, "(not the expected kind)")) << err;
      EXPECT_NE(::access(out.c_str(), F_OK), 0) << "a partial export was left at " << out;
    }
  }
}

// A rank killed with SIGKILL in the middle of writing its data, or rank 0 killed just before the
// commit rename: the surviving rank fails with an error (no hang), the previous checkpoint stays
// `latest` and loads, and the next save clears the leftover.
TEST(CheckpointSafety, SaveKilledPartWayLeavesThePreviousCheckpoint) {
  struct Kill {
    int rank;
    const char* op;
    int nth;
    const char* path_part;
  };
  for (const Kill& k : {Kill{1, "write", 1, "distcp"}, Kill{0, "rename", 1, ".partial"}}) {
    SCOPED_TRACE(std::string("rank ") + std::to_string(k.rank) + " killed at " + k.op);
    TempDir tmp;
    const std::string root = tmp.file("ckpt");
    run_ranks(
        2, [&](ProcessGroup& pg) { ckpt::save_step(sharded_sample(pg.rank(), 2, 1.0), root, 1); });
    RunOptions opts;
    opts.report = false;
    opts.collective_timeout = std::chrono::seconds(5);
    opts.grace = std::chrono::seconds(20);
    const auto results = run_ranks(
        2,
        [&](ProcessGroup& pg) {
          FaultIO io;
          if (pg.rank() == k.rank) {
            io.op = k.op;
            io.nth = k.nth;
            io.path_part = k.path_part;
            io.kill = true;
          }
          ckpt::save_step(sharded_sample(pg.rank(), 2, 2.0), root, 2, ckpt::SaveOptions().io(&io));
        },
        opts);
    ASSERT_EQ(results.size(), 2u);
    EXPECT_FALSE(results[k.rank].ok);
    EXPECT_TRUE(contains(results[k.rank].message, "signal 9")) << results[k.rank].message;
    const auto& survivor = results[1 - k.rank];
    EXPECT_FALSE(survivor.ok);
    EXPECT_FALSE(survivor.killed) << "the survivor must fail on its own, not hang";
    EXPECT_TRUE(exists(root + "/.step_2.partial"));
    EXPECT_EQ(ckpt::latest_checkpoint(root), ckpt::step_dir(root, 1));
    EXPECT_EQ(ckpt::list_steps(root), std::vector<int64_t>{1});
    EXPECT_DOUBLE_EQ(saved_scale(ckpt::step_dir(root, 1)), 1.0);
    EXPECT_TRUE(contains(error_of([&] { load_full_sharded(ckpt::step_dir(root, 2)); }),
                         "did not complete"));
    run_ranks(
        1, [&](ProcessGroup& pg) { ckpt::save_step(sharded_sample(pg.rank(), 1, 3.0), root, 3); });
    EXPECT_FALSE(exists(root + "/.step_2.partial"));
    EXPECT_EQ(ckpt::latest_checkpoint(root), ckpt::step_dir(root, 3));
  }
}

// ---- step directories ----

// The names in a directory, sorted (hidden ones included).
std::vector<std::string> dir_names(const std::string& dir) {
  std::vector<std::string> names;
  ckpt::default_file_io().list_dir(dir, names);
  std::sort(names.begin(), names.end());
  return names;
}

// Where the file system cannot swap two directories (renameat2 says EINVAL), a save over an
// existing checkpoint moves the old one aside and renames the new one in; the old copy is removed
// and nothing else is left beside the checkpoint.
TEST(CheckpointSafety, WithoutAnAtomicSwapTwoRenamesReplaceTheCheckpoint) {
  TempDir tmp;
  const std::string root = tmp.file("run");
  const std::string dir = root + "/c";
  run_ranks(2, [&](ProcessGroup& pg) {
    ckpt::save(sharded_sample(pg.rank(), 2, 1.0), dir);
    FaultIO io;
    if (pg.rank() == 0) {
      io.op = "exchange";
      io.err = EINVAL;
      io.path_part = ".partial";
    }
    ckpt::save(sharded_sample(pg.rank(), 2, 2.0), dir, ckpt::SaveOptions().io(&io));
    fsdp::checkpoint::files::wait_for_background_removal();
  });
  EXPECT_DOUBLE_EQ(saved_scale(dir), 2.0);
  EXPECT_EQ(dir_names(root), (std::vector<std::string>{"c"}));
}

TEST(CheckpointSafety, StepsLatestAndKeepLast) {
  TempDir tmp;
  const std::string root = tmp.file("run");
  run_ranks(2, [&](ProcessGroup& pg) {
    for (int64_t step : {10, 20, 30, 40})
      ckpt::save_step(sharded_sample(pg.rank(), 2, static_cast<double>(step)), root, step,
                      ckpt::SaveOptions().keep_last(2));
    // Saving a step again replaces it in one swap.
    ckpt::save_step(sharded_sample(pg.rank(), 2, 41.0), root, 40, ckpt::SaveOptions().keep_last(2));
    // Replaced and dropped steps are renamed out of sight at once and unlinked in the
    // background; a process's exit waits for that (these ranks leave by _exit, so wait here).
    fsdp::checkpoint::files::wait_for_background_removal();
  });
  EXPECT_EQ(dir_names(root), (std::vector<std::string>{"latest", "step_30", "step_40"}));
  // Leftovers of a process that died while removing are cleared by the next save.
  ::mkdir((root + "/.step_20.partial.old").c_str(), 0755);
  write_bytes(root + "/.step_20.partial.old/__0_0.distcp", "junk");
  ::mkdir((root + "/.step_40.partial.old").c_str(), 0755);
  run_ranks(2, [&](ProcessGroup& pg) {
    ckpt::save_step(sharded_sample(pg.rank(), 2, 40.0), root, 40, ckpt::SaveOptions().keep_last(2));
    fsdp::checkpoint::files::wait_for_background_removal();
  });
  EXPECT_EQ(dir_names(root), (std::vector<std::string>{"latest", "step_30", "step_40"}));
  EXPECT_EQ(ckpt::list_steps(root), (std::vector<int64_t>{30, 40}));
  EXPECT_EQ(ckpt::latest_checkpoint(root), ckpt::step_dir(root, 40));
  EXPECT_DOUBLE_EQ(saved_scale(ckpt::step_dir(root, 40)), 40.0);
  EXPECT_DOUBLE_EQ(saved_scale(ckpt::step_dir(root, 30)), 30.0);
  EXPECT_EQ(read_bytes(root + "/latest"), "step_40\n");
  // A `latest` naming nothing committed falls back to the newest step; an empty root has none.
  write_bytes(root + "/latest", "step_99\n");
  EXPECT_EQ(ckpt::latest_checkpoint(root), ckpt::step_dir(root, 40));
  ::unlink((root + "/latest").c_str());
  EXPECT_EQ(ckpt::latest_checkpoint(root), ckpt::step_dir(root, 40));
  EXPECT_EQ(ckpt::latest_checkpoint(tmp.file("empty")), std::nullopt);
  // Names that only look like steps are not steps.
  ::mkdir((root + "/step_007").c_str(), 0755);
  ::mkdir((root + "/step_x").c_str(), 0755);
  EXPECT_EQ(ckpt::list_steps(root), (std::vector<int64_t>{30, 40}));
}

}  // namespace
