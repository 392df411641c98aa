// The `.metadata` of PyTorch DCP checkpoints (issue 11, first layer): our writer's output reads
// back; stock PyTorch's files parse and ours load in stock PyTorch (where a Python with torch >= 2
// is at hand: the trixie chroot); hostile files are rejected with a ValueError, never a crash.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>

#include "checkpoint/dcp/metadata.h"
#include "checkpoint/formats/pickle.h"
#include "fuzz_regressions.h"
#include "multi_rank.h"
#include "python_ref.h"

namespace dcp = fsdp::checkpoint::dcp;
namespace pk = fsdp::checkpoint::pickle;

namespace {

std::string dims(const std::vector<int64_t>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + std::to_string(v[i]);
  return out.empty() ? "-" : out;
}

// The canonical lines tests/dcp/dcp_python.py prints, from our parse.
std::string describe(const dcp::Metadata& m) {
  std::vector<std::string> lines;
  for (const auto& [fqn, item] : m.state_dict_metadata) {
    if (item.bytes) {
      lines.push_back("B " + fqn);
      continue;
    }
    std::string l =
        "T " + fqn + " " + dcp::dtype_name(item.tensor.dtype) + " " + dims(item.tensor.size);
    for (const auto& c : item.tensor.chunks) l += " " + dims(c.offsets) + ":" + dims(c.sizes);
    lines.push_back(l);
  }
  for (const auto& [idx, info] : m.storage_data) {
    lines.push_back("S " + idx.fqn + " " + (idx.offset ? dims(*idx.offset) : "None") + " " +
                    (idx.index ? std::to_string(*idx.index) : "None") + " " + info.relative_path +
                    " " + std::to_string(info.offset) + " " + std::to_string(info.length));
  }
  for (const auto& [key, path] : m.planner_data) {
    std::string l = "P " + key;
    for (const auto& e : path)
      l += " " + (std::holds_alternative<std::string>(e) ? std::get<std::string>(e)
                                                         : std::to_string(std::get<int64_t>(e)));
    lines.push_back(l);
  }
  std::sort(lines.begin(), lines.end());
  std::string out;
  for (const auto& l : lines) out += l + "\n";
  return out;
}

dcp::Metadata sample() {
  dcp::Metadata m;
  dcp::ItemMeta w;
  w.tensor.dtype = at::kFloat;
  w.tensor.size = {5, 4};
  w.tensor.chunks = {{{0, 0}, {3, 4}}, {{3, 0}, {2, 4}}};
  m.state_dict_metadata.emplace_back("model.w", w);
  dcp::ItemMeta s;
  s.tensor.dtype = at::kBFloat16;
  s.tensor.chunks = {{{}, {}}};
  m.state_dict_metadata.emplace_back("optim.state.w.step", s);
  dcp::ItemMeta b;
  b.bytes = true;
  m.state_dict_metadata.emplace_back("epoch", b);
  m.planner_data = {
      {"model.w", {std::string("model"), std::string("w")}},
      {"optim.param_groups.0.lr",
       {std::string("optim"), std::string("param_groups"), int64_t{0}, std::string("lr")}}};
  m.storage_data = {
      {{"model.w", std::vector<int64_t>{0, 0}, 0}, {"__0_0.distcp", 0, 1180}},
      {{"model.w", std::vector<int64_t>{3, 0}, 0}, {"__1_0.distcp", 0, 1100}},
      {{"optim.state.w.step", std::vector<int64_t>{}, 0}, {"__0_0.distcp", 1180, 700}},
      {{"epoch", std::nullopt, std::nullopt}, {"__0_0.distcp", 1880, 864}}};
  return m;
}

// Enough tensors and chunks that the writer's memo passes 256 entries (LONG_BINPUT / LONG_BINGET).
dcp::Metadata many() {
  dcp::Metadata m = sample();
  for (int i = 0; i < 300; ++i) {
    const std::string fqn = "layers." + std::to_string(i) + ".weight";
    dcp::ItemMeta w;
    w.tensor.dtype = i % 2 ? at::kFloat : at::kBFloat16;
    w.tensor.size = {4, 3};
    w.tensor.chunks = {{{0, 0}, {2, 3}}, {{2, 0}, {2, 3}}};
    m.state_dict_metadata.emplace_back(fqn, w);
    m.planner_data.emplace_back(fqn, std::vector<dcp::PathElement>{
                                         std::string("layers"), int64_t{i}, std::string("weight")});
    for (int r = 0; r < 2; ++r) {
      m.storage_data.push_back({{fqn, std::vector<int64_t>{2 * r, 0}, 0},
                                {"__" + std::to_string(r) + "_0.distcp", 24 * i, 24}});
    }
  }
  return m;
}

size_t occurrences(const std::string& hay, const std::string& needle) {
  size_t n = 0;
  for (size_t at = hay.find(needle); at != std::string::npos; at = hay.find(needle, at + 1)) ++n;
  return n;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

TEST(DcpMetadata, WrittenMetadataReadsBack) {
  const dcp::Metadata m = sample();
  const std::string bytes = dcp::serialize_metadata(m);
  const dcp::Metadata back = dcp::parse_metadata(bytes);
  EXPECT_EQ(describe(back), describe(m));
  EXPECT_EQ(back.version, "");
  dcp::Metadata v = m;
  v.version = "1.0.0";
  EXPECT_EQ(dcp::parse_metadata(dcp::serialize_metadata(v)).version, "1.0.0");
  // The canonical description notices a changed chunk (negative control).
  dcp::Metadata other = m;
  other.state_dict_metadata[0].second.tensor.chunks[1].sizes = {1, 4};
  EXPECT_NE(describe(dcp::parse_metadata(dcp::serialize_metadata(other))), describe(m));
  // Classes and field names recur for every chunk and storage entry: each is written once and
  // fetched from the memo after that, past 256 entries too.
  const dcp::Metadata big = many();
  const std::string big_bytes = dcp::serialize_metadata(big);
  EXPECT_EQ(describe(dcp::parse_metadata(big_bytes)), describe(big));
  EXPECT_EQ(occurrences(big_bytes, "ChunkStorageMetadata"), 1u);
  EXPECT_EQ(occurrences(big_bytes, "relative_path"), 1u);
  EXPECT_EQ(occurrences(big_bytes, "__1_0.distcp"), 1u);
  EXPECT_LT(big_bytes.size(), size_t{120000}) << "346 KB without the memo, 92 KB with it";
}

// Stock PyTorch writes a checkpoint; our reader sees what PyTorch's own reader sees.
TEST(DcpMetadata, PythonWrittenMetadataParses) {
  if (fsdp::testing::python().empty())
    GTEST_SKIP() << "no Python with torch >= 2 and DCP (the trixie chroot has one)";
  fsdp::testing::TempDir tmp;
  const std::string dir = tmp.file("py");
  fsdp::testing::run_command(fsdp::testing::dcp_python() + "save " + dir);
  const std::string want =
      fsdp::testing::run_command(fsdp::testing::dcp_python() + "describe " + dir);
  ASSERT_FALSE(want.empty());
  const dcp::Metadata m = dcp::parse_metadata(read_file(dir + "/.metadata"), dir);
  EXPECT_EQ(describe(m), want);
  // Every item's bytes lie inside its data file.
  for (const auto& [idx, info] : m.storage_data) {
    const std::string data = read_file(dir + "/" + info.relative_path);
    EXPECT_LE(info.offset + info.length, static_cast<int64_t>(data.size())) << idx.fqn;
  }
}

// Our metadata, read by stock PyTorch's FileSystemReader, says the same.
TEST(DcpMetadata, OurMetadataLoadsInPython) {
  if (fsdp::testing::python().empty())
    GTEST_SKIP() << "no Python with torch >= 2 and DCP (the trixie chroot has one)";
  fsdp::testing::TempDir tmp;
  const dcp::Metadata m = many();  // the memo past 256 entries, as Python reads it
  {
    std::ofstream f(tmp.file(".metadata"), std::ios::binary);
    f << dcp::serialize_metadata(m);
  }
  EXPECT_EQ(fsdp::testing::run_command(fsdp::testing::dcp_python() + "describe " + tmp.path()),
            describe(m));
}

std::string with_proto(const std::string& body) { return std::string("\x80\x02", 2) + body; }

// A byte string from a literal, NULs included.
template <size_t N>
std::string B(const char (&s)[N]) {
  return std::string(s, N - 1);
}

// A table of hostile or broken files: each is a ValueError naming the problem.
TEST(DcpMetadata, HostileFilesAreRejected) {
  const std::string good = dcp::serialize_metadata(sample());
  auto bad_meta = [](const std::function<void(dcp::Metadata&)>& edit) {
    dcp::Metadata m = sample();
    edit(m);
    return dcp::serialize_metadata(m);
  };
  const std::vector<std::pair<std::string, std::string>> cases{
      {"", "ends without STOP"},
      {with_proto(""), "ends without STOP"},
      {with_proto("\xff."), "not supported"},
      {std::string("\x80\x06N.", 4), "protocol 6"},
      {with_proto(B("cos\nsystem\n(X\x02\x00\x00\x00"
                    "lstR.")),
       "'os.system' is not allowed"},
      {with_proto(B("X\x08\x00\x00\x00"
                    "builtins"
                    "X\x04\x00\x00\x00"
                    "eval"
                    "\x93.")),
       "builtins.eval"},
      {with_proto("X\xff\xff\xff\xff"), "runs past the end"},
      {with_proto(B("\x8d\x00\x00\x00\x00\x00\x00\x00\x40")), "runs past the end"},
      {with_proto("h\x05."), "never stored"},
      {with_proto("a."), "stack underflow"},
      {with_proto("t."), "no MARK"},
      {with_proto("NN."), "expected one value"},
      {with_proto(B("}(X\x01\x00\x00\x00"
                    "aN"
                    "X\x01\x00\x00\x00"
                    "aNu.")),
       "duplicate dict key 'a'"},
      {with_proto(B("\x8a\x09\x01\x01\x01\x01\x01\x01\x01\x01\x01.")), "does not fit"},
      {with_proto("ctorch\nSize\nNR."), "REDUCE's arguments"},
      {with_proto(B("K\x01K\x01K\x02\x86\x81.")), "NEWOBJ's class"},
      {with_proto("}N."), "expected one value"},
      {with_proto("cunknown\nthing\n."), "'unknown.thing' is not allowed"},
      {with_proto("ctorch\nfloat8_e4m3fn\n."), "not allowed"},
      {with_proto("K\x07."), "expected torch.distributed.checkpoint.metadata.Metadata"},
      {with_proto(B("\x95\xff\xff\xff\xff\xff\xff\xff\x7fN.")), "frame longer"},
      {bad_meta([](dcp::Metadata& m) {
         m.state_dict_metadata[0].second.tensor.chunks[1].offsets = {4, 0};
       }),
       "leaves the tensor"},
      {bad_meta([](dcp::Metadata& m) {
         m.state_dict_metadata[0].second.tensor.size = {-5, 4};
       }),
       "negative size"},
      {bad_meta([](dcp::Metadata& m) {
         m.state_dict_metadata[0].second.tensor.chunks[0].offsets = {0};
       }),
       "dims"},
      {bad_meta([](dcp::Metadata& m) { m.storage_data[0].second.relative_path = "../evil"; }),
       "not a plain file name"},
      {bad_meta([](dcp::Metadata& m) { m.storage_data[0].second.relative_path = "/etc/passwd"; }),
       "not a plain file name"},
      // A NUL in the name: refused, and shown escaped (it would end the error's what()).
      {bad_meta([](dcp::Metadata& m) {
         m.storage_data[0].second.relative_path = std::string("__0_0.distcp\0x", 14);
       }),
       "'__0_0.distcp\\x00x' is not a plain file name"},
      {bad_meta([](dcp::Metadata& m) { m.storage_data[1].second.length = -1; }),
       "negative offset or length"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    fsdp::testing::keep_as_fuzz_regression(
        "dcp_metadata", "case" + std::to_string(i) + " " + cases[i].second, cases[i].first);
    try {
      dcp::parse_metadata(cases[i].first, "case " + std::to_string(i));
      ADD_FAILURE() << "case " << i << " was accepted";
    } catch (const fsdp::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(cases[i].second), std::string::npos)
          << "case " << i << ": " << e.what();
    }
  }
  // A BUILD applied twice, straight through the reader.
  EXPECT_THROW(pk::read(with_proto("ctorch\nSize\n)\x81NbNb."), {{"torch", "Size"}}),
               pk::PickleError);
  // Limits hold before anything large is built.
  pk::ReadLimits small;
  small.max_stack = 100;
  EXPECT_THROW(pk::read(with_proto(std::string(1000, '(') + "N."), {}, small), pk::PickleError);
  small = pk::ReadLimits();
  small.max_nodes = 50;
  EXPECT_THROW(pk::read(with_proto(std::string(60, 'N') + "."), {}, small), pk::PickleError);
  small = pk::ReadLimits();
  small.max_bytes = 10;
  EXPECT_THROW(pk::read(good, {}, small), pk::PickleError);
  // Shared parts through the memo: `a0 = []; a1 = [a0, a0]; a2 = [a1, a1]; ...`, 40 levels in
  // under 300 bytes, are 2^41 values to anything that walks the tree: refused before a walk.
  // 10 levels (2,047 as a tree) pass, and so do 21 (4,194,303) under the default max_nodes (4 Mi).
  auto laughs = [](int levels) {
    const auto byte = [](int b) { return std::string(1, static_cast<char>(b)); };
    std::string p = "]q" + byte(0);    // a0, into memo 0
    for (int i = 1; i <= levels; ++i)  // a(i-1) again from the memo, TUPLE2, into memo i
      p += "h" + byte(i - 1) + "\x86q" + byte(i);
    return with_proto(p + ".");
  };
  EXPECT_NO_THROW(pk::read(laughs(10), {}));
  EXPECT_NO_THROW(pk::read(laughs(21), {}));
  try {
    pk::read(laughs(40), {});
    ADD_FAILURE() << "2^41 values as a tree were accepted";
  } catch (const pk::PickleError& e) {
    EXPECT_NE(std::string(e.what()).find("counts more than 4194304 values as a tree"),
              std::string::npos)
        << e.what();
  }
  small = pk::ReadLimits();
  small.max_nodes = 2046;
  EXPECT_THROW(pk::read(laughs(10), {}, small), pk::PickleError);
  // Every truncation of a good file fails cleanly.
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_THROW(dcp::parse_metadata(good.substr(0, n)), fsdp::ValueError) << "prefix " << n;
  }
}

// Random byte changes of a good file: each parses or is a ValueError; nothing else happens.
TEST(DcpMetadata, MutatedFilesNeverCrash) {
  const std::string good = dcp::serialize_metadata(sample());
  std::mt19937 rng(42);
  int accepted = 0, rejected = 0;
  for (int k = 0; k < 4000; ++k) {
    std::string bad = good;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) bad[rng() % bad.size()] = static_cast<char>(rng() & 0xff);
    try {
      dcp::parse_metadata(bad);
      ++accepted;
    } catch (const fsdp::ValueError&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 2000);
  std::printf("mutated .metadata files: %d rejected, %d still parse\n", rejected, accepted);
}

// The ranks' exchange during a save (encode_wire) carries everything the merged `.metadata` is
// written from: decoding it gives back the same pickle bytes, version and requires_grad included.
TEST(DcpMetadata, WireFormRoundTrips) {
  dcp::Metadata m = sample();
  m.version = "1.0.0";
  m.state_dict_metadata[0].second.tensor.requires_grad = true;
  const std::string want = dcp::serialize_metadata(m);
  EXPECT_EQ(dcp::serialize_metadata(dcp::decode_wire(dcp::encode_wire(m), "rank 1")), want);
  const dcp::Metadata empty;
  EXPECT_EQ(dcp::serialize_metadata(dcp::decode_wire(dcp::encode_wire(empty), "rank 1")),
            dcp::serialize_metadata(empty));
  // Negative control: the comparison sees a changed chunk, dtype or storage offset.
  dcp::Metadata other = m;
  other.state_dict_metadata[0].second.tensor.chunks[1].sizes = {1, 4};
  EXPECT_NE(dcp::serialize_metadata(dcp::decode_wire(dcp::encode_wire(other), "r")), want);
  other = m;
  other.state_dict_metadata[1].second.tensor.dtype = at::kHalf;
  EXPECT_NE(dcp::serialize_metadata(dcp::decode_wire(dcp::encode_wire(other), "r")), want);
  other = m;
  other.storage_data[2].second.offset = 1181;
  EXPECT_NE(dcp::serialize_metadata(dcp::decode_wire(dcp::encode_wire(other), "r")), want);
}

// A malformed exchange message is a ValueError naming its sender, never a crash, an overread or a
// huge allocation: every truncation, trailing bytes, bad values, random corruption.
TEST(DcpMetadata, WireFormRejectsMalformedMessages) {
  const dcp::Metadata m = sample();
  const std::string good = dcp::encode_wire(m);
  for (size_t n = 0; n < good.size(); ++n)
    EXPECT_THROW(dcp::decode_wire(good.substr(0, n), "rank 3"), fsdp::ValueError) << n;
  try {
    dcp::decode_wire(good + "x", "rank 3's save report");
    ADD_FAILURE() << "trailing bytes accepted";
  } catch (const fsdp::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 3's save report"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("trailing"), std::string::npos) << e.what();
  }
  auto rejects = [](const dcp::Metadata& bad, const std::string& words) {
    try {
      dcp::decode_wire(dcp::encode_wire(bad), "rank 2");
      ADD_FAILURE() << "accepted: " << words;
    } catch (const fsdp::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  dcp::Metadata bad = m;
  bad.state_dict_metadata[0].second.tensor.chunks[1].offsets = {4, 0};  // 4 + 2 rows > 5
  rejects(bad, "leaving the tensor in dim 0");
  bad = m;
  bad.state_dict_metadata[0].second.tensor.chunks[0].sizes = {3};
  rejects(bad, "another rank");
  bad = m;
  bad.state_dict_metadata[0].second.tensor.size = {-5, 4};
  rejects(bad, "negative size");
  bad = m;
  bad.state_dict_metadata[0].second.tensor.dtype = at::kQInt8;  // no DCP name
  rejects(bad, "dtype code");
  bad = m;
  bad.storage_data[0].second.relative_path = "../__0_0.distcp";
  rejects(bad, "not a plain file name");
  bad = m;
  bad.storage_data[1].second.length = -1;
  rejects(bad, "negative offset or length");
  // A count far beyond the message (the first item count, after the empty version string).
  std::string huge = good;
  for (int k = 0; k < 8; ++k) huge[8 + k] = static_cast<char>(k == 7 ? 0x7f : 0xff);
  EXPECT_THROW(dcp::decode_wire(huge, "rank 1"), fsdp::ValueError);

  std::mt19937 rng(7);
  int rejected = 0;
  for (int k = 0; k < 4000; ++k) {
    std::string b = good;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) b[rng() % b.size()] = static_cast<char>(rng() & 0xff);
    try {
      dcp::decode_wire(b, "rank 1");
    } catch (const fsdp::ValueError&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 1000);
}

}  // namespace
